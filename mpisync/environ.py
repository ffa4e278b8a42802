"""mpisync's environment variables: declared once in ``VARIABLES``, read through the
functions below (which take each default from there) and refused when malformed."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["LOST_WORKERS_EXIT", "NUM_PS_ENV", "SURVIVE_ENV", "VARIABLES", "Variable", "count",
           "default", "num_ps", "number", "switch", "text"]


@dataclass(frozen=True)
class Variable:
    """One ``MPISYNC_*`` variable: its name, the kind of value, the value used when it is
    unset (``None``: unset means what ``unset`` says) and a one-line meaning."""

    name: str
    kind: str
    default: object
    meaning: str
    unset: str = ""

    def shown_default(self) -> str:
        """The default as the reference table shows it."""
        if self.unset:
            return self.unset
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return "unset" if self.default is None else f"{self.default:g}" if isinstance(
            self.default, float) else str(self.default)


#: Every variable mpisync reads, one entry each: the code that reads one takes its default
#: from here, and the docs' table of variables is generated from this list.
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("MPISYNC_NUM_PS", "count", 1,
             "Number of ps ranks the job was launched for (the launcher sets it); "
             "`mpisync.init(num_ps=k)` must give the same number, or leave it out."),
    Variable("MPISYNC_PS_LAYOUT", "choice", None,
             "Which ranks serve: `last` (the last ranks) or `per_node` (one per node first).",
             unset="`per_node` on several nodes, else `last`"),
    Variable("MPISYNC_NODE", "text", None,
             "Names this rank's node, before Slurm's node name, the launcher's map and the "
             "host name.", unset="unset"),
    Variable("MPISYNC_HOSTMAP", "text", None,
             "The host of each rank in rank order (`a:2,b:2`); set by `python -m "
             "mpisync.launch --hosts/--hostfile`.", unset="unset"),
    Variable("MPISYNC_TIMEOUT", "seconds", 1800.0,
             "Longest wait of any rank before the job ends as stalled, naming what was "
             "awaited."),
    Variable("MPISYNC_SETUP_TIMEOUT", "seconds", 3600.0,
             "Longest wait of the first set-up (imports, building the optimizer on every "
             "rank)."),
    Variable("MPISYNC_STALL_WARNING", "seconds", 60.0,
             "ps 0 names the workers it waits for after this long without a message."),
    Variable("MPISYNC_POLL_MAX_SLEEP", "seconds", 0.0005,
             "Longest sleep between two polls of a waiting rank."),
    Variable("MPISYNC_POLL_PACE", "share", 0.8,
             "Share of the shortest recent length a recurring wait sleeps through first "
             "(0: off)."),
    Variable("MPISYNC_POLL_SPIN_US", "microseconds", None,
             "How long a wait polls without sleeping.",
             unset="5000 with a core per rank, 100 when ranks share cores"),
    Variable("MPISYNC_SURVIVE_WORKER_LOSS", "switch", False,
             "Go on when workers die (Open MPI with `--with-ft ulfm`); set by "
             "`--survive-worker-loss`."),
    Variable("MPISYNC_SHARED_MEMORY", "switch", None,
             "A worker and a ps rank on one machine exchange a step through shared memory.",
             unset="1 on x86-64 Linux, else 0"),
    Variable("MPISYNC_STAGE_CPU", "switch", False,
             "Stage CPU parameters through host copies, as GPU ones are (the CPU suite's "
             "way to test that path)."),
    Variable("MPISYNC_KEEP_HEAP", "switch", True,
             "A serving ps rank keeps freed memory in glibc's heap instead of unmapping "
             "it."),
    Variable("MPISYNC_BULK", "switch", True,
             "A worker reads every parameter's version and gradient in one compiled call."),
    Variable("MPISYNC_ROW_KERNELS", "switch", True,
             "The ps ranks' compiled loops (row updates, pooled sums, fused optimizer "
             "passes)."),
    Variable("MPISYNC_CACHE", "path", "~/.cache/mpisync",
             "Where compiled helpers are built and kept, once per machine."),
    Variable("MPISYNC_STATS", "path", None,
             "ps 0 writes one JSON line per global step here (`stats_log=` overrides).",
             unset="unset (no log)"),
    Variable("MPISYNC_TIMELINE", "path", None,
             "Each rank records a Chrome trace, merged into this file at the end.",
             unset="unset (no timeline)"),
    Variable("MPISYNC_TIMELINE_MAX_MB", "MiB", 0.0,
             "Cap of each rank's timeline file (0: no cap)."),
    Variable("MPISYNC_PROGRESS", "count", None,
             "`0` turns `mpisync.Progress` off; a number sets its steps between lines.",
             unset="unset (as `Progress` was created)"),
)}


def default(name: str):
    """The value ``name`` takes when it is unset (``VARIABLES``)."""
    return VARIABLES[name].default


def text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text in ``name``, or its default when unset or empty."""
    environ = os.environ if environ is None else environ
    return environ.get(name) or default(name)

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


def number(name: str, fallback: float | None = None, environ: Mapping[str, str] | None = None,
           *, minimum: float = 0.0, inclusive: bool = False, what: str = "seconds"
           ) -> float | None:
    """The finite number in ``name`` (its default, or ``fallback``, when unset or empty).

    Raises:
        ConfigError: the value is not a finite number above ``minimum`` (or equal to it
            with ``inclusive``), naming the variable, its value and this rank.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        value = default(name) if fallback is None else fallback
        return None if value is None else float(value)
    bound = ">=" if inclusive else ">"
    expected = f"a number of {what} {bound} {minimum:g}"
    try:
        value = float(text)
    except ValueError:
        raise _refuse(name, text, expected) from None
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
        raise _refuse(name, text, expected)
    return value


def count(name: str, fallback: int | None = None, environ: Mapping[str, str] | None = None, *,
          minimum: int = 0, expected: str | None = None) -> int | None:
    """The integer in ``name`` (its default, or ``fallback``, when unset or empty), at
    least ``minimum``.

    Raises:
        ConfigError: naming the variable, its value and this rank.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        return default(name) if fallback is None else fallback
    expected = expected or f"an integer >= {minimum}"
    try:
        value = int(text.strip())
    except ValueError:
        raise _refuse(name, text, expected) from None
    if value < minimum:
        raise _refuse(name, text, expected)
    return value


def switch(name: str, fallback: bool | None = None,
           environ: Mapping[str, str] | None = None) -> bool | None:
    """``1`` or ``0`` in ``name`` (its default, or ``fallback``, when unset or empty).

    Raises:
        ConfigError: any other value, naming the variable, its value and this rank.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip()
    if not text:
        return default(name) if fallback is None else fallback
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
