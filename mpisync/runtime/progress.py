"""Waiting on MPI requests without hanging: backoff polling, stall timeouts, peer failures."""
from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque
from collections.abc import Mapping
from typing import Callable

from mpi4py import MPI

from .. import environ as env
from ..errors import PeerError, StallError
from ..protocol.wire import Tag
from .survival import Losses, improbe

__all__ = ["DEFAULT_TIMEOUT", "Pace", "Poller"]


def timeouts(environ: Mapping[str, str] | None = None) -> tuple[float, float, float, float]:
    """``MPISYNC_TIMEOUT``, ``MPISYNC_SETUP_TIMEOUT``, ``MPISYNC_STALL_WARNING`` and
    ``MPISYNC_POLL_MAX_SLEEP`` in seconds, each checked (read once, at import:
    ``mpisync.environ.read_at_import``)."""
    return (env.number("MPISYNC_TIMEOUT", environ=environ),
            env.number("MPISYNC_SETUP_TIMEOUT", environ=environ),
            env.number("MPISYNC_STALL_WARNING", environ=environ),
            env.number("MPISYNC_POLL_MAX_SLEEP", environ=environ))


# a malformed value: refused here, or by mpisync.init() on every rank of a job of several
DEFAULT_TIMEOUT, SETUP_TIMEOUT, STALL_WARNING, _MAX_SLEEP = env.read_at_import(
    timeouts, lambda: timeouts({}))
# a recurring wait sleeps through this share of the shortest of its recent lengths first
_PACE = env.read_at_import(lambda: env.number("MPISYNC_POLL_PACE"),
                           lambda: env.number("MPISYNC_POLL_PACE", environ={}))
SPIN_DEDICATED = 0.005       # seconds of busy polling when every rank has a core of its own
SPIN_SHARED = 0.0001         # when ranks share cores, spinning steals from the rank awaited


def spin_seconds(oversubscribed: bool) -> float:
    """How long a wait polls without sleeping; ``MPISYNC_POLL_SPIN_US`` overrides."""
    spin_us = env.number("MPISYNC_POLL_SPIN_US")
    if spin_us is not None:
        return spin_us * 1e-6
    return SPIN_SHARED if oversubscribed else SPIN_DEDICATED


def _precise_sleeps() -> None:
    """Ask Linux to wake this process's short sleeps on time (its default timer slack of
    50 us would make a 20 us sleep last 70 us)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)       # PR_SET_TIMERSLACK, in ns
    except (OSError, AttributeError):
        pass


_precise_sleeps()


class Pace:
    """How long a wait that recurs every step took lately.

    A wait that knows it sleeps through most of its usual length at once
    (``MPISYNC_POLL_PACE`` of the shortest of the last few, testing its requests once a
    millisecond meanwhile), so that a rank waiting for a step leaves the cores to the
    ranks doing the step, and polls finely only when the answer is due.
    """

    def __init__(self, keep: int = 8):
        self.recent: deque[float] = deque(maxlen=keep)

    def note(self, seconds: float) -> None:
        self.recent.append(seconds)

    def first_sleep(self) -> float:
        return _PACE * min(self.recent) if len(self.recent) >= 3 else 0.0


class Poller:
    """Tests requests until they complete, without spinning a shared core away.

    After ``spin`` seconds without progress it sleeps between tests, each sleep a tenth of
    the time it has waited so far (at least 10 us, at most ``MPISYNC_POLL_MAX_SLEEP``), so
    that a wait overshoots its message by a tenth at most; with ``Pace`` a wait that recurs
    every step first sleeps through most of its usual length. While it waits it watches
    for a failure notice from any rank (raising ``PeerError``) and raises ``StallError``
    when nothing completes within ``timeout`` seconds. With ``losses`` (a job that
    survives lost workers) a rank found dead meanwhile is noted there.
    """

    def __init__(self, comm: MPI.Comm, timeout: float, label: str, spin: float = SPIN_SHARED,
                 losses: Losses | None = None):
        self.comm = comm
        self.losses = losses
        self.timeout = timeout
        self.label = label
        self.spin = spin
        self._idle = 0
        self._idle_since = 0.0
        self._pace: Pace | None = None      # paces the next idle stretch (``expect``)
        self._paced = 0.0

    @contextlib.contextmanager
    def patience(self, timeout: float):
        """Within the block, waits last up to ``timeout`` seconds (set-up: MPISYNC_SETUP_TIMEOUT)."""
        saved, self.timeout = self.timeout, max(self.timeout, timeout)
        try:
            yield
        finally:
            self.timeout = saved

    def expect(self, pace: Pace) -> None:
        """The next idle stretch recurs every step: pace it, and note how long it lasts."""
        self._pace = pace

    def idle(self) -> None:
        """Called after a poll found nothing: spin, then sleep a tenth of the wait so far."""
        self._idle += 1
        now = time.perf_counter()
        if self._idle == 1:
            self._idle_since = now
            if self._pace is not None:
                self._paced = self._pace.first_sleep()
        waited = now - self._idle_since
        if waited < self._paced:
            time.sleep(min(self._paced - waited, 1e-3))
        elif waited > self.spin:
            time.sleep(min(_MAX_SLEEP, max(1e-5, 0.1 * waited)))
        if self._idle % 64 == 0:
            self.check_peer_error()

    def busy(self) -> None:
        """Called after a poll found work."""
        if self._pace is not None and self._idle:
            self._pace.note(time.perf_counter() - self._idle_since)
        self._pace = None
        self._paced = 0.0
        self._idle = 0

    def check_peer_error(self) -> None:
        """Raise ``PeerError`` if another rank announced a failure."""
        msg = improbe(self.comm, self.losses, MPI.ANY_SOURCE, Tag.ERROR)
        if msg is not None:
            raise PeerError(f"{self.label}: stopping because {msg.recv()}")

    def wait_all(self, reqs: list[MPI.Request], what: Callable[[], str],
                 pace: Pace | None = None, meanwhile: Callable[[], object] | None = None
                 ) -> None:
        """Wait for every request in ``reqs``; ``what()`` describes them for a stall error.

        With ``pace``, the wait sleeps through most of its usual length first;
        ``meanwhile()`` runs between tests (copying what shared memory brought).
        """
        start = time.monotonic()
        if pace is not None:
            t0 = time.perf_counter()
            self._sleep_through(reqs, pace.first_sleep(), t0, meanwhile)
        while not MPI.Request.Testall(reqs):
            if meanwhile is not None:
                meanwhile()
            self.idle()
            if time.monotonic() - start > self.timeout:
                raise StallError(f"{self.label}: {what()} did not arrive within "
                                 f"{self.timeout:g} s (MPISYNC_TIMEOUT)")
        self.busy()
        if pace is not None:
            pace.note(time.perf_counter() - t0)

    def wait_until(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Wait until ``done()`` (a condition on shared memory, not an MPI request)."""
        start = time.monotonic()
        while not done():
            self.idle()
            if time.monotonic() - start > self.timeout:
                raise StallError(f"{self.label}: {what()} did not happen within "
                                 f"{self.timeout:g} s (MPISYNC_TIMEOUT)")
        self.busy()

    @staticmethod
    def _sleep_through(reqs: list[MPI.Request], seconds: float, t0: float,
                       meanwhile: Callable[[], object] | None) -> None:
        """Sleep ``seconds`` from ``t0``, a millisecond at a time, unless ``reqs`` complete."""
        while True:
            left = seconds - (time.perf_counter() - t0)
            if left < 2e-5 or MPI.Request.Testall(reqs):
                return
            if meanwhile is not None:
                meanwhile()
            time.sleep(min(left, 1e-3))

    def wait_message(self, source: int, tag: int, what: Callable[[], str],
                     timeout: float | None = None, aside: bool = False):
        """Receive one pickled message (off the step's path). ``aside``: for a thread
        beside the main one (a checkpoint's writer), which leaves the pacing and the
        failure notices to the main thread and naps between looks."""
        return self.wait_probe(source, tag, None, what, timeout, aside).recv()

    def wait_probe(self, source: int, tag: int, status: MPI.Status | None,
                   what: Callable[[], str], timeout: float | None = None,
                   aside: bool = False) -> MPI.Message:
        """Wait for a message to arrive; return it matched (receive it with ``Recv``)."""
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        nap = 1e-5
        while True:
            msg = self.comm.improbe(source=source, tag=tag, status=status)
            if msg is not None:
                if not aside:
                    self.busy()
                return msg
            if aside:
                time.sleep(nap)
                nap = min(2 * nap, 1e-3)
            else:
                self.idle()
            if time.monotonic() - start > timeout:
                raise StallError(f"{self.label}: {what()} did not arrive within "
                                 f"{timeout:g} s")
