"""A communicator whose members meet before each collective, watched by mpisync."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mpi4py import MPI

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["COLLECTIVES", "CREATORS", "GuardedComm"]

_BASES = ("Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw",
          "Barrier", "Bcast", "Exscan", "Gather", "Gatherv", "Reduce", "Reduce_scatter",
          "Reduce_scatter_block", "Scan", "Scatter", "Scatterv")

#: Collective operations (blocking, nonblocking, persistent, pickle-based) and the
#: collectives that create communicators of another kind; each meets first.
COLLECTIVES = tuple(sorted(
    {base + suffix for base in _BASES for suffix in ("", "_init")}
    | {"I" + base[0].lower() + base[1:] for base in _BASES}
    | {"allgather", "allreduce", "alltoall", "barrier", "bcast", "exscan", "gather",
       "reduce", "scan", "scatter", "Create_cart", "Create_graph", "Create_dist_graph",
       "Create_dist_graph_adjacent", "Create_intercomm"}))

#: Collectives that create an intracommunicator: it is guarded like its parent.
CREATORS = ("Clone", "Create", "Create_group", "Dup", "Dup_with_info", "Split", "Split_type")


class GuardedComm(MPI.Intracomm):
    """The same MPI communicator, whose members meet before every collective.

    ``before(name, meet)`` runs first, with ``meet`` a private duplicate of this
    communicator for the meeting (the members' barrier); it raises when the collective
    could wait forever. Communicators made from this one (``Dup``, ``Split``, ...) are
    guarded the same way. The one mpisync's Cluster owns cannot be freed here.
    """

    def __new__(cls, comm: MPI.Intracomm | None = None,
                before: Callable[[str, MPI.Intracomm], None] | None = None,
                meet: MPI.Intracomm | None = None, owned: bool = False) -> Self:
        self = super().__new__(cls, MPI.COMM_NULL if comm is None else comm)
        self._before, self._meet, self._owned = before, meet, owned
        return self

    def _run_before(self, name: str) -> None:
        if self._before is not None:
            self._before(name, self._meet)

    def _adopt(self, new):
        """Guard a communicator made from this one (collective over its members)."""
        if not isinstance(new, MPI.Intracomm) or new == MPI.COMM_NULL:
            return new
        if not isinstance(new, GuardedComm):
            new = GuardedComm(new)               # the same handle, now guarded
        new._before, new._owned = self._before, False
        new._meet = MPI.Intracomm.Dup(new)
        return new

    def Idup(self, info: MPI.Info | None = None):
        """As ``Dup``, done at once: the request returned is already complete."""
        new = self.Dup() if info is None else self.Dup_with_info(info)
        return new, MPI.REQUEST_NULL

    def Free(self) -> None:
        if self._owned:
            raise RuntimeError("this communicator belongs to mpisync's Cluster; call "
                               "cluster.close() instead of Free()")
        if self._meet is not None and self._meet != MPI.COMM_NULL:
            self._meet.Free()
        MPI.Intracomm.Free(self)

    free = Free


def _guarded(name: str):
    method = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        self._run_before(name)
        return method(self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


def _creating(name: str):
    method = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        self._run_before(name)
        return self._adopt(method(self, *args, **kwargs))

    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


for _name in COLLECTIVES:
    if hasattr(MPI.Intracomm, _name):
        setattr(GuardedComm, _name, _guarded(_name))
for _name in CREATORS:
    if hasattr(MPI.Intracomm, _name):
        setattr(GuardedComm, _name, _creating(_name))
