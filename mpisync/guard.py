"""A communicator whose collectives ask first whether they are safe to start."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mpi4py import MPI

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["COLLECTIVES", "GuardedComm"]

#: The collective operations of an intracommunicator (blocking, nonblocking, persistent,
#: and the ones that create communicators), upper- and lower-case.
COLLECTIVES = tuple(sorted(
    {base + suffix
     for base in ("Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw",
                  "Barrier", "Bcast", "Exscan", "Gather", "Gatherv", "Reduce",
                  "Reduce_scatter", "Reduce_scatter_block", "Scan", "Scatter", "Scatterv")
     for suffix in ("", "_init")}
    | {"I" + base[0].lower() + base[1:] for base in (
        "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw",
        "Barrier", "Bcast", "Exscan", "Gather", "Gatherv", "Reduce", "Reduce_scatter",
        "Reduce_scatter_block", "Scan", "Scatter", "Scatterv")}
    | {"allgather", "allreduce", "alltoall", "barrier", "bcast", "exscan", "gather",
       "reduce", "scan", "scatter", "Create", "Create_group", "Dup", "Dup_with_info", "Idup",
       "Split", "Split_type"}))


class GuardedComm(MPI.Intracomm):
    """The same MPI communicator, with ``check(name)`` called before every collective.

    ``check`` raises when the collective could wait forever. The communicator belongs to
    its creator: ``Free()`` here is refused.
    """

    def __new__(cls, comm: MPI.Intracomm, check: Callable[[str], None]) -> Self:
        self = super().__new__(cls, comm)
        self._check = check
        return self

    def Free(self) -> None:
        raise RuntimeError("this communicator belongs to mpisync's Cluster; call "
                           "cluster.close() instead of Free()")

    free = Free


def _guarded(name: str):
    method = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        self._check(name)
        return method(self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


for _name in COLLECTIVES:
    if hasattr(MPI.Intracomm, _name):
        setattr(GuardedComm, _name, _guarded(_name))
