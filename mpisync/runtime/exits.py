"""How a rank ends: finalizing or aborting within a grace period, the exit status of a job
that lost workers, and the exception hook that turns one rank's failure into the job's end.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mpi4py import MPI

from .. import environ
from ..errors import PeerError
from ..protocol.wire import Tag
from .failures import FAILURE_DIR_ENV, error_text, write_failure
from .survival import LOST_WORKERS_EXIT, Losses

__all__ = ["FINALIZE_GRACE", "Exiting", "abort_within", "exit_status", "finalize_within",
           "install_excepthook", "notify_peers", "record_failure"]


class Exiting(Protocol):
    """What ending a rank reads of its cluster (``mpisync.Cluster``)."""

    @property
    def label(self) -> str: ...
    @property
    def losses(self) -> Losses | None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def p2p_comm(self) -> Any: ...

    def describe_lost(self, ranks: Sequence[int] | None = None) -> str: ...


#: Seconds ``MPI_Finalize`` may take on a rank that saw workers lost before it exits anyway.
FINALIZE_GRACE = 10.0


def exit_status(cluster: Exiting) -> None:
    """A rank that saw workers lost ends with ``LOST_WORKERS_EXIT`` once MPI finalized.

    Open MPI's ``MPI_Finalize`` sometimes waits forever for a rank that died (the runtime's
    last fence): after ``FINALIZE_GRACE`` seconds the rank exits without it. A rank that
    never met the dead one itself (a worker whose messages all went to live ranks) asks
    MPI first which ranks it knows to have died.
    """
    losses = cluster.losses
    if losses is None or MPI.Is_finalized():
        return
    try:
        if losses.comm == MPI.COMM_NULL:     # freed by cluster.close(): the same ranks
            losses.comm = MPI.COMM_WORLD
        losses.refresh()
    except MPI.Exception:
        pass
    if not losses.lost:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    finalize_within(FINALIZE_GRACE, LOST_WORKERS_EXIT)


def finalize_within(grace: float, code: int) -> None:
    """``MPI_Finalize``, then ``os._exit(code)``; after ``grace`` seconds the process exits
    with ``code`` whether or not it returned. ``MPI_Finalize`` is called through ctypes,
    which lets go of the GIL while it waits: mpi4py's ``MPI.Finalize`` keeps it, so the
    timer that ends the wait could never run."""
    threading.Timer(grace, os._exit, (code,)).start()
    finalize: Callable[[], object]
    try:
        finalize = ctypes.CDLL(MPI.__file__).MPI_Finalize
    except (OSError, AttributeError):
        finalize = MPI.Finalize
    finalize()
    os._exit(code)


def abort_within(grace: float, code: int) -> None:
    """``MPI_Abort`` on ``COMM_WORLD``; after ``grace`` seconds the process exits with
    ``code`` whether or not the abort returned. Called through ctypes for the reason
    ``finalize_within`` gives: mpi4py's ``Comm.Abort`` keeps the GIL while it waits, and an
    abort can wait for good once ranks have died (Open MPI with ULFM)."""
    threading.Timer(grace, os._exit, (code,)).start()
    _save_coverage()
    comm = MPI.COMM_WORLD
    try:
        abort = ctypes.CDLL(MPI.__file__).MPI_Abort
        handle = ctypes.c_void_p if MPI._sizeof(MPI.Comm) == ctypes.sizeof(ctypes.c_void_p) \
            else ctypes.c_int
        abort.argtypes = [handle, ctypes.c_int]
        abort.restype = ctypes.c_int
        abort(MPI._handleof(comm), code)
    except (OSError, AttributeError, TypeError):
        comm.Abort(code)
    os._exit(code)


def _save_coverage() -> None:
    """Write coverage.py's data of this process so far, where it measures itself (``make
    coverage``): ``MPI_Abort`` ends every rank without running exit handlers, so the lines
    a failing job ran would be lost. Nothing where coverage.py is not running."""
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    measuring = current() if current is not None else None
    if measuring is not None:
        try:
            measuring.save()
        except Exception:  # noqa: BLE001, S110 (never in the way of the abort)
            pass


def install_excepthook(current: Callable[[], Exiting | None]) -> None:
    """Make an uncaught exception end the whole job, not this rank alone (once a process).

    The hook prints the exception under this rank's name (``current()``: the cluster of
    this process, or None), writes what failed where ``MPISYNC_FAILURE_DIR`` says
    (``record_failure``, for ``python -m mpisync.launch --restarts``), tells the other ranks why (``notify_peers``) and aborts the
    job with ``abort_within``. An error raised on every rank alike (``collective``), or
    one raised where MPI is not running, ends this rank only: each rank exits on its own.
    """
    if getattr(sys.excepthook, "_mpisync", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        cluster = current()
        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else "?"
        label = cluster.label if cluster is not None else f"rank {rank}"
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        peer = isinstance(exc, PeerError)
        if cluster is not None and cluster.losses is not None and cluster.losses.note(exc):
            exc, peer = f"{cluster.describe_lost() or 'a rank'} lost ({exc})", True
        sys.stderr.write(f"[mpisync] {label}: {exc_type.__name__}: {exc}\n{text}")
        sys.stderr.flush()
        record_failure(cluster, rank, label, error_text(exc_type, exc), peer)
        if getattr(exc, "collective", False) or not MPI.Is_initialized() or MPI.Is_finalized():
            return  # raised on every rank alike: let each exit on its own
        if cluster is not None and not cluster.closed and not isinstance(exc, PeerError):
            notify_peers(cluster, f"{label} failed: {exc_type.__name__}: {exc}")
        _save_coverage()  # before the first rank's abort ends every rank
        time.sleep(1.5)  # let every rank print why it stops before the abort ends them all
        # a job that survives lost ranks (Open MPI with ULFM) has seen an abort wait on for
        # good after ranks had died: this rank then ends itself, and the job with it
        abort_within(FINALIZE_GRACE, 1)

    hook._mpisync = True          # type: ignore[attr-defined]  # marks mpisync's own hook
    hook._previous = previous     # type: ignore[attr-defined]
    sys.excepthook = hook


def record_failure(cluster: Exiting | None, rank: int | str, label: str, error: str,
                   peer: bool) -> None:
    """Write this rank's failure record (``mpisync.runtime.failures``) where
    ``MPISYNC_FAILURE_DIR`` says, with the global step of its open optimizer; nothing
    without the variable or a rank number. Never raises."""
    try:
        directory = environ.text(FAILURE_DIR_ENV)
        if not directory or not isinstance(rank, int):
            return
        step = None
        for opt in reversed(list(getattr(cluster, "optimizers", None) or ())):
            if not getattr(opt, "closed", True):
                step = opt.global_step
                break
        write_failure(directory, rank, label, error, step, peer)
    except Exception:  # noqa: BLE001, S110 (best effort while the rank fails)
        pass


def notify_peers(cluster: Exiting, notice: str) -> None:
    """Tell every other rank why this one fails (best effort, never blocks)."""
    reqs = []
    for r in range(cluster.size):
        if r != cluster.rank:
            try:
                reqs.append(cluster.p2p_comm.isend(notice, dest=r, tag=Tag.ERROR))
            except MPI.Exception:
                pass
    del reqs
