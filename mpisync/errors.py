"""mpisync's exceptions: each subclasses the builtin it refines."""
from __future__ import annotations

__all__ = [
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "DeadlockError",
    "MismatchError",
    "ModelMismatchError",
    "NonFiniteError",
    "PeerError",
    "ProtocolError",
    "StallError",
    "WorldTooSmallError",
]


class _Collective:
    """Mixin for errors that every rank may raise alike.

    ``collective`` is True when every rank raises the error, so no rank needs to abort
    the job; an error raised on one rank only makes the job end (see ``mpisync.init``).
    """

    collective = True

    def __init__(self, *args: object, collective: bool | None = None) -> None:
        super().__init__(*args)
        if collective is not None:
            self.collective = collective


class WorldTooSmallError(_Collective, ValueError):
    """The MPI world has too few ranks for the requested roles."""


class ConfigError(_Collective, ValueError):
    """An argument is invalid; collective when every rank of the job raises it."""

    collective = False


class MismatchError(_Collective, ValueError):
    """Workers called a collective helper (``cluster.reduce``, ...) with values or arguments
    that do not agree: another structure, shape, dtype, operation or source."""


class ModelMismatchError(_Collective, ValueError):
    """Workers disagree on parameter names, shapes or dtypes."""


class DeadlockError(_Collective, RuntimeError):
    """No step can complete: workers inside step() wait for workers in a collective."""


class NonFiniteError(ValueError):
    """A step's gradient holds NaN or Inf (``nonfinite="raise"``)."""


class CapacityError(ValueError):
    """One lookup needs more rows on a hash-table shard than ``capacity_per_shard``."""


class ClosedError(RuntimeError):
    """The optimizer was used after ``close()``."""


class PeerError(RuntimeError):
    """Another rank failed; this rank stops because of it."""


class StallError(RuntimeError):
    """Nothing arrived within the timeout; the message names what was awaited."""


class ProtocolError(RuntimeError):
    """A message broke mpisync's wire protocol (a bug, or mismatched versions)."""
