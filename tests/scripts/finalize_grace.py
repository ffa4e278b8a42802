"""``finalize_within``: a rank whose ``MPI_Finalize`` waits on a peer that never comes
exits with its code after the grace period (rank 1 never finalizes in time)."""
from __future__ import annotations

import time

from common import emit
from mpi4py import MPI

from mpisync.ps_ranks import finalize_within

rank = MPI.COMM_WORLD.Get_rank()
MPI.COMM_WORLD.Barrier()
if rank == 1:
    time.sleep(60)          # far past the test's patience: the job must not wait for it
else:
    emit(role="finalizing", at=time.time())
    finalize_within(1.0, 3)
