"""Waiting on MPI requests without hanging: backoff polling, stall timeouts, peer failures."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Callable

from mpi4py import MPI

from . import environ as env
from .errors import PeerError, StallError
from .wire import Tag

__all__ = ["DEFAULT_TIMEOUT", "Poller"]


def timeouts(environ: Mapping[str, str] | None = None) -> tuple[float, float, float, float]:
    """``MPISYNC_TIMEOUT``, ``MPISYNC_SETUP_TIMEOUT``, ``MPISYNC_STALL_WARNING`` and
    ``MPISYNC_POLL_MAX_SLEEP`` in seconds, each checked (read once, at import)."""
    return (env.number("MPISYNC_TIMEOUT", 1800, environ),
            env.number("MPISYNC_SETUP_TIMEOUT", 3600, environ),
            env.number("MPISYNC_STALL_WARNING", 60, environ),
            env.number("MPISYNC_POLL_MAX_SLEEP", 0.0005, environ, inclusive=True))


DEFAULT_TIMEOUT, SETUP_TIMEOUT, STALL_WARNING, _MAX_SLEEP = timeouts()
SPIN_DEDICATED = 0.005       # seconds of busy polling when every rank has a core of its own
SPIN_SHARED = 0.0001         # when ranks share cores, spinning steals from the rank awaited


def spin_seconds(oversubscribed: bool) -> float:
    """How long a wait polls without sleeping; ``MPISYNC_POLL_SPIN_US`` overrides."""
    spin_us = env.number("MPISYNC_POLL_SPIN_US", -1, inclusive=True, what="microseconds")
    if spin_us >= 0:
        return spin_us * 1e-6
    return SPIN_SHARED if oversubscribed else SPIN_DEDICATED


class Poller:
    """Tests requests until they complete, sleeping more the longer nothing happens.

    Busy polling steals CPU from ranks that share a core, so after ``spin`` seconds
    without progress it sleeps, doubling from 10 us up to ``MPISYNC_POLL_MAX_SLEEP``. While it waits it watches for a
    failure notice from any rank (raising ``PeerError``) and raises ``StallError``
    when nothing completes within ``timeout`` seconds.
    """

    def __init__(self, comm: MPI.Comm, timeout: float, label: str, spin: float = SPIN_SHARED):
        self.comm = comm
        self.timeout = timeout
        self.label = label
        self.spin = spin
        self._idle = 0
        self._idle_since = 0.0
        self._sleeps = 0

    @contextlib.contextmanager
    def patience(self, timeout: float):
        """Within the block, waits last up to ``timeout`` seconds (set-up: MPISYNC_SETUP_TIMEOUT)."""
        saved, self.timeout = self.timeout, max(self.timeout, timeout)
        try:
            yield
        finally:
            self.timeout = saved

    def idle(self) -> None:
        """Called after a poll found nothing: spin, then sleep with backoff."""
        self._idle += 1
        if self._idle == 1:
            self._idle_since = time.perf_counter()
        elif self._sleeps or time.perf_counter() - self._idle_since > self.spin:
            self._sleeps += 1
            time.sleep(min(_MAX_SLEEP, 1e-5 * (1 << min(self._sleeps, 10))))
        if self._idle % 64 == 0:
            self.check_peer_error()

    def busy(self) -> None:
        """Called after a poll found work."""
        self._idle = 0
        self._sleeps = 0

    def check_peer_error(self) -> None:
        """Raise ``PeerError`` if another rank announced a failure."""
        status = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=Tag.ERROR, status=status):
            notice = self.comm.recv(source=status.Get_source(), tag=Tag.ERROR)
            raise PeerError(f"{self.label}: stopping because {notice}")

    def wait_all(self, reqs: list[MPI.Request], what: Callable[[], str]) -> None:
        """Wait for every request in ``reqs``; ``what()`` describes them for a stall error."""
        start = time.monotonic()
        while not MPI.Request.Testall(reqs):
            self.idle()
            if time.monotonic() - start > self.timeout:
                raise StallError(f"{self.label}: {what()} did not arrive within "
                                 f"{self.timeout:g} s (MPISYNC_TIMEOUT)")
        self.busy()

    def wait_message(self, source: int, tag: int, what: Callable[[], str],
                     timeout: float | None = None):
        """Receive one pickled message (off the step's path)."""
        return self.wait_probe(source, tag, None, what, timeout).recv()

    def wait_probe(self, source: int, tag: int, status: MPI.Status | None,
                   what: Callable[[], str], timeout: float | None = None) -> MPI.Message:
        """Wait for a message to arrive; return it matched (receive it with ``Recv``)."""
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        while True:
            msg = self.comm.improbe(source=source, tag=tag, status=status)
            if msg is not None:
                self.busy()
                return msg
            self.idle()
            if time.monotonic() - start > timeout:
                raise StallError(f"{self.label}: {what()} did not arrive within "
                                 f"{timeout:g} s")
