"""Stopping politely: flag-only handlers for SIGTERM, SIGUSR1 and SIGUSR2.

A preemption or a time limit's warning (Slurm's ``--signal=B:USR1@120``, ``scancel
--signal``, ``kill``) must not end a rank in the middle of a step: the handlers installed
here only note the signal. A worker's ``mpisync.Checkpointer`` reads the note after each
step, the workers agree that one of them was signalled, the chief saves and every worker
exits with ``PREEMPTED_EXIT``; a ps rank serves on until every worker has left.

The handlers are counted: each ``install()`` that succeeded takes a share and each
``release()`` gives one back; the last one out restores the handlers that were there
before. Signals can be handled only by the main thread: elsewhere ``install()`` does
nothing and says so.

SIGUSR1 and SIGUSR2 are noted from ``mpisync.init()`` on (``listen_early``): a warning that
comes before the ``Checkpointer`` exists (while the model is built or the tables placed)
then stops the job at its first ``maybe_save()`` instead of ending the rank (their default
action) or vanishing (MPICH's own handler, installed by ``MPI_Init``, drops them).
SIGTERM keeps its default until a ``Checkpointer`` takes it: a program without one still
ends on it.
"""
from __future__ import annotations

import atexit
import signal
import threading
from typing import Any

__all__ = ["EARLY", "SIGNALS", "ignore_from_now", "install", "installed", "listen_early",
           "received", "release", "reset"]

#: The signals that ask a job to stop politely.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
#: The signals noted from ``mpisync.init()`` on (``listen_early``).
EARLY = (signal.SIGUSR1, signal.SIGUSR2)

_previous: dict[int, Any] = {}
_shares = 0
_received: list[int] = []


def _note(signum: int, frame: object) -> None:
    """The handler: note the signal, nothing else (it runs between two bytecodes)."""
    _received.append(signum)


def listen_early() -> None:
    """Note ``EARLY`` signals from now on where no Python handler has them yet (their
    default, or a handler of native code such as MPI's); a handler the program set is left
    alone. Main thread only (elsewhere nothing is done)."""
    global _at_exit
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in EARLY:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _note)
    if not _at_exit:
        atexit.register(_quiet_at_exit)
        _at_exit = True


_at_exit = False


def _quiet_at_exit() -> None:
    """At exit, a signal that asks for a polite stop has nothing left to stop: ignored from
    here on where it was noted, so that one that comes while MPI finalizes (after Python
    gave its signals their defaults back) does not end the rank, and turn a job that
    stopped politely into a failed one. SIGTERM too where a stop was asked for already."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        if signal.getsignal(signum) is _note and (signum in EARLY or _received):
            signal.signal(signum, signal.SIG_IGN)


def ignore_from_now() -> None:
    """Ignore ``SIGNALS`` from now on (the job stops politely already: a second signal, as a
    time limit's warning followed by its SIGTERM, has nothing left to ask); the last
    ``release()`` leaves them ignored. Main thread only."""
    global _ignoring
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _ignoring = True


_ignoring = False


def install() -> bool:
    """Take a share of the flag-only handlers, installing them if none is held; whether
    this call took one (False off the main thread, where signals cannot be handled)."""
    global _shares
    if threading.current_thread() is not threading.main_thread():
        return False
    if _shares == 0:
        for signum in SIGNALS:
            _previous[signum] = signal.signal(signum, _note)
    _shares += 1
    return True


def release() -> None:
    """Give back one share; the last restores the handlers found by the first
    ``install()`` (unless ``ignore_from_now`` was called) and forgets what was received.
    Call from the main thread."""
    global _shares, _ignoring
    if _shares == 0:
        return
    _shares -= 1
    if _shares == 0:
        for signum, handler in _previous.items():
            if not _ignoring:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _previous.clear()
        _received.clear()
        _ignoring = False


def installed() -> bool:
    """Whether the flag-only handlers are in place."""
    return _shares > 0


def received() -> int | None:
    """The first signal noted since the handlers were installed, or None."""
    return _received[0] if _received else None


def reset() -> None:
    """Forget the signals noted so far (the handlers stay)."""
    _received.clear()
