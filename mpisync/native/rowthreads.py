"""The ps's row kernels over threads: one pool per ps rank, a call split by output rows.

A ps rank's row work (the pooled answers to lookups, the merged row gradients, the row
optimizers' updates) is a loop over output rows, each computed on its own. ``split``
cuts such a call into disjoint ranges of output rows and ``run`` runs the kernel on each
range at once, on the pool's threads and the caller's (``ctypes`` releases the GIL
during a foreign call). Every output row is computed by the same operations in the same
order as by one call over every row, so the result is bitwise the same whatever the
number of threads; a row's sum is never split. A call with less than ``min_work``
elements (rows times row width) a thread is not split: handing a range to a thread
costs more than small work.

The pool is started by the ps loop (``start``, with ``threads_for``: ``MPISYNC_PS_THREADS``,
by default the cores of the rank's machine divided among the ps ranks there) and closed
when it returns; elsewhere (workers, tests that start none) every call runs on the
caller's thread.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait

from .. import environ

__all__ = ["MIN_WORK", "PIECES", "close", "default_threads", "run", "split", "start", "threads",
           "threads_for"]

THREADS_ENV = "MPISYNC_PS_THREADS"
MIN_WORK = 1 << 16        # elements (rows x row width) a thread's range must hold to split
PIECES = 4                # pieces of a thread's range, taken by whichever thread is free

_pool: ThreadPoolExecutor | None = None
_threads = 1
_min_work = MIN_WORK


def default_threads(cores: int, ps_ranks: int, machine_cores: int | None = None) -> int:
    """Threads for a ps rank: the ``cores`` its machine's ranks may run on, divided among
    the ``ps_ranks`` there, at least 1 and at most ``machine_cores`` (default
    ``os.cpu_count()``). Workers on the same machine are not counted: in a synchronous
    step they wait for the ps's row work (their waits sleep after a short spin,
    ``mpisync.runtime.progress``), so its cores are free for it
    (``docs/benchmarks.md``, "Threads of a ps rank")."""
    machine_cores = os.cpu_count() or 1 if machine_cores is None else machine_cores
    return max(1, min(machine_cores, cores // max(1, ps_ranks)))


def threads_for(cores: int, ps_ranks: int, env: Mapping[str, str] | None = None) -> int:
    """``MPISYNC_PS_THREADS``, or ``default_threads(cores, ps_ranks)`` where it is unset.

    Raises:
        ConfigError: the variable is not an integer >= 1.
    """
    return environ.count(THREADS_ENV, default_threads(cores, ps_ranks), env)


def start(count: int, min_work: int = MIN_WORK) -> None:
    """Run the row kernels on ``count`` threads (the caller's and ``count - 1`` more) from
    now on, splitting calls of ``min_work`` elements a thread or more; 1: none more."""
    if count < 1:
        raise ValueError(f"row kernel threads must be at least 1, got {count}")
    global _pool, _threads, _min_work
    close()
    _threads, _min_work = count, min_work
    if count > 1:
        _pool = ThreadPoolExecutor(count - 1, thread_name_prefix="mpisync-rows")


def close() -> None:
    """Back to one thread: the pool's threads end (after the calls under way)."""
    global _pool, _threads, _min_work
    if _pool is not None:
        _pool.shutdown(wait=True)
    _pool, _threads, _min_work = None, 1, MIN_WORK


def threads() -> int:
    """The threads a large call runs on now."""
    return _threads


def split(rows: int, work: int) -> list[tuple[int, int]]:
    """Disjoint ranges ``[lo, hi)`` of ``rows`` output rows, in order, that cover them: one
    a thread, as many as ``work`` (the call's elements) pays for; ``[(0, rows)]`` alone
    where it pays for one."""
    parts = min(_threads, rows, work // _min_work if _min_work > 0 else rows)
    if parts <= 1 or _pool is None:
        return [(0, rows)]
    return [(rows * j // parts, rows * (j + 1) // parts) for j in range(parts)]


def run(task: Callable[[int, int], object], ranges: list[tuple[int, int]],
        pieces: int = PIECES) -> None:
    """``task(lo, hi)`` over each range, all at once: each range cut in ``pieces``, which
    this thread and the pool's take in turn as they finish the last (a thread slowed by
    another process on its core leaves its share to the others; 1 for a task that passes
    over all its input whatever its range); returns when every one has run (re-raising
    the first error)."""
    if len(ranges) == 1 or _pool is None:
        for lo, hi in ranges:
            task(lo, hi)
        return
    todo = iter([(lo + (hi - lo) * k // pieces, lo + (hi - lo) * (k + 1) // pieces)
                 for lo, hi in ranges for k in range(pieces) if hi > lo])

    def drain() -> None:
        for lo, hi in todo:          # a list's iterator: one next() at a time (the GIL)
            if hi > lo:
                task(lo, hi)

    futures = [_pool.submit(drain) for _ in ranges[1:]]
    try:
        drain()
    finally:
        wait(futures)
    for f in futures:
        f.result()
