"""A worker's step in phases, for the statistics log and the timeline (only when one is on)."""
from __future__ import annotations

import time

from ..observe import timeline
from ..protocol.wire import TOKEN_STATS, TimingWord, TokenField, timing_view

__all__ = ["StepClock", "for_worker"]

_MAX_US = 0xFFFFFFFF


def _us(seconds: float) -> int:
    return min(max(int(seconds * 1e6), 0), _MAX_US)


class StepClock:
    """Times the phases of each ``step()`` on a worker.

    ``compute`` runs from the end of the previous ``step()`` (or of set-up) to the start
    of this one: the user's forward and backward passes and data loading. ``push`` is
    ``step()`` up to the gradients' sends being started; ``token wait`` lasts until the
    token arrives; ``pull`` until the new parameters are in the model. With the statistics
    log on, the four figures (microseconds) ride in the header of the next push to ps 0
    (and in the CLOSE), so the step's hot path sends nothing more and pickles nothing;
    with the timeline on, they become this rank's events.
    """

    __slots__ = ("begin_at", "dense", "last_end", "pushed_at", "step", "words")

    def __init__(self, dense, report: bool):
        self.dense = dense
        dense.timed = True
        self.words = timing_view(dense.shards[0].fields) if report else None
        self.last_end = time.perf_counter()
        self.begin_at = self.pushed_at = 0.0
        self.step = 0

    def begin(self, step: int) -> None:
        """``step()`` starts pushing a gradient computed at global step ``step``."""
        self.begin_at = time.perf_counter()
        self.step = step

    def pushed(self) -> None:
        """Every send of the push has been started."""
        self.pushed_at = time.perf_counter()

    def end(self) -> None:
        """The step's token and parameters arrived: record the four phases."""
        end = time.perf_counter()
        last, begin, pushed, token = self.last_end, self.begin_at, self.pushed_at, \
            self.dense.token_at
        words = self.words
        if words is not None:      # sent with the next push
            words[TimingWord.COMPUTE] = _us(begin - last)
            words[TimingWord.PUSH] = _us(pushed - begin)
            words[TimingWord.WAIT] = _us(token - pushed)
            words[TimingWord.PULL] = _us(end - token)
        tl = timeline.current
        if tl is not None:
            step = self.step
            tl.span("compute", last, begin, step)
            tl.span("push", begin, pushed, step)
            tl.span("token wait", pushed, token, step)
            tl.span("pull", token, end, step)
        self.last_end = end


def for_worker(dense, cluster) -> StepClock | None:
    """A clock for this worker's steps when ps 0 asked for timings or the timeline is on.

    Call after the first token arrived (it says whether ps 0 keeps the statistics log).
    """
    report = bool(int(dense.token[TokenField.FLAGS]) & TOKEN_STATS)
    if timeline.start(cluster) is None and not report:
        return None
    return StepClock(dense, report)
