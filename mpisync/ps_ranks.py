"""Roles: split the MPI world into ps and worker communicators; failure handling; serve()."""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback

from mpi4py import MPI

from .errors import WorldTooSmallError
from .progress import DEFAULT_TIMEOUT
from .wire import Tag

__all__ = ["Cluster", "comm_split", "init"]


def comm_split(comm: MPI.Comm, num_ps: int) -> tuple[MPI.Comm, MPI.Comm]:
    """Split ``comm`` into (worker_comm, ps_comm); the last ``num_ps`` ranks are ps ranks.

    Call on every rank of ``comm``. On a worker the ps communicator is ``MPI.COMM_NULL``
    and on a ps rank the worker communicator is; the caller frees what it gets.
    """
    num_workers = comm.Get_size() - num_ps
    is_ps = comm.Get_rank() >= num_workers
    part = comm.Split(1 if is_ps else 0, comm.Get_rank())
    if is_ps:
        return MPI.COMM_NULL, part
    return part, MPI.COMM_NULL


def _host_load(comm: MPI.Comm) -> tuple[int, int]:
    """(ranks of ``comm`` on this host, cores those ranks may run on together)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        try:
            mine = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            mine = list(range(os.cpu_count() or 1))
        cores = set().union(*local.allgather(mine))
        return local.Get_size(), len(cores)
    finally:
        local.Free()


class Cluster:
    """One rank's view of the job: its role, its index in that role, its communicators.

    Ranks ``0 .. num_workers-1`` are workers (rank 0 is the chief); the last ``num_ps``
    ranks are parameter servers. ``p2p_comm`` is a private duplicate of the world
    communicator that carries all of mpisync's own traffic.
    """

    def __init__(self, comm: MPI.Comm, num_ps: int, timeout: float):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.num_ps = num_ps
        self.num_workers = self.size - num_ps
        self.is_ps = self.rank >= self.num_workers
        self.ps_index = self.rank - self.num_workers if self.is_ps else None
        self.worker_index = None if self.is_ps else self.rank
        self.is_chief = self.worker_index == 0
        self.timeout = timeout
        self.host = socket.gethostname()
        self.p2p_comm = comm.Dup()
        self.worker_comm, self.ps_comm = comm_split(comm, num_ps)
        self.local_ranks, self.local_cores = _host_load(comm)
        self.stats: dict | None = None

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than cores they may run on: waits must not spin long."""
        return self.local_ranks > self.local_cores

    def ps_rank(self, ps_index: int) -> int:
        """World rank of ps ``ps_index``."""
        return self.num_workers + ps_index

    @property
    def coordinator_rank(self) -> int:
        """The rank that runs the token barrier: ps 0, always in its serve loop."""
        return self.num_workers

    @property
    def label(self) -> str:
        """How messages name this rank: role, index, rank and host."""
        role = f"ps {self.ps_index}" if self.is_ps else f"worker {self.worker_index}"
        return f"{role} (rank {self.rank} on {self.host})"

    def serve(self) -> dict:
        """Run this ps rank until every worker has closed; return the final step statistics.

        Blocks. Call on every ps rank (workers call ``SyncReplicasOptimizer.close()``).

        Raises:
            RuntimeError: on a worker rank.
        """
        if not self.is_ps:
            raise RuntimeError(f"{self.label}: serve() is for ps ranks; workers train and "
                               f"then call opt.close()")
        from .server import Server  # late: the server pulls in torch

        self.stats = Server.from_setup(self).run()
        return self.stats

    def __repr__(self) -> str:
        return (f"Cluster({self.label}, num_workers={self.num_workers}, "
                f"num_ps={self.num_ps})")


_current: Cluster | None = None


def init(num_ps: int | None = None, comm: MPI.Comm | None = None,
         timeout: float | None = None, abort_on_error: bool = True) -> Cluster:
    """Split the MPI world into ps ranks and workers. Call on every rank.

    Args:
        num_ps: number of parameter-server ranks (the last ones); default: the
            ``MPISYNC_NUM_PS`` environment variable, else 1.
        comm: the communicator to split; default ``MPI.COMM_WORLD``.
        timeout: seconds any wait may last before the job is declared stalled;
            default ``MPISYNC_TIMEOUT`` or 1800 (the first setup waits up to
            ``MPISYNC_SETUP_TIMEOUT``, 3600); ps 0 warns every ``MPISYNC_STALL_WARNING``
            seconds (60) that nothing arrived, naming the workers it waits for.
        abort_on_error: install an exception hook that reports an uncaught exception
            with this rank's name, tells the other ranks, and aborts the whole job, so
            that one failing rank never leaves the others waiting.

    Raises:
        WorldTooSmallError: on every rank, when the world cannot hold ``num_ps`` ps
            ranks and at least one worker.
    """
    global _current
    comm = MPI.COMM_WORLD if comm is None else comm
    if abort_on_error:
        _install_excepthook()
    if num_ps is None:
        num_ps = int(os.environ.get("MPISYNC_NUM_PS", "1"))
    if isinstance(num_ps, bool) or not isinstance(num_ps, int):
        raise TypeError(f"rank {comm.Get_rank()}: num_ps must be an int, "
                        f"got {type(num_ps).__name__}")
    size = comm.Get_size()
    if num_ps < 1 or num_ps >= size:
        raise WorldTooSmallError(
            f"rank {comm.Get_rank()}: num_ps={num_ps} needs 1 <= num_ps < world size; found "
            f"{size} MPI ranks but {num_ps} ps ranks and at least one worker need "
            f"{max(num_ps, 1) + 1}")
    _current = Cluster(comm, num_ps, DEFAULT_TIMEOUT if timeout is None else float(timeout))
    return _current


def _install_excepthook() -> None:
    if getattr(sys.excepthook, "_mpisync", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        cluster = _current
        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else "?"
        label = cluster.label if cluster is not None else f"rank {rank}"
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[mpisync] {label}: {exc_type.__name__}: {exc}\n{text}")
        sys.stderr.flush()
        if getattr(exc, "collective", False) or not MPI.Is_initialized() or MPI.Is_finalized():
            return  # raised on every rank alike: let each exit on its own
        from .errors import PeerError
        if cluster is not None and not isinstance(exc, PeerError):
            _notify_peers(cluster, f"{label} failed: {exc_type.__name__}: {exc}")
            time.sleep(1.0)  # give the peers a moment to print why they stop
        MPI.COMM_WORLD.Abort(1)

    hook._mpisync = True
    hook._previous = previous
    sys.excepthook = hook


def _notify_peers(cluster: Cluster, notice: str) -> None:
    """Tell every other rank why this one fails (best effort, never blocks)."""
    reqs = []
    for r in range(cluster.size):
        if r != cluster.rank:
            try:
                reqs.append(cluster.p2p_comm.isend(notice, dest=r, tag=Tag.ERROR))
            except MPI.Exception:
                pass
    del reqs
