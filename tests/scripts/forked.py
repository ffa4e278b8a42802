"""What a rank sees of how it was started, then an end chosen by the first argument:
``ok`` (exit 0), ``exit`` (every rank exits 3) or ``raise`` (worker 1 raises after init())."""
from __future__ import annotations

import os
import sys

forked = "torch" in sys.modules        # imported before this line only by a fork server

import numpy as np
from common import emit
from mpi4py import MPI

import mpisync

rank = MPI.COMM_WORLD.Get_rank()
emit(role="rank", rank=rank, forked=forked, name=__name__, argv=sys.argv, cwd=os.getcwd(),
     path0=sys.path[0], mark=os.environ.get("MPISYNC_FORKED_MARK"), hash=hash("mpisync"),
     draw=int(np.random.randint(1 << 30)), stdout_line_buffered=sys.stdout.line_buffering,
     stderr_line_buffered=sys.stderr.line_buffering, stdout_fd=sys.stdout.fileno(),
     main=sys.modules["__main__"].__file__)
print(f"stdout of rank {rank}")
print(f"stderr of rank {rank}", file=sys.stderr)
if sys.argv[1] == "exit":
    sys.stdout.flush()
    sys.exit(3)
if sys.argv[1] == "raise":
    cluster = mpisync.init()
    if not cluster.is_ps and cluster.worker_index == 1:
        raise ValueError(f"broken on purpose on {cluster.label}")
    if cluster.is_ps:
        cluster.serve()
    else:
        MPI.COMM_WORLD.Barrier()        # never met: worker 1's error ends the job
