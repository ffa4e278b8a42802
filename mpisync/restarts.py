"""When ``python -m mpisync.launch --restarts N`` starts a job again (no MPI here).

``restart_loop`` runs attempts until one succeeds (exit status 0, or ``LOST_WORKERS_EXIT``:
the job trained to its end without its lost workers), this launcher was sent a signal that
it passed on to the job, an attempt failed the same way as the failed attempt before it
(the same error on the same rank's record at the same global step:
``mpisync.runtime.failures``), or N failed attempts were started again. A job stopped
politely after a signal (``PREEMPTED_EXIT``: it wrote a checkpoint) starts again at once and
is not counted among the N. Each attempt's ranks get ``MPISYNC_ATTEMPT`` (0 for the first)
and a fresh ``MPISYNC_FAILURE_DIR``.

``launcher_status`` is what the launcher exits with: the last attempt's status, except that
a job sent SIGUSR1 or SIGUSR2 through the launcher that then failed (a rank that made no
``mpisync.Checkpointer`` yet, still importing or loading, is ended by the signal's default
action) reports ``PREEMPTED_EXIT`` too: a preempted job resumes from its newest checkpoint
however its ranks ended.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Protocol

from .environ import LOST_WORKERS_EXIT, PREEMPTED_EXIT
from .runtime.failures import (
    FAILURE_DIR_ENV,
    describe,
    origin,
    read_failures,
    read_stop,
    same_failure,
)

__all__ = ["ATTEMPT_ENV", "Outcome", "launcher_status", "restart_loop"]

#: Which attempt at the job the ranks run, 0 the first (set on every rank by the launcher).
ATTEMPT_ENV = "MPISYNC_ATTEMPT"

_PREFIX = "mpisync.launch:"

#: The signals that ask a job to stop and be started again later (a preemption, a time
#: limit's warning), as opposed to SIGINT, SIGTERM and SIGHUP, which ask it to end.
POLITE = (signal.SIGUSR1, signal.SIGUSR2)


class Outcome(Protocol):
    """How an attempt ended, as ``mpisync.launch.JobResult`` says it."""

    @property
    def returncode(self) -> int: ...
    @property
    def timed_out(self) -> bool: ...
    @property
    def signalled(self) -> int | None: ...


def _say(text: str) -> None:
    print(f"{_PREFIX} {text}", file=sys.stderr, flush=True)


def launcher_status(result: Outcome, say: Callable[[str], None] = _say,
                    stopped_at: int | None = None) -> int:
    """The launcher's exit status after its last attempt: the attempt's, or
    ``PREEMPTED_EXIT`` (saying why) when this launcher passed SIGUSR1 or SIGUSR2 on to the
    job and the job then failed instead of stopping politely: a rank that was not yet
    listening for the signal (no ``mpisync.Checkpointer`` made yet) was ended by it, so
    the newest checkpoint, if any, is where to resume (Slurm's template requeues on it)."""
    status = result.returncode
    if (result.signalled not in POLITE or result.timed_out
            or status in (0, PREEMPTED_EXIT, LOST_WORKERS_EXIT)):
        return status
    name = signal.Signals(result.signalled).name
    if stopped_at is not None:      # the chief's record: it stopped and wrote its checkpoint
        say(f"exit status {PREEMPTED_EXIT}, not {status}: this launcher passed {name} on to "
            f"the job, which stopped politely at global step {stopped_at} with a checkpoint; "
            f"a signal ended its ranks while they exited; resume from that checkpoint")
        return PREEMPTED_EXIT
    say(f"exit status {PREEMPTED_EXIT}, not {status}: this launcher passed "
        f"{name} on to the job, which ended by it before "
        f"every rank could stop politely (a rank ends by the signal until its "
        f"mpisync.Checkpointer is made); resume from the newest checkpoint")
    return PREEMPTED_EXIT


def _why(result: Outcome, stop: int | None, polite: bool,
         explain: Callable[[int], str]) -> str:
    """How an attempt ended, in words; ``stop``: the global step of its polite stop, if
    recorded; ``polite``: a stop with steps since the last one."""
    status = result.returncode
    if result.timed_out:
        return "the job ran past --timeout"
    if status != PREEMPTED_EXIT:
        return explain(status)
    if polite:
        return (f"the job stopped after a signal and wrote a checkpoint at global step "
                f"{stop} (exit status {status})")
    if stop is not None:
        return (f"the job stopped after a signal again at global step {stop}, no step "
                f"since the last stop (exit status {status})")
    return (f"the job exited with status {status} but recorded no polite stop "
            f"(mpisync.Checkpointer records one with its checkpoint)")


def restart_loop(run: Callable[[dict[str, str]], Outcome], explain: Callable[[int], str],
                 restarts: int, backoff: float, base: str,
                 say: Callable[[str], None] = _say,
                 sleep: Callable[[float], None] = time.sleep, lost_ok: bool = True) -> int:
    """Run attempts of a job until it need not, or must not, start again; the exit status
    of the last one.

    Args:
        run: runs one attempt with these extra variables on every rank; how it ended.
        explain: what a failed exit status says (``mpisync.launch.explain_status``).
        restarts: how many failed attempts may be started again (>= 0).
        backoff: seconds to wait before starting a failed attempt again.
        base: an existing directory; attempt k's ranks write their failure records into
            ``<base>/attempt-<k>`` (made here).
        say: prints one line for the user (stderr, after ``mpisync.launch:``).
        sleep: waits ``backoff`` seconds.
        lost_ok: exit status ``LOST_WORKERS_EXIT`` means the job trained to its end (it
            survives lost workers); else it is a failure like any other (a program's own
            ``sys.exit(3)``).
    """
    attempt, failures, previous, stopped_at = 0, 0, None, None
    while True:
        failure_dir = os.path.join(base, f"attempt-{attempt}")
        os.makedirs(failure_dir, exist_ok=True)
        result = run({ATTEMPT_ENV: str(attempt), FAILURE_DIR_ENV: failure_dir})
        status = result.returncode
        if status == 0 or (status == LOST_WORKERS_EXIT and lost_ok):
            return status
        stop = read_stop(failure_dir) if status == PREEMPTED_EXIT else None
        polite = stop is not None and stop != stopped_at      # a stop, and steps since
        why = _why(result, stop, polite, explain)
        if result.signalled is not None:
            say(f"{why}; not starting it again: this launcher was sent "
                f"{signal.Signals(result.signalled).name}")
            return launcher_status(result, say, read_stop(failure_dir))
        # attempts: those started so far and the next, and the failures that may follow
        attempt += 1
        total = attempt + 1 + restarts - failures
        if polite:
            previous, stopped_at = None, stop
            say(f"attempt {attempt + 1} of {total}: {why}; starting it again at once")
            continue
        first = origin(read_failures(failure_dir))
        if same_failure(previous, first):
            say(why)
            say(f"the job failed the same way twice ({describe(first)}): not starting it "
                f"again (a bug is not a fault)")
            return status
        if failures >= restarts:
            say(f"{why}; what failed first: {describe(first)}")
            say(f"gave up after {restarts} restart{'' if restarts == 1 else 's'}")
            return status
        failures, previous = failures + 1, first
        say(f"attempt {attempt + 1} of {total - 1}: {why}; what failed first: "
            f"{describe(first)}; starting the job again in {backoff:g} s")
        sleep(backoff)
