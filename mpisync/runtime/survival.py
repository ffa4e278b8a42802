"""Lost ranks under MPI fault tolerance (ULFM): noticed, acknowledged, named once."""
from __future__ import annotations

import os
from collections.abc import Mapping

from mpi4py import MPI

from ..environ import LOST_WORKERS_EXIT, SURVIVE_ENV

__all__ = ["LOST_WORKERS_EXIT", "SURVIVE_ENV", "Losses", "improbe", "is_failure", "settle",
           "support"]

_FAILURE_CLASSES = {getattr(MPI, name) for name in
                    ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                    if hasattr(MPI, name)}
_IN_STATUS = getattr(MPI, "ERR_IN_STATUS", None)


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's word that a rank of the communicator died."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in _FAILURE_CLASSES


def support(environ: Mapping[str, str] | None = None) -> str | None:
    """None when this MPI job can survive a lost rank, else why not.

    Open MPI 5 can, when started with ``mpirun --with-ft ulfm`` (its ULFM fault
    tolerance); MPICH's ``mpiexec`` ends the whole job when a rank is killed.
    """
    environ = os.environ if environ is None else environ
    library = MPI.Get_library_version().splitlines()[0] if MPI.Is_initialized() else "MPI"
    if not hasattr(MPI.Comm, "Get_failed") or "Open MPI" not in library:
        return (f"this MPI ({' '.join(library.split(',')[0].split())}) cannot survive a lost "
                f"rank (only Open MPI with ULFM can): the job ends when a rank dies")
    if environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return ("Open MPI runs without fault tolerance: start the job with mpirun --with-ft "
                "ulfm (python -m mpisync.launch --survive-worker-loss does)")
    return None


class Losses:
    """The ranks of ``comm`` this rank knows to be dead, and the ones not yet dealt with.

    ``comm`` must return errors (``MPI.ERRORS_RETURN``). Every failure MPI reports is
    acknowledged at once, so that receives from any source go on among the survivors;
    ``take()`` hands each newly lost rank to the caller once.
    """

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.lost: list[int] = []        # in the order they were noticed
        self._new: list[int] = []

    def note(self, exc: BaseException) -> bool:
        """Record the ranks behind a failure ``exc``; False if ``exc`` is something else.

        A wait on several requests (``Testall``, ``Waitall``) reports a rank's death as
        ``ERR_IN_STATUS``, the failure being in one request's status: that is a failure
        too when MPI knows of a dead rank of ``comm``.
        """
        if is_failure(exc):
            self.refresh()
            return True
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() == _IN_STATUS:
            self.refresh()
            return bool(self.lost)
        return False

    def refresh(self) -> None:
        """Acknowledge the failures MPI knows of; remember the ranks that are new."""
        self.comm.Ack_failed()
        failed, group = self.comm.Get_failed(), self.comm.Get_group()
        try:
            ranks = failed.Translate_ranks(list(range(failed.Get_size())), group)
        finally:
            failed.Free()
            group.Free()
        for rank in ranks:
            if rank not in self.lost:
                self.lost.append(rank)
                self._new.append(rank)

    @property
    def pending(self) -> bool:
        return bool(self._new)

    def take(self) -> list[int]:
        """The ranks lost since the last call."""
        new, self._new = self._new, []
        return new

    def improbe(self, source: int, tag: int, status: MPI.Status | None = None):
        """``comm.improbe``, through a failure: it is noted and the probe made again."""
        try:
            return self.comm.improbe(source=source, tag=tag, status=status)
        except MPI.Exception as exc:
            if not self.note(exc):
                raise
        return self.comm.improbe(source=source, tag=tag, status=status)


def improbe(comm: MPI.Comm, losses: Losses | None, source: int, tag: int,
            status: MPI.Status | None = None):
    """``comm.improbe``, or ``losses.improbe`` when the job survives lost ranks."""
    if losses is None:
        return comm.improbe(source=source, tag=tag, status=status)
    return losses.improbe(source, tag, status)


def settle(reqs, losses: Losses | None) -> None:
    """Cancel (where pending) and complete requests; a dead rank's failure is noted in
    ``losses`` (without it, or for any other error, it is raised)."""
    for req in reqs:
        try:
            if not req.Test():
                req.Cancel()
                req.Wait()
        except MPI.Exception as exc:
            if losses is None or not losses.note(exc):
                raise
