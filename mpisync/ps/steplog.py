"""ps 0's statistics log (``MPISYNC_STATS``): one JSON line per global step (no MPI).

The first line describes the job: ``{"job": {"opt", "num_workers", "num_ps",
"replicas_to_aggregate", "asynchronous", "global_step", "t", "attempt"}}``. Then one line
per global step, in order::

    {"opt": 0, "step": 41, "applied": true, "t": 1718000000.123456,
     "step_ms": 4.1, "decide_ms": 2.5, "taken": [0, 1], "dropped": [2],
     "pushes": [{"worker": 2, "at": 39, "taken": false, "compute_ms": 23.4,
                 "push_ms": 0.2, "wait_ms": 1.9, "pull_ms": 0.4}, ...],
     "apply_ms": [1.1], "reduce_ms": [0.6], "bytes_in": [8388736], "bytes_out": [8388672]}

- ``pushes``: every gradient this line accounts for, each exactly once over the log: the
  ones the step took (``taken``) and the ones dropped while the step was open (computed at
  an older step, or too late for this one), each with the step it was computed at
  (``at``) and the pushing worker's timings of that ``step()`` call (null when the worker
  did not report them). ``taken`` and ``dropped`` list their workers.
- ``t``: wall-clock seconds when every ps had applied the step; ``step_ms``: since the
  previous step was applied (the first: since ps 0 started serving); ``decide_ms``: from
  the first gradient the step took reaching ps 0 to the decision.
- ``apply_ms``/``reduce_ms``: per ps, the optimizer (and buffers, averages) and the
  reduction of the taken gradients; ``bytes_in``/``bytes_out``: per ps, the bytes of
  gradients and table rows received and of parameters and rows sent since that ps
  applied the previous step.
- The last line may have ``"applied": false``: the open step when training ended; the
  gradients it held count as dropped, as ``opt.stats`` counts them.

A job started again (``MPISYNC_ATTEMPT`` above 0, as ``python -m mpisync.launch
--restarts`` sets it) appends to the log instead of overwriting it: its first line is
again a ``"job"`` line, with its ``"attempt"`` and the ``"global_step"`` it starts from
(the step of the checkpoint it loaded before its first step, if any: the line waits for
the attempt's first step line). The first attempt truncates the file.

Workers report their timings in the header of their next push (or of their close), so a
line is written once each of its pushes' timings arrived: a step or so late, longer for
a worker that is slow to push again (lines wait for at most ``MAX_HELD`` steps).
"""
from __future__ import annotations

import json
import os
import time
from collections import deque

from .. import environ
from ..protocol.wire import NoticeField

__all__ = ["StepLog", "log_path"]

MAX_HELD = 1000        # lines held for timings at most; older ones are written without
FLUSH_SECONDS = 1.0


def log_path(stats_log, opt_id: int) -> str | None:
    """Where optimizer ``opt_id`` logs its statistics (``stats_log=`` of the optimizer).

    None: ``MPISYNC_STATS`` if set, for the first optimizer as given and for the k-th
    after it as ``<stem>.opt<k><suffix>``; a path: that path; False: no log.

    Raises:
        TypeError: ``stats_log`` is neither a path, None nor False.
    """
    if stats_log is False:
        return None
    if stats_log is None:
        path = environ.text("MPISYNC_STATS")
        if not path:
            return None
        if opt_id:
            stem, suffix = os.path.splitext(path)
            path = f"{stem}.opt{opt_id}{suffix}"
        return path
    if isinstance(stats_log, bool) or not isinstance(stats_log, (str, os.PathLike)):
        raise TypeError(f"stats_log must be a path, None (MPISYNC_STATS) or False, got "
                        f"{stats_log!r}")
    return os.fspath(stats_log)


class _Push:
    __slots__ = ("arrived", "at", "taken", "timed", "times", "worker")

    def __init__(self, worker: int, at: int, arrived: float):
        self.worker, self.at, self.arrived = worker, at, arrived
        self.taken = False
        self.timed = False     # its timings arrived (or never will)
        self.times: list[float] | None = None


class _Line:
    __slots__ = ("applied", "apply_ms", "bytes_in", "bytes_out", "decide_ms", "pushes",
                 "reduce_ms", "step", "step_ms", "t")

    def __init__(self, num_ps: int):
        self.pushes: list[_Push] = []
        self.step = -1
        self.applied = False
        self.t = 0.0
        self.step_ms = self.decide_ms = None
        self.apply_ms: list[float | None] = [None] * num_ps
        self.reduce_ms: list[float | None] = [None] * num_ps
        self.bytes_in: list[int | None] = [None] * num_ps
        self.bytes_out: list[int | None] = [None] * num_ps


class StepLog:
    """What ps 0's coordinator saw of each global step, written as JSON lines to ``path``.

    The coordinator calls ``pushed`` for every gradient (dropped or held), ``decided`` when
    a step takes its gradients, ``applied`` for each ps's APPLIED notice, ``step_applied``
    once every ps applied the step (then ``write_ready`` when the tokens are out),
    ``closed`` for a worker's close and ``finish`` at the end. Times are
    ``time.perf_counter()`` seconds.
    """

    def __init__(self, path: str, *, opt_id: int, num_workers: int, num_ps: int,
                 replicas_to_aggregate: int, asynchronous: bool, global_step: int):
        self.path = path
        self.opt_id = opt_id
        self.num_ps = num_ps
        attempt = environ.count("MPISYNC_ATTEMPT") or 0
        # a later attempt appends to the lines of the earlier ones; open until finish()
        self.file = open(path, "a" if attempt else "w", encoding="utf-8")  # noqa: SIM115
        self.current = _Line(num_ps)
        self.done: deque[_Line] = deque()
        self.pending: list[deque[_Push]] = [deque() for _ in range(num_workers)]
        self.last: list[_Push | None] = [None] * num_workers
        self.last_applied = time.perf_counter()
        self.flushed_at = self.last_applied
        self.job: dict | None = {
            "opt": opt_id, "num_workers": num_workers, "num_ps": num_ps,
            "replicas_to_aggregate": replicas_to_aggregate, "asynchronous": asynchronous,
            "global_step": global_step, "t": round(time.time(), 6), "attempt": attempt}
        if not attempt:
            self._write_job()       # a later attempt's waits for the step it loads

    def _write_job(self) -> None:
        if self.job is not None:
            self.file.write(json.dumps({"job": self.job}) + "\n")
            self.file.flush()
            self.job = None

    # -- events ---------------------------------------------------------------------------
    def loaded(self, global_step: int) -> None:
        """A state was loaded: before the first step, the attempt starts from its step."""
        if self.job is not None:
            self.job["global_step"] = int(global_step)

    def pushed(self, worker: int, at: int, dropped: bool, timing, now: float) -> None:
        """A gradient computed at ``at`` arrived; ``timing``: the worker's previous step."""
        self._timings(worker, timing)
        push = _Push(worker, at, now)
        self.last[worker] = push
        if dropped:
            self.current.pushes.append(push)
        else:
            self.pending[worker].append(push)

    def decided(self, step: int, taken: tuple[int, ...], now: float) -> None:
        """Step ``step`` takes ``taken[w]`` of each worker's held gradients (oldest first)."""
        line = self.current
        line.step = step
        first = now
        for w, n in enumerate(taken):
            for _ in range(n):
                push = self.pending[w].popleft()
                push.taken = True
                line.pushes.append(push)
                first = min(first, push.arrived)
        line.decide_ms = round((now - first) * 1e3, 3)

    def applied(self, words) -> None:
        """One ps's APPLIED notice (``NoticeField`` words)."""
        line, j = self.current, int(words[NoticeField.SENDER])
        line.apply_ms[j] = round(int(words[NoticeField.APPLY_US]) / 1e3, 3)
        line.reduce_ms[j] = round(int(words[NoticeField.REDUCE_US]) / 1e3, 3)
        line.bytes_in[j] = int(words[NoticeField.BYTES_IN])
        line.bytes_out[j] = int(words[NoticeField.BYTES_OUT])

    def step_applied(self, now: float) -> None:
        """Every ps applied the decided step: its line is done, the next one opens."""
        line = self.current
        line.applied = True
        line.t = time.time()
        line.step_ms = round((now - self.last_applied) * 1e3, 3)
        self.last_applied = now
        self.done.append(line)
        self.current = _Line(self.num_ps)

    def closed(self, worker: int, timing) -> None:
        """A worker closed; its close carries the timings of its last step."""
        self._timings(worker, timing)
        self.write_ready()

    def finish(self, global_step: int) -> None:
        """Training ended: gradients still held count as dropped; write every line."""
        line = self.current
        for queue in self.pending:
            while queue:
                line.pushes.append(queue.popleft())
        if line.pushes:
            line.step, line.t = global_step, time.time()
            self.done.append(line)
        self._write_job()
        while self.done:
            self._write(self.done.popleft())
        self.file.close()

    # -- helpers --------------------------------------------------------------------------
    def _timings(self, worker: int, timing) -> None:
        push = self.last[worker]
        if push is None:
            return
        self.last[worker] = None
        push.timed = True
        if timing is not None and any(int(x) for x in timing):
            push.times = [round(int(x) / 1e3, 3) for x in timing]

    def write_ready(self) -> None:
        """Write the finished lines whose timings are in (call off the critical path)."""
        done = self.done
        while done and (len(done) > MAX_HELD or all(p.timed for p in done[0].pushes)):
            self._write(done.popleft())
        now = time.perf_counter()
        if now - self.flushed_at > FLUSH_SECONDS:
            self.file.flush()
            self.flushed_at = now

    def _write(self, line: _Line) -> None:
        self._write_job()
        pushes = []
        for p in line.pushes:
            entry = {"worker": p.worker, "at": p.at, "taken": p.taken}
            times = p.times or (None, None, None, None)
            entry.update(zip(("compute_ms", "push_ms", "wait_ms", "pull_ms"), times))
            pushes.append(entry)
        record = {"opt": self.opt_id, "step": line.step, "applied": line.applied,
                  "t": round(line.t, 6), "step_ms": line.step_ms, "decide_ms": line.decide_ms,
                  "taken": [p.worker for p in line.pushes if p.taken],
                  "dropped": [p.worker for p in line.pushes if not p.taken],
                  "pushes": pushes, "apply_ms": line.apply_ms, "reduce_ms": line.reduce_ms,
                  "bytes_in": line.bytes_in, "bytes_out": line.bytes_out}
        self.file.write(json.dumps(record) + "\n")
