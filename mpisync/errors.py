"""mpisync's exceptions: each subclasses the builtin it refines."""
from __future__ import annotations

__all__ = [
    "ClosedError",
    "ConfigError",
    "ModelMismatchError",
    "PeerError",
    "ProtocolError",
    "StallError",
    "WorldTooSmallError",
]


class _Collective:
    """Mixin: raised identically on every rank, so no rank needs to abort the job."""

    collective = True


class WorldTooSmallError(_Collective, ValueError):
    """The MPI world has too few ranks for the requested roles."""


class ConfigError(_Collective, ValueError):
    """An argument is invalid; every rank of the job raises it."""


class ModelMismatchError(_Collective, ValueError):
    """Workers disagree on parameter names, shapes or dtypes."""


class ClosedError(RuntimeError):
    """The optimizer was used after ``close()``."""


class PeerError(RuntimeError):
    """Another rank failed; this rank stops because of it."""


class StallError(RuntimeError):
    """Nothing arrived within the timeout; the message names what was awaited."""


class ProtocolError(RuntimeError):
    """A message broke mpisync's wire protocol (a bug, or mismatched versions)."""
