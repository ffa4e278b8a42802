"""mpisync's environment variables, read in one place each and refused when malformed."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["LOST_WORKERS_EXIT", "NUM_PS_ENV", "SURVIVE_ENV", "count", "num_ps", "number",
           "switch"]

#: The number of ps ranks the job was started for: set by ``python -m mpisync.launch --ps``
#: (and the Slurm template) on every rank, by hand under ``horovodrun``.
NUM_PS_ENV = "MPISYNC_NUM_PS"

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


def num_ps(asked: int | None, environ: Mapping[str, str] | None = None,
           rank: int | str = "?") -> int:
    """The number of ps ranks: ``init(num_ps=)`` and ``MPISYNC_NUM_PS``, which must agree.

    The argument where the variable is unset (or empty), the variable where the argument
    is None, 1 where neither is given; both given must be equal. A pure function of its
    inputs: every rank of a job reads the same environment and gets the same argument, so
    every rank returns the same number or raises the same error, before any message.

    Args:
        asked: what the program passed to ``init(num_ps=)`` (None: nothing).
        environ: the environment (default ``os.environ``).
        rank: this rank, for messages.

    Raises:
        TypeError: ``asked`` is not an int.
        ConfigError: ``MPISYNC_NUM_PS`` is not a number of ranks >= 1, or it differs from
            ``asked``; naming both values and this rank.
    """
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int)):
        raise TypeError(f"rank {rank}: num_ps must be an int, "
                        f"got {type(asked).__name__} {asked!r}")
    environ = os.environ if environ is None else environ
    launched = count(NUM_PS_ENV, 0, environ, minimum=1, expected="a number of ps ranks >= 1")
    if asked is None:
        return launched or 1
    if launched and launched != asked:
        raise ConfigError(
            f"rank {rank}: init(num_ps={asked}) but {NUM_PS_ENV}={launched}: the job was "
            f"launched for {launched} ps ranks; pass num_ps={launched} or leave it out (the "
            f"launcher's count is used), or launch with --ps {asked}", collective=True)
    return asked
