"""Running a job's command in a process group of its own, never leaving anything of it
behind: a timeout, and signals this process gets passed on to the job first
(``python -m mpisync.launch`` and the test suite run every MPI job through ``run_job``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["FORWARDED", "TIMEOUT_EXIT_CODE", "JobResult", "handle_forwarded", "run_command",
           "run_job", "signal_job"]

#: Exit status when ``--timeout`` expires (the same as coreutils ``timeout``).
TIMEOUT_EXIT_CODE = 124

#: Signals the launcher passes on to the job's process group; after any of them it starts
#: no further attempt (``--restarts``): whoever sent it wants the job to stop.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

_PREFIX = "mpisync.launch:"


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """Send ``sig`` to the job's process group, then SIGKILL what is left.

    The launcher gets ``grace`` seconds to exit after ``sig``; whatever is still in its
    group afterwards (a rank that ignored the signal, an orphaned grandchild) is killed.
    """
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _exit_code(returncode: int) -> int:
    # A launcher killed by a signal reports -signum; a shell would say 128 + signum.
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class JobResult:
    """How a job ended: its exit status, what it printed (when captured), a timeout, and
    the first signal this process received and passed on to the job (``signalled``)."""

    returncode: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    signalled: int | None = None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_job(cmd: Sequence[str], timeout: float | None = None,
            env: Mapping[str, str] | None = None, capture: bool = False,
            cwd: str | None = None) -> JobResult:
    """Run ``cmd`` in its own process group; never leave anything of it running.

    The whole group (mpiexec and the ranks it started on this host) is killed when the
    timeout expires (status 124, ``timed_out``) or when this process gets SIGINT, SIGTERM
    or SIGHUP, which are passed on to the job first so that it can stop cleanly (SIGUSR1
    and SIGUSR2 are passed on too: a job may stop politely on them). With ``capture`` the
    job's stdout and stderr are returned as text.
    """
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(list(cmd), start_new_session=True, stdout=pipe, stderr=pipe,
                            text=capture, env=None if env is None else dict(env), cwd=cwd)
    received: list[int] = []
    previous = _forward_signals(proc, received)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
            return JobResult(_exit_code(proc.returncode), out or "", err or "",
                             signalled=received[0] if received else None)
        except subprocess.TimeoutExpired:
            print(f"{_PREFIX} the job ran past --timeout {timeout:g} s; killing it",
                  file=sys.stderr, flush=True)
            _kill_group(proc)
            out, err = proc.communicate()
            return JobResult(TIMEOUT_EXIT_CODE, out or "", err or "", timed_out=True,
                             signalled=received[0] if received else None)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:  # leave nothing behind, whatever happened above
            _kill_group(proc)


def _forward_signals(proc: subprocess.Popen, received: list[int] | None = None) -> dict:
    """Pass ``FORWARDED`` signals on to the job's group, noting each in ``received``; the
    previous handlers."""
    def forward(signum: int, frame: object) -> None:
        if received is not None:
            received.append(signum)
        signal_job(proc.pid, signum)

    return handle_forwarded(forward)


def signal_job(leader: int, signum: int) -> None:
    """Send ``signum`` to the job whose process group ``leader`` leads (its ``mpiexec``).

    To the whole group, but SIGUSR2 under MPICH's (or Intel MPI's) Hydra: its ``mpiexec``
    and ``hydra_pmi_proxy`` pass SIGUSR1 on to the ranks (each in a session of its own) but
    end on SIGUSR2, and the job with them, so SIGUSR2 goes to the processes under them on
    this host (the ranks) instead."""
    tree = _tree(leader) if signum == signal.SIGUSR2 else []
    if not any(name == "hydra_pmi_proxy" for _, name in tree):
        try:
            os.killpg(leader, signum)
        except ProcessLookupError:
            pass
        return
    for pid, name in tree:
        if pid != leader and not name.startswith("hydra_"):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _tree(root: int) -> list[tuple[int, str]]:
    """``(pid, command name)`` of ``root`` and every process under it (Linux's /proc; none
    where it cannot be read)."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        name, _, rest = stat.partition(" (")[2].rpartition(") ")
        _state, parent, *_ = [*rest.split(), "", ""]
        if parent.isdigit():
            children.setdefault(int(parent), []).append((pid, name))
    out, todo = [(root, "")], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def handle_forwarded(handler) -> dict:
    """``handler`` for each ``FORWARDED`` signal; the handlers it replaced (none off the
    main thread, where signals cannot be handled)."""
    previous = {}
    try:
        for signum in FORWARDED:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        pass
    return previous


def run_command(cmd: Sequence[str], timeout: float | None = None) -> int:
    """Run ``cmd`` as ``run_job`` does, output not captured; return its exit status."""
    return run_job(cmd, timeout=timeout).returncode
