"""mpisync's environment variables, read in one place each and refused when malformed."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["LOST_WORKERS_EXIT", "SURVIVE_ENV", "count", "number", "switch"]

#: Set (``1``) by ``python -m mpisync.launch --survive-worker-loss`` on every rank.
SURVIVE_ENV = "MPISYNC_SURVIVE_WORKER_LOSS"

#: Exit status of every rank that saw workers lost in a job that survived them (the job
#: trained to its end without them); ``python -m mpisync.launch`` passes it on.
LOST_WORKERS_EXIT = 3


def _rank() -> str:
    """This process's rank in MPI_COMM_WORLD, for messages (``?`` before MPI is up)."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return str(MPI.COMM_WORLD.Get_rank())
    except ImportError:        # pragma: no cover (mpi4py is a dependency)
        pass
    return "?"


def _refuse(name: str, text: str, expected: str) -> ConfigError:
    # every rank reads the same environment: each raises the same error
    return ConfigError(f"rank {_rank()}: {name}={text!r} is not {expected}; set it to "
                       f"{expected} or unset it", collective=True)


def number(name: str, default: float, environ: Mapping[str, str] | None = None, *,
           minimum: float = 0.0, inclusive: bool = False, what: str = "seconds") -> float:
    """The finite number in ``name`` (``default`` when unset or empty).

    Raises:
        ConfigError: the value is not a finite number above ``minimum`` (or equal to it
            with ``inclusive``), naming the variable, its value and this rank.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        return float(default)
    bound = ">=" if inclusive else ">"
    expected = f"a number of {what} {bound} {minimum:g}"
    try:
        value = float(text)
    except ValueError:
        raise _refuse(name, text, expected) from None
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
        raise _refuse(name, text, expected)
    return value


def count(name: str, default: int, environ: Mapping[str, str] | None = None, *,
          minimum: int = 0, expected: str | None = None) -> int:
    """The integer in ``name`` (``default`` when unset or empty), at least ``minimum``.

    Raises:
        ConfigError: naming the variable, its value and this rank.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        return default
    expected = expected or f"an integer >= {minimum}"
    try:
        value = int(text.strip())
    except ValueError:
        raise _refuse(name, text, expected) from None
    if value < minimum:
        raise _refuse(name, text, expected)
    return value


def switch(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """``1`` or ``0`` in ``name`` (``default`` when unset or empty).

    Raises:
        ConfigError: any other value, naming the variable, its value and this rank.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise _refuse(name, text, "1 (on) or 0 (off)")
    return text == "1"
