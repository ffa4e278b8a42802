"""What a ps rank measures of each step it applies: its APPLIED notice's figures, the timeline."""
from __future__ import annotations

import time

import numpy as np

from ..observe import timeline
from ..protocol.wire import NoticeField

__all__ = ["StepTimings"]


class StepTimings:
    """The figures of the step being applied, for its APPLIED notice and the timeline.

    Off (``enabled`` False, every method does nothing and ``clock()`` is 0) unless the
    statistics log or the timeline is on. ``reduce_s`` and ``apply_s`` (the notice's
    figures) are the time spent reducing and stepping the buckets; ``bytes_in`` and
    ``bytes_out`` the bytes of the pushes received and the parameters sent since the last
    step; ``first_arrival`` when the first push since the last step arrived.
    """

    __slots__ = ("apply_s", "bytes_in", "bytes_out", "enabled", "first_arrival", "reduce_s",
                 "started_at")

    def __init__(self) -> None:
        self.enabled = False
        self.first_arrival = 0.0
        self.bytes_in = self.bytes_out = 0
        self.started_at = self.reduce_s = self.apply_s = 0.0

    def clock(self) -> float:
        """``time.perf_counter()`` when enabled, else 0."""
        return time.perf_counter() if self.enabled else 0.0

    def arrived(self, nbytes: int) -> None:
        """A push of ``nbytes`` arrived."""
        if self.enabled:
            self.bytes_in += nbytes
            if not self.first_arrival:
                self.first_arrival = time.perf_counter()

    def sent(self, workers, lost: set[int], nbytes: int) -> None:
        """Parameters of ``nbytes`` went to ``workers`` (but those in ``lost``)."""
        if self.enabled:
            self.bytes_out += len(set(workers) - lost) * nbytes

    def begin(self, step: int) -> None:
        """``step`` starts: the timeline's ``receive`` lasts from the first push that
        arrived since the last step to now."""
        if not self.enabled:
            return
        self.started_at = now = time.perf_counter()
        self.reduce_s = self.apply_s = 0.0
        tl = timeline.current
        if tl is not None and self.first_arrival:
            tl.span("receive", self.first_arrival, now, step)

    def reduced(self, since: float) -> float:
        """A bucket was reduced, from ``since`` (a ``clock()``) to now; returns now."""
        if not self.enabled:
            return 0.0
        now = time.perf_counter()
        self.reduce_s += now - since
        return now

    def applied(self, since: float) -> None:
        """A bucket was stepped, from ``since`` (a ``clock()``) to now."""
        if self.enabled:
            self.apply_s += time.perf_counter() - since

    def report(self, step: int, since: float, applied_at: float, notice: np.ndarray,
               rows) -> None:
        """The step is applied (what followed the buckets took from ``since`` to
        ``applied_at``): its figures into its APPLIED notice (with the bytes of the table
        rows in ``rows``), its events onto the timeline.

        The timeline's ``reduce`` lasts from the step's start to the last bucket reduced
        (buckets still arriving included), ``apply`` to the last one applied and ``send``
        until every parameter send has been started (now).
        """
        if not self.enabled:
            return
        self.apply_s += applied_at - since
        sent_at = time.perf_counter()
        notice[NoticeField.APPLY_US] = int(self.apply_s * 1e6)
        notice[NoticeField.REDUCE_US] = int(self.reduce_s * 1e6)
        notice[NoticeField.BYTES_IN] = self.bytes_in + rows.bytes_in
        notice[NoticeField.BYTES_OUT] = self.bytes_out + rows.bytes_out
        self.bytes_in = self.bytes_out = rows.bytes_in = rows.bytes_out = 0
        tl = timeline.current
        if tl is not None:
            start = self.started_at
            reduced = max(start, applied_at - self.apply_s)
            tl.span("reduce", start, reduced, step)
            tl.span("apply", reduced, applied_at, step)
            tl.span("send", applied_at, sent_at, step)
        self.first_arrival = 0.0
