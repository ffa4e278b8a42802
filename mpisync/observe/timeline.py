"""The job's timeline (``MPISYNC_TIMELINE=path.json``): a Chrome trace, one track per rank.

Each rank that takes part (a worker once it creates an optimizer, a ps rank once it
serves) appends its events to ``path.rank<r>``: a Chrome trace of its own in the JSON
array format, flushed every second (or every 512 events), so memory stays bounded and a
crash leaves a readable file (it only lacks the closing ``]``, which the format allows and
``merge`` adds). At exit each rank closes its file; the last one to do so merges every
rank's file into ``path`` (``{"traceEvents": [...]}``, plain JSON) and removes them. Open
it in https://ui.perfetto.dev or chrome://tracing. After a crash, ``python -m
mpisync.stats --timeline path.json`` merges whatever the ranks left.

A job started again (``MPISYNC_ATTEMPT`` above 0) appends: each rank's file keeps what
an earlier attempt left in it, the merge keeps the events already in ``path`` before
the new ones, and each rank's first event of the attempt (after its track's names) is an
instant ``attempt`` with ``{"attempt", "global_step"}``: the global step of its first
recorded step (the one a resumed job starts from; null if it recorded none). The first
attempt truncates, as a job that is never started again does.

``MPISYNC_TIMELINE_MAX_MB`` caps each rank's file (default: no cap): a rank that reaches
it records a last event, ``timeline full``, closes its file and stops recording.

The hot path looks at the module attribute ``current`` (None when off) and nothing else.
Times come from ``time.perf_counter()`` and are written as wall-clock microseconds, so
ranks on several hosts line up as well as the hosts' clocks agree.
"""
from __future__ import annotations

import atexit
import json
import os
import time

from .. import environ

__all__ = ["Timeline", "current", "merge", "rank_path", "start"]

#: The recorder of this process, or None: what the hot path checks.
current: Timeline | None = None

FLUSH_EVENTS = 512
FLUSH_SECONDS = 1.0
MAX_BYTES = int(environ.read_at_import(
    lambda: environ.number("MPISYNC_TIMELINE_MAX_MB"),
    lambda: environ.number("MPISYNC_TIMELINE_MAX_MB", environ={})) * (1 << 20))

_SPAN = (',{"name":"%s","ph":"X","pid":%d,"tid":%d,"ts":%.1f,"dur":%.1f,'
         '"args":{"step":%d}}\n')
_INSTANT = ',{"name":"%s","ph":"i","s":"t","pid":%d,"tid":%d,"ts":%.1f,"args":%s}\n'


def rank_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its events while the job runs."""
    return f"{path}.rank{rank}"


class Timeline:
    """One rank's events, appended to its own file.

    Args:
        path: the merged trace's path; this rank writes ``rank_path(path, rank)``.
        rank: the track (Chrome's ``pid``); ``size``: how many ranks write one.
        label: the track's name, e.g. ``worker 1 (rank 1 on n1)``.
        attempt: which attempt at the job this is (``MPISYNC_ATTEMPT``): above 0, the
            files are appended to and the attempt is marked.
    """

    def __init__(self, path: str, rank: int, size: int, label: str,
                 thread: str = "steps", attempt: int = 0):
        self.path, self.rank, self.size = path, rank, size
        self.attempt = attempt
        self.file_path = rank_path(path, rank)
        self._file = open(self.file_path, "a" if attempt else "w",  # noqa: SIM115 (until close())
                          encoding="utf-8")
        # held until the attempt's first step says where it starts (then written first)
        self._marker_at: float | None = time.perf_counter() if attempt else None
        self._lines: list[str] = []
        self._offset = time.time() - time.perf_counter()     # perf_counter s -> epoch s
        self._flushed_at = time.perf_counter()
        self._bytes = 0
        self.max_bytes = MAX_BYTES
        self.closed = False
        meta = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                 "args": {"name": label}},
                {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                 "args": {"sort_index": rank}}]
        self._file.write("[\n" + json.dumps(meta[0]) + "\n,"
                         + json.dumps(meta[1]) + "\n")
        self.name_thread(0, thread)
        self.flush()

    def ts(self, t: float) -> float:
        """Microseconds since the epoch of the ``time.perf_counter()`` reading ``t``."""
        return (t + self._offset) * 1e6

    def span(self, name: str, start: float, end: float, step: int, tid: int = 0) -> None:
        """A complete event from ``start`` to ``end`` (``perf_counter`` seconds)."""
        if self._marker_at is not None and step >= 0:
            self._mark_attempt(step)
        self._lines.append(_SPAN % (name, self.rank, tid, (start + self._offset) * 1e6,
                                    (end - start) * 1e6, step))
        if len(self._lines) >= FLUSH_EVENTS or end - self._flushed_at > FLUSH_SECONDS:
            self.flush(end)

    def instant(self, name: str, t: float, args: dict, tid: int = 0) -> None:
        """An instant event at ``t`` with ``args`` (plain data)."""
        self._lines.append(_INSTANT % (name, self.rank, tid, (t + self._offset) * 1e6,
                                       json.dumps(args, separators=(",", ":"))))
        if len(self._lines) >= FLUSH_EVENTS or t - self._flushed_at > FLUSH_SECONDS:
            self.flush(t)

    def _mark_attempt(self, global_step: int | None) -> None:
        """The attempt's marker, before every event it held back."""
        at, self._marker_at = self._marker_at, None
        assert at is not None
        args = json.dumps({"attempt": self.attempt, "global_step": global_step},
                          separators=(",", ":"))
        self._lines.insert(0, _INSTANT % ("attempt", self.rank, 0, self.ts(at), args))

    def name_thread(self, tid: int, name: str) -> None:
        """Name the track ``tid`` of this rank (a metadata event)."""
        self._lines.append("," + json.dumps({"name": "thread_name", "ph": "M", "pid": self.rank,
                                             "tid": tid, "args": {"name": name}}) + "\n")

    def flush(self, now: float | None = None) -> None:
        """Write what is buffered to this rank's file (and stop at ``max_bytes``)."""
        if self._file.closed:          # full: events of a step under way are let go
            self._lines.clear()
            return
        if self._lines and self._marker_at is None:
            text = "".join(self._lines)
            self._lines.clear()
            self._file.write(text)
            self._bytes += len(text)
        self._file.flush()
        self._flushed_at = time.perf_counter() if now is None else now
        if self.max_bytes and self._bytes > self.max_bytes and not self.closed:
            self._lines.append(_INSTANT % ("timeline full", self.rank, 0,
                                           self.ts(self._flushed_at),
                                           '{"MPISYNC_TIMELINE_MAX_MB":%g}'
                                           % (self.max_bytes / (1 << 20))))
            self.close()

    def close(self) -> None:
        """Close this rank's file; the last rank to close merges them all into ``path``."""
        global current
        if self.closed:
            return
        self.closed = True
        if current is self:
            current = None         # the hot path stops recording
        if self._marker_at is not None:
            self._mark_attempt(None)
        self.flush()
        self._file.write("]\n")
        self._file.close()
        if all(_complete(rank_path(self.path, r)) for r in range(self.size)):
            try:
                merge(self.path, self.size, remove=True, append=self.attempt > 0)
            except FileNotFoundError:
                pass          # another rank finished at the same moment and merged them


def _complete(path: str) -> bool:
    """Whether a rank's file exists and was closed (it ends with ``]``)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < 2:
                return False
            f.seek(-2, os.SEEK_END)
            return f.read() == b"]\n"
    except OSError:
        return False


def merge(path: str, size: int | None = None, remove: bool = False,
          append: bool = False) -> int:
    """Merge the ranks' files into ``path`` (Chrome's JSON object format); returns the ranks.

    ``size``: the ranks to merge (default: every ``path.rank<r>`` found, from 0 up). A
    file a crash cut short is taken up to its last complete event. With ``remove`` the
    ranks' files are deleted once ``path`` is written. With ``append`` the events already
    in ``path`` (an earlier attempt's merge) come first.
    """
    if size is None:
        size = 0
        while os.path.exists(rank_path(path, size)):
            size += 1
    parts = [rank_path(path, r) for r in range(size)]
    sources = ([path] if append and os.path.exists(path) else []) + parts
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
            first = True
            for part in sources:
                with open(part, encoding="utf-8") as f:
                    for line in f:
                        event = _event_of(line)
                        if event is None:
                            continue
                        out.write(event if first else "," + event)
                        out.write("\n")
                        first = False
            out.write("]}\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if remove:
        for part in parts:
            try:
                os.remove(part)
            except OSError:
                pass
    return size


def _event_of(line: str) -> str | None:
    """The event object on one line of a rank's file, or None (brackets, a cut-off line)."""
    text = line.strip().lstrip(",")
    if not text.startswith("{") or not text.endswith("}"):
        return None
    if not line.endswith("\n"):       # the last line of a file a crash cut short?
        try:
            json.loads(text)
        except ValueError:
            return None
    return text


def start(cluster, thread: str = "steps") -> Timeline | None:
    """Start this rank's timeline if ``MPISYNC_TIMELINE`` is set (once per process)."""
    global current
    path = environ.text("MPISYNC_TIMELINE")
    if current is not None or not path:
        return current
    current = Timeline(path, cluster.rank, cluster.size, cluster.label, thread,
                       attempt=environ.count("MPISYNC_ATTEMPT") or 0)
    atexit.register(current.close)
    return current
