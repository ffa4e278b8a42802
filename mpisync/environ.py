"""mpisync's environment variables: declared once in ``VARIABLES``, read through the
functions below (which take each default and bound from there) and refused when malformed.

``problem()`` reads every variable set in the environment as its kind says: what
``mpisync.init()`` runs first on every rank, before any rank waits on another, so that a
malformed value on one rank is the same ``ConfigError`` on all of them.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .errors import ConfigError

__all__ = ["LOST_WORKERS_EXIT", "NUM_PS_ENV", "OFF_WORDS", "PREEMPTED_EXIT", "SURVIVE_ENV", "VARIABLES", "Variable",
           "check", "choice", "count", "default", "misspelled", "num_ps", "number", "problem",
           "read_at_import", "switch", "text"]

T = TypeVar("T")

#: The kinds read as a finite number (``number``), each with the unit messages name.
NUMBER_KINDS = {"seconds": "seconds", "share": "share of a wait",
                "microseconds": "microseconds", "MiB": "MiB (0: no limit)"}
#: The kinds any text is good for.
TEXT_KINDS = ("text", "path")
#: What a ``steps`` variable takes for off, besides a count (any case).
OFF_WORDS = ("0", "off", "false", "no")
SWITCH = "1 (on) or 0 (off)"


@dataclass(frozen=True)
class Variable:
    """One ``MPISYNC_*`` variable: its name, the kind of value, the value used when it is
    unset (``None``: unset means what ``unset`` says) and a one-line meaning.

    ``minimum`` bounds a number or a count from below (a number's ``inclusive`` lets it be
    equal), ``choices`` are the values of a ``choice``, and ``accepted`` says in words what
    a value may be where the kind alone does not (``accepts()``).
    """

    name: str
    kind: str
    default: object
    meaning: str
    unset: str = ""
    minimum: float = 0
    inclusive: bool = False
    choices: tuple[str, ...] = ()
    accepted: str = ""

    def accepts(self) -> str:
        """What a value may be, as a refusal says it (``a number of seconds > 0``)."""
        if self.accepted:
            return self.accepted
        if self.kind in NUMBER_KINDS:
            bound = ">=" if self.inclusive else ">"
            return f"a number of {NUMBER_KINDS[self.kind]} {bound} {self.minimum:g}"
        if self.kind == "count":
            return f"an integer >= {self.minimum:g}"
        if self.kind == "switch":
            return SWITCH
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return "any text"

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
             "`mpisync.init(num_ps=k)` must give the same number, or leave it out.",
             minimum=1, accepted="a number of ps ranks >= 1"),
    Variable("MPISYNC_PS_LAYOUT", "choice", None,
             "Which ranks serve: `last` (the last ranks) or `per_node` (one per node first).",
             unset="`per_node` on several nodes, else `last`", choices=("last", "per_node")),
    Variable("MPISYNC_NODE", "text", None,
             "Names this rank's node, before Slurm's node name, the launcher's map and the "
             "host name.", unset="unset"),
    Variable("MPISYNC_HOSTMAP", "host map", None,
             "The host of each rank in rank order (`a:2,b:2`); set by `python -m "
             "mpisync.launch --hosts/--hostfile`.", unset="unset",
             accepted="a host map (host:ranks,... in rank order, e.g. a:2,b:2)"),
    Variable("MPISYNC_TIMEOUT", "seconds", 1800.0,
             "Longest wait of any rank before the job ends as stalled, naming what was "
             "awaited."),
    Variable("MPISYNC_SETUP_TIMEOUT", "seconds", 3600.0,
             "Longest wait of the first set-up (imports, building the optimizer on every "
             "rank)."),
    Variable("MPISYNC_STALL_WARNING", "seconds", 60.0,
             "ps 0 names the workers it waits for after this long without a message."),
    Variable("MPISYNC_POLL_MAX_SLEEP", "seconds", 0.0005,
             "Longest sleep between two polls of a waiting rank.", inclusive=True),
    Variable("MPISYNC_POLL_PACE", "share", 0.8,
             "Share of the shortest recent length a recurring wait sleeps through first "
             "(0: off).", inclusive=True),
    Variable("MPISYNC_POLL_SPIN_US", "microseconds", None,
             "How long a wait polls without sleeping.",
             unset="5000 with a core per rank, 100 when ranks share cores", inclusive=True),
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
             "it; a worker with an open optimizer, its blocks under 32 MiB (up to 256 MiB)."),
    Variable("MPISYNC_BULK", "switch", True,
             "A worker reads every parameter's version and gradient in one compiled call."),
    Variable("MPISYNC_ROW_KERNELS", "switch", True,
             "The ps ranks' compiled loops (row updates, pooled sums, fused optimizer "
             "passes)."),
    Variable("MPISYNC_PS_THREADS", "count", None,
             "Threads each ps rank runs its row kernels on (pooled lookups, merged row "
             "gradients, row updates), bitwise the same result with any number.",
             unset="the cores of the rank's machine divided among the ps ranks there, at least 1",
             minimum=1, accepted="a number of threads >= 1"),
    Variable("MPISYNC_CACHE", "path", "~/.cache/mpisync",
             "Where compiled helpers are built and kept, once per machine."),
    Variable("MPISYNC_STATS", "path", None,
             "ps 0 writes one JSON line per global step here (`stats_log=` overrides).",
             unset="unset (no log)"),
    Variable("MPISYNC_TIMELINE", "path", None,
             "Each rank records a Chrome trace, merged into this file at the end.",
             unset="unset (no timeline)"),
    Variable("MPISYNC_TIMELINE_MAX_MB", "MiB", 0.0,
             "Cap of each rank's timeline file (0: no cap).", inclusive=True),
    Variable("MPISYNC_ATTEMPT", "count", 0,
             "Which attempt at the job this is, 0 the first; set by `python -m mpisync.launch "
             "--restarts N` on every rank of each attempt.", inclusive=True,
             accepted="an attempt number >= 0"),
    Variable("MPISYNC_FAILURE_DIR", "path", None,
             "Where a rank that fails writes what failed, at which global step (set by "
             "`python -m mpisync.launch`, which compares two attempts' failures under "
             "`--restarts N`, and fails a job whose mpiexec says 0 after a rank failed).",
             unset="unset (nothing written)"),
    Variable("MPISYNC_PROGRESS", "steps", None,
             "`0` turns `mpisync.Progress` off; a number sets its steps between lines.",
             unset="unset (as `Progress` was created)", minimum=1,
             accepted="0 (off) or the number of steps between lines"),
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

#: Exit status of a job stopped politely by SIGTERM, SIGUSR1 or SIGUSR2 (a preemption, a
#: time limit's warning): every rank finished its step and the chief wrote a checkpoint.
#: ``python -m mpisync.launch --restarts`` starts the job again at once (no attempt
#: counted as a failure); ``launch/slurm/train.sbatch`` requeues it. (75: EX_TEMPFAIL.)
PREEMPTED_EXIT = 75


def _rank() -> str:
    """This process's rank in MPI_COMM_WORLD, for messages (``?`` before MPI is up)."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return str(MPI.COMM_WORLD.Get_rank())
    except ImportError:        # pragma: no cover (mpi4py is a dependency)
        pass
    return "?"


def _world_size() -> int:
    """The number of ranks in MPI_COMM_WORLD (1 before MPI is up)."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_size()
    except ImportError:        # pragma: no cover (mpi4py is a dependency)
        pass
    return 1


def _refuse(name: str, text: str, expected: str) -> ConfigError:
    # mpisync.init() reads every variable on every rank first (problem()) and agrees on
    # what each rank found: a malformed value is the same error on every rank
    return ConfigError(f"rank {_rank()}: {name}={text!r} is not {expected}; set it to "
                       f"{expected} or unset it", collective=True)


def number(name: str, fallback: float | None = None, environ: Mapping[str, str] | None = None,
           *, minimum: float | None = None, inclusive: bool | None = None,
           what: str | None = None) -> float | None:
    """The finite number in ``name`` (its default, or ``fallback``, when unset or empty).

    ``minimum``, ``inclusive`` and the unit ``what`` default to the registry's.

    Raises:
        ConfigError: the value is not a finite number above ``minimum`` (or equal to it
            with ``inclusive``), naming the variable, its value and this rank.
    """
    var = VARIABLES[name]
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        value = default(name) if fallback is None else fallback
        return None if value is None else float(value)
    minimum = float(var.minimum) if minimum is None else minimum
    inclusive = var.inclusive if inclusive is None else inclusive
    what = NUMBER_KINDS.get(var.kind, var.kind) if what is None else what
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
          minimum: int | None = None, expected: str | None = None) -> int | None:
    """The integer in ``name`` (its default, or ``fallback``, when unset or empty), at
    least ``minimum`` (default: the registry's, said as the registry says it).

    Raises:
        ConfigError: naming the variable, its value and this rank.
    """
    var = VARIABLES[name]
    environ = os.environ if environ is None else environ
    text = environ.get(name, "")
    if not text.strip():
        return default(name) if fallback is None else fallback
    if minimum is None:
        minimum, expected = int(var.minimum), expected or var.accepts()
    expected = expected or f"an integer >= {minimum}"
    try:
        value = int(text.strip())
    except ValueError:
        raise _refuse(name, text, expected) from None
    if value < minimum:
        raise _refuse(name, text, expected)
    return value


def choice(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name``, one of its ``choices`` (its default when unset or empty).

    Raises:
        ConfigError: any other value, naming the variable, its value and this rank.
    """
    var = VARIABLES[name]
    environ = os.environ if environ is None else environ
    value = environ.get(name)
    if not value:
        return default(name)
    if value not in var.choices:
        raise _refuse(name, value, var.accepts())
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
        raise _refuse(name, text, SWITCH)
    return text == "1"


def check(name: str, environ: Mapping[str, str] | None = None,
          parse: Callable[[str], object] | None = None) -> None:
    """Read ``name`` as its kind says, to refuse a malformed value; any text is good for
    a ``text`` or a ``path``. ``parse`` reads a kind this module does not (a ``host map``:
    ``mpisync.runtime.nodes.decode_host_map``), raising ValueError on a malformed value.

    Raises:
        ConfigError: naming the variable, its value, this rank and what it accepts.
    """
    var = VARIABLES[name]
    environ = os.environ if environ is None else environ
    value = environ.get(name, "")
    if var.kind in NUMBER_KINDS:
        number(name, environ=environ)
    elif var.kind == "count" or (var.kind == "steps"
                                 and value.strip().lower() not in OFF_WORDS):
        count(name, environ=environ)
    elif var.kind == "switch":
        switch(name, environ=environ)
    elif var.kind == "choice":
        choice(name, environ)
    elif parse is not None and value.strip():
        try:
            parse(value)
        except ValueError:
            raise _refuse(name, value, var.accepts()) from None


def read_at_import(read: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``read()``, for the variables a module reads when it is imported.

    A malformed value raises here in a process alone. A rank of a job of several takes
    ``fallback()`` (the registry's defaults) instead and leaves the refusal to
    ``mpisync.init()``, which reads every variable again and raises on every rank alike:
    a rank that raised at import would leave the others waiting for it in ``init()``.
    """
    try:
        return read()
    except ConfigError:
        if _world_size() > 1:
            return fallback()
        raise


def problem(environ: Mapping[str, str] | None = None,
            parsers: Mapping[str, Callable[[str], object]] | None = None) -> str | None:
    """The first malformed variable of ``environ`` (default ``os.environ``), in
    ``VARIABLES`` order, or None: the message of the ``ConfigError`` that ``check`` raises,
    naming the variable, its value, this rank and what it accepts.

    ``parsers`` maps a variable to the ``parse`` that ``check`` takes. A pure function of
    the environment (no messages): ``mpisync.init()`` runs it on every rank and agrees on
    the outcome.
    """
    environ = os.environ if environ is None else environ
    parsers = parsers or {}
    for name in VARIABLES:
        if name in environ:
            try:
                check(name, environ, parsers.get(name))
            except ConfigError as exc:
                return str(exc)
    return None


def misspelled(environ: Mapping[str, str] | None = None) -> list[str]:
    """``MPISYNC_*`` variables of ``environ`` (default ``os.environ``) that mpisync does not
    read but that are spelled almost as one it does (a letter off, an underscore
    missing): one sentence
    each, naming both. Other ``MPISYNC_*`` names (a program's own) are left alone."""
    import difflib

    environ = os.environ if environ is None else environ
    said = []
    for name in sorted(environ):
        if name.startswith("MPISYNC_") and name not in VARIABLES:
            close = difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.85)
            if close:
                said.append(f"{name} is set, but mpisync reads no such variable: did you "
                            f"mean {close[0]}? (it is unset, so its default holds)"
                            if close[0] not in environ else
                            f"{name} is set beside {close[0]}: mpisync reads only "
                            f"{close[0]}")
    return said


def num_ps(asked: int | None, environ: Mapping[str, str] | None = None,
           rank: int | str = "?") -> int:
    """The number of ps ranks: ``init(num_ps=)`` and ``MPISYNC_NUM_PS``, which must agree.

    The argument where the variable is unset (or empty), the variable where the argument
    is None, 1 where neither is given; both given must be equal. A pure function of its
    inputs; ``init()`` then agrees on it among the ranks (one that asks for another number
    is a ``ConfigError`` on every rank).

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
    launched = count(NUM_PS_ENV, 0, environ)
    if asked is None:
        return launched or 1
    if launched and launched != asked:
        raise ConfigError(
            f"rank {rank}: init(num_ps={asked}) but {NUM_PS_ENV}={launched}: the job was "
            f"launched for {launched} ps ranks; pass num_ps={launched} or leave it out (the "
            f"launcher's count is used), or launch with --ps {asked}", collective=True)
    return asked
