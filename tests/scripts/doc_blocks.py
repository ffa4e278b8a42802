"""Run the documentation's multi-rank code blocks one after another in one MPI job.

argv[1] is a JSON file of ``[{"name": ..., "code": ...}]`` (tests/mpi/test_docs_jobs.py writes it).
Every rank runs each block as its own program: ``mpisync.init()`` inside the block, then
the cluster is closed on every rank and the ranks meet before the next block. Each block
runs in a fresh directory of its own, so the files it writes (checkpoints, logs) start
from nothing. Worker 0 records each block it finished.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from common import emit
from mpi4py import MPI


def main() -> None:
    with open(sys.argv[1]) as f:
        blocks = json.load(f)
    world = MPI.COMM_WORLD
    root = world.bcast(tempfile.mkdtemp(prefix="mpisync-doc-blocks-") if world.rank == 0
                       else None)
    import mpisync.ps_ranks
    for i, block in enumerate(blocks):
        where = os.path.join(root, str(i))
        os.makedirs(where, exist_ok=True)
        os.chdir(where)
        exec(compile(block["code"], block["name"], "exec"),  # noqa: S102 (the docs' own code)
             {"__name__": "__main__"})
        cluster = mpisync.ps_ranks._current
        if cluster is not None and not cluster.is_ps and not cluster.closed:
            cluster.close()
        if cluster is not None and cluster.is_ps and not cluster.closed:
            cluster.close()
        world.Barrier()
        if world.rank == 0:
            emit(role="block", name=block["name"])


if __name__ == "__main__":
    main()
