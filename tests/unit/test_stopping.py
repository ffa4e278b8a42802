"""The flag-only signal handlers of a polite stop (``mpisync.runtime.stopping``), in one
process: installed and counted, noting signals instead of dying, restored by the last
share given back; and a ps rank that ends the job when the workers do not stop."""
from __future__ import annotations

import signal
import threading

import pytest

from mpisync.ps.loop import _check_stopped
from mpisync.runtime import stopping
from mpisync.runtime.progress import STALL_WARNING


@pytest.fixture
def own_handlers():
    """Handlers of this test's own for the three signals; put back as they were after."""
    seen: list[int] = []

    def mine(signum, frame):
        seen.append(signum)

    before = {s: signal.signal(s, mine) for s in stopping.SIGNALS}
    yield mine, seen
    while stopping.installed():
        stopping.release()
    for s, handler in before.items():
        signal.signal(s, handler)


def test_the_handlers_note_each_signal_and_the_last_share_restores_the_previous(own_handlers):
    mine, seen = own_handlers
    assert stopping.received() is None and not stopping.installed()
    assert stopping.install() and stopping.install()           # two shares
    assert all(signal.getsignal(s) is not mine for s in stopping.SIGNALS)
    signal.raise_signal(signal.SIGUSR1)
    signal.raise_signal(signal.SIGTERM)                        # noted, not fatal
    assert stopping.received() == signal.SIGUSR1 and seen == []
    stopping.release()
    assert stopping.installed() and stopping.received() == signal.SIGUSR1
    stopping.reset()
    assert stopping.received() is None
    signal.raise_signal(signal.SIGUSR2)
    assert stopping.received() == signal.SIGUSR2
    stopping.release()                                         # the last share
    assert not stopping.installed() and stopping.received() is None
    assert all(signal.getsignal(s) is mine for s in stopping.SIGNALS)
    signal.raise_signal(signal.SIGUSR1)
    assert seen == [signal.SIGUSR1] and stopping.received() is None
    stopping.release()                                         # nothing held: nothing done
    assert signal.getsignal(signal.SIGUSR1) is mine


def test_from_init_on_sigusr1_and_sigusr2_are_noted_sigterm_is_not(own_handlers):
    """``listen_early`` (``mpisync.init()``): a signal at its default is noted from then on,
    a handler of the program's is left alone, SIGTERM is not taken; a Checkpointer's share
    sees what was noted early, and its release puts the early note back."""
    mine, seen = own_handlers
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)                # as in a new process
    try:
        stopping.listen_early()
        early = signal.getsignal(signal.SIGUSR1)
        assert early not in (signal.SIG_DFL, mine)
        assert signal.getsignal(signal.SIGUSR2) is mine and signal.getsignal(signal.SIGTERM) is mine
        signal.raise_signal(signal.SIGUSR1)                      # noted, not fatal
        assert stopping.received() == signal.SIGUSR1 and not stopping.installed()
        assert stopping.install() and stopping.received() == signal.SIGUSR1
        stopping.release()
        assert signal.getsignal(signal.SIGUSR1) is early and stopping.received() is None
        assert seen == []
    finally:
        stopping.reset()


def test_once_stopping_a_second_signal_is_ignored_to_the_end(own_handlers):
    """A job that stops politely ignores further signals (a time limit's warning, then its
    SIGTERM) from the moment it knows, and a release does not undo that; at exit, the
    signals still noted are ignored (MPI finalizes after Python gave them their defaults
    back), SIGTERM only where a stop was asked for."""
    _mine, seen = own_handlers
    try:
        assert stopping.install()
        stopping.ignore_from_now()
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in stopping.SIGNALS)
        stopping.release()
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in stopping.SIGNALS)
        assert not stopping.installed() and stopping.received() is None
        signal.raise_signal(signal.SIGTERM)                      # ignored: still here
        for s in stopping.SIGNALS:
            signal.signal(s, stopping._note)
        stopping._quiet_at_exit()                                # nothing asked for a stop
        assert [signal.getsignal(s) is signal.SIG_IGN for s in stopping.SIGNALS] == [
            False, True, True]                                   # SIGTERM, SIGUSR1, SIGUSR2
        signal.signal(signal.SIGUSR1, stopping._note)
        signal.raise_signal(signal.SIGUSR1)
        stopping._quiet_at_exit()                                # a stop was asked for
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in stopping.SIGNALS)
        assert seen == []
    finally:
        stopping.reset()


def test_off_the_main_thread_nothing_is_installed(own_handlers):
    mine, _ = own_handlers
    took: list[bool] = []
    def elsewhere():
        took.append(stopping.install())
        stopping.listen_early()
        stopping.ignore_from_now()
        stopping._quiet_at_exit()

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert took == [False] and not stopping.installed()
    assert all(signal.getsignal(s) is mine for s in stopping.SIGNALS)


def test_a_ps_rank_ends_the_job_when_the_workers_do_not_stop_after_a_signal(own_handlers):
    stopping.install()
    _check_stopped("ps 0 (rank 2 on h)", STALL_WARNING * 10)   # no signal: serve on
    signal.raise_signal(signal.SIGTERM)
    _check_stopped("ps 0 (rank 2 on h)", STALL_WARNING / 2)    # the workers may be saving
    with pytest.raises(RuntimeError) as err:
        _check_stopped("ps 0 (rank 2 on h)", STALL_WARNING + 1)
    assert str(err.value) == (
        f"ps 0 (rank 2 on h): sent SIGTERM, and nothing came from the workers for "
        f"{STALL_WARNING:g} s (MPISYNC_STALL_WARNING) since: they are not stopping politely "
        f"(only a program with an mpisync.Checkpointer does); ending the job")
