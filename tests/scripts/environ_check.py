"""Every ``MPISYNC_*`` variable malformed on one rank, then on every rank: ``mpisync.init()``
refuses it with a ``ConfigError`` on every rank, naming the variable and a rank that holds
it, and is called again for the next. One RESULT record per variable, placement and rank;
then one real ``init()`` and ``close()`` on every rank, to show the refusals left nothing.

With ``--uncaught NAME`` the last rank alone holds a malformed ``NAME``, set before
mpisync's modules are imported, and ``init()`` is not caught: every rank must end by
itself, non-zero, naming the variable.

``BAD`` and ``GOOD`` are read by ``tests/unit/test_environ.py`` as well (importing this file
imports neither MPI nor mpisync).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

#: A malformed value of each variable that has one (any text is a good ``text`` or ``path``).
BAD = {
    "MPISYNC_NUM_PS": "two",
    "MPISYNC_PS_LAYOUT": "ring",
    "MPISYNC_HOSTMAP": "a:x,b:2",
    "MPISYNC_TIMEOUT": "30s",
    "MPISYNC_SETUP_TIMEOUT": "0",
    "MPISYNC_STALL_WARNING": "-5",
    "MPISYNC_POLL_MAX_SLEEP": "nan",
    "MPISYNC_POLL_PACE": "-0.1",
    "MPISYNC_POLL_SPIN_US": "fast",
    "MPISYNC_SURVIVE_WORKER_LOSS": "true",
    "MPISYNC_SHARED_MEMORY": "off",
    "MPISYNC_STAGE_CPU": "yes",
    "MPISYNC_KEEP_HEAP": "2",
    "MPISYNC_BULK": "on",
    "MPISYNC_ROW_KERNELS": "no",
    "MPISYNC_PS_THREADS": "0",
    "MPISYNC_TIMELINE_MAX_MB": "inf",
    "MPISYNC_PROGRESS": "sometimes",
    "MPISYNC_ATTEMPT": "-1",
}
#: Well-formed values of every variable.
GOOD = {
    "MPISYNC_NUM_PS": ["1", " 2 ", ""],
    "MPISYNC_PS_LAYOUT": ["last", "per_node", ""],
    "MPISYNC_NODE": ["n1", "any text at all"],
    "MPISYNC_HOSTMAP": ["a:2,b:2", "a,b:3", ""],
    "MPISYNC_TIMEOUT": ["30", "0.5", "1e3"],
    "MPISYNC_SETUP_TIMEOUT": ["3600"],
    "MPISYNC_STALL_WARNING": ["60"],
    "MPISYNC_POLL_MAX_SLEEP": ["0", "0.001"],
    "MPISYNC_POLL_PACE": ["0", "0.8"],
    "MPISYNC_POLL_SPIN_US": ["0", "100"],
    "MPISYNC_SURVIVE_WORKER_LOSS": ["0", "1", ""],
    "MPISYNC_SHARED_MEMORY": ["0", "1"],
    "MPISYNC_STAGE_CPU": ["1", " 0 "],
    "MPISYNC_KEEP_HEAP": ["1"],
    "MPISYNC_BULK": ["0"],
    "MPISYNC_ROW_KERNELS": ["1"],
    "MPISYNC_PS_THREADS": ["1", " 4 ", ""],
    "MPISYNC_CACHE": ["/tmp/mpisync-cache", "~/.cache/mpisync"],
    "MPISYNC_ATTEMPT": ["0", "3", ""],
    "MPISYNC_FAILURE_DIR": ["/tmp/mpisync-failures"],
    "MPISYNC_STATS": ["stats.jsonl"],
    "MPISYNC_TIMELINE": ["timeline.json"],
    "MPISYNC_TIMELINE_MAX_MB": ["0", "64"],
    "MPISYNC_PROGRESS": ["0", "off", "No", "100"],
}


def refuse_each(rank: int, size: int) -> None:
    """Each malformed value on one rank (a different one in turn), then on every rank."""
    from common import emit
    from mpi4py import MPI

    import mpisync

    for i, (name, value) in enumerate(BAD.items()):
        for placement, bad in (("one", [i % size]), ("all", list(range(size)))):
            saved = os.environ.get(name)
            if rank in bad:
                os.environ[name] = value
            start = time.monotonic()
            try:
                mpisync.init(abort_on_error=False)
                error = None
            except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
                error = f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - start
            if saved is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = saved
            named = error is not None and error.startswith("ConfigError: ") \
                and f"rank {bad[0]}: {name}={value!r} is not " in error
            emit(case=name, placement=placement, rank=rank, bad=bad, error=error,
                 named=named, seconds=round(seconds, 3))
            if error is None:      # a rank that went on would leave the others waiting
                print(f"rank {rank}: init() took {name}={value!r} on ranks {bad}",
                      file=sys.stderr, flush=True)
                MPI.COMM_WORLD.Abort(1)
    differ_each(rank, size)
    cluster = mpisync.init()
    if cluster.is_ps:
        cluster.serve()
    cluster.close()
    emit(case="after", rank=rank, role="ps" if cluster.is_ps else "worker")


def differ_each(rank: int, size: int) -> None:
    """A well-formed number of ps ranks that one rank alone asks for (through
    ``MPISYNC_NUM_PS``, then through ``init(num_ps=)``): every rank refuses it."""
    from common import emit
    from mpi4py import MPI

    import mpisync
    for case, odd in (("differ-env", 1), ("differ-arg", size - 1)):
        asked = None
        if rank == odd and case == "differ-env":
            os.environ["MPISYNC_NUM_PS"] = "2"
        elif rank == odd:
            asked = 2
        try:
            mpisync.init(num_ps=asked, abort_on_error=False)
            error = None
        except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
            error = f"{type(exc).__name__}: {exc}"
        os.environ.pop("MPISYNC_NUM_PS", None)
        emit(case=case, rank=rank, odd=odd, error=error)
        if error is None:
            print(f"rank {rank}: init() took {case}", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--uncaught", metavar="NAME", help="malformed on the last rank, not caught")
    args = p.parse_args()
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if args.uncaught is None:
        refuse_each(rank, size)
        return
    if rank == size - 1:
        os.environ[args.uncaught] = BAD[args.uncaught]
    import mpisync  # its modules load (and read some variables) at mpisync.init

    mpisync.init()
    print(f"rank {rank}: init() took {args.uncaught}", flush=True)


if __name__ == "__main__":
    main()
