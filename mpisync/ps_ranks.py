"""``mpisync.init()`` and ``Cluster``: the checks every rank agrees on before the job
starts, one rank's role and communicators, and the collectives among the workers.

The rank layout and node discovery live in ``mpisync.runtime.roles``, how a rank ends in
``mpisync.runtime.exits``; their public names are importable from here as well.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import time
import warnings
from collections.abc import Sequence, Sized
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from . import environ as env
from .errors import ConfigError, MismatchError, StallError, WorldTooSmallError
from .protocol.wire import WIRE_VERSION, Tag
from .runtime import lazydynamo, stopping
from .runtime.agreement import agree, first_problem
from .runtime.exits import (
    FINALIZE_GRACE,
    abort_within,
    exit_status,
    finalize_within,
    install_excepthook,
)
from .runtime.guard import GuardedComm
from .runtime.nodes import HOSTMAP_ENV, decode_host_map
from .runtime.progress import DEFAULT_TIMEOUT, Poller, spin_seconds
from .runtime.roles import LAYOUTS, Placement, RankLayout, comm_split, locate
from .runtime.survival import SURVIVE_ENV, Losses, support
from .worker.devices import resolve_cuda_aware, worker_device

if TYPE_CHECKING:
    from typing_extensions import Self

    from .data import WorkerSampler

__all__ = ["FINALIZE_GRACE", "LAYOUTS", "Cluster", "Placement", "RankLayout", "abort_within",
           "check_environment", "comm_split", "finalize_within", "init", "locate"]


class Cluster:
    """One rank's view of the job: its role, its index in that role, its communicators.

    ``p2p_comm`` is a private duplicate of the world communicator that carries all of
    mpisync's own traffic. ``close()`` (or leaving a ``with`` block) frees the
    communicators it created. With ``survive`` (fault-tolerant MPI only) mpisync's
    communicators return errors, and ``losses`` records the ranks found dead.

    Made by ``mpisync.init()``, on every rank, rather than built by hand.

    Args:
        comm: the communicator split into roles (``MPI.COMM_WORLD`` by default in
            ``init``); the constructor is collective over it.
        layout: which ranks of ``comm`` are workers and which are ps ranks.
        timeout: seconds any wait may last before the job is declared stalled.
        placement: every rank's node (``locate(comm)`` when None: collective).
        survive: go on when workers die (fault-tolerant MPI only).

    Example::

        cluster = mpisync.init(num_ps=1)
        if cluster.is_ps:
            cluster.serve()
        else:
            print(cluster.worker_index, "of", cluster.num_workers, "on", cluster.device)
            total = cluster.reduce(torch.tensor(1.0))     # every worker: num_workers
        cluster.close()                                   # every rank
    """

    def __init__(self, comm: MPI.Comm, layout: RankLayout, timeout: float,
                 placement: Placement | None = None, survive: bool = False):
        placement = locate(comm) if placement is None else placement
        self.comm = comm
        self.layout = layout
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.num_ps = layout.num_ps
        self.num_workers = layout.num_workers
        role, index = layout.role(self.rank)
        self.is_ps = role == "ps"
        self.ps_index = index if self.is_ps else None
        self.worker_index = None if self.is_ps else index
        self.is_chief = self.worker_index == 0
        self.timeout = timeout
        self.nodes = placement.nodes         # the node of each rank
        self.host = self.nodes[self.rank]
        self.p2p_comm = comm.Dup()
        # MPI.COMM_NULL on the other role's ranks: typed as what they are where they exist
        self._worker_comm: Any
        self.ps_comm: Any
        self._worker_comm, self.ps_comm = comm_split(comm, layout)
        self._meet_comm: Any = (MPI.COMM_NULL if self._worker_comm == MPI.COMM_NULL
                           else self._worker_comm.Dup())
        self.losses: Losses | None = None
        if survive:           # a dead rank must be an error to handle, not the job's end
            for c in (self.p2p_comm, self._worker_comm, self._meet_comm, self.ps_comm):
                if c != MPI.COMM_NULL:
                    c.Set_errhandler(MPI.ERRORS_RETURN)
            self.losses = Losses(self.p2p_comm)
        self._meet_poller: Poller | None = None
        self._helpers_comm: MPI.Intracomm | None = None       # the workers' helpers (reduce, ...): made at first use
        self._abandoned: list = []      # meetings left by an error: their requests and buffers
        self.local_ranks, self.local_cores = placement.local_ranks, placement.local_cores
        self.stats: dict | list | None = None
        self.optimizers: list = []       # this worker's optimizers, in creation order
        self.closed = False
        self.left = False
        self._guarded: GuardedComm | None = None
        self.device = torch.device("cpu")    # a worker's accelerator (init() picks it)
        self.cuda_aware = False              # MPI takes CUDA buffers (init() asks it)

    @property
    def workers_only(self) -> MPI.Comm:
        """The workers' communicator as MPI made it, without ``worker_comm``'s meeting:
        what mpisync's own set-up and steps use (COMM_NULL on a ps rank)."""
        return self._worker_comm

    @property
    def worker_comm(self) -> MPI.Comm:
        """The workers' communicator, for the user's own collectives between workers.

        Before each collective the workers meet (a barrier on a private communicator), and
        while this worker waits there its open optimizers know it pushes nothing: if a
        worker inside ``step()`` then waits for a step that only the waiting workers could
        complete (the workers ran different numbers of steps), every worker involved gets
        a ``DeadlockError`` saying so, instead of waiting forever. Close the optimizer on
        every worker before collectives at the end of training.
        """
        if self._worker_comm == MPI.COMM_NULL:
            return MPI.COMM_NULL
        if self._guarded is None:
            self._guarded = GuardedComm(self._worker_comm, self._before_collective,
                                        self._meet_comm, owned=True)
        return self._guarded

    def _before_collective(self, method: str, meet: MPI.Intracomm,
                           call: str | None = None) -> None:
        """Meet the members before a collective, watching for steps that cannot complete.

        The members tell each other which collective they are in (``call``, default
        ``worker_comm.<method>()``): members in different ones raise ``MismatchError``
        alike, where the collectives themselves would wait for each other forever.
        """
        if self.closed:
            raise RuntimeError(f"{self.label}: worker_comm.{method}() after cluster.close(): "
                               f"the communicator is freed")
        call = call or f"worker_comm.{method}()"
        open_optimizers = [o for o in self.optimizers if not o.closed]
        for opt in open_optimizers:
            opt.park(True)
        if self._meet_poller is None:
            self._meet_poller = Poller(self.p2p_comm, self.timeout, self.label,
                                       spin_seconds(self.oversubscribed), self.losses)
        poller = self._meet_poller
        told = _SAME_CALL.get(call, call).encode()[:_CALL_BYTES].ljust(_CALL_BYTES)
        mine = np.frombuffer(told, dtype=np.uint8)
        calls = np.empty((meet.Get_size(), _CALL_BYTES), dtype=np.uint8)
        req = meet.Iallgather(mine, calls)
        start = time.monotonic()
        try:
            while not self._met(req, call):
                for opt in open_optimizers:
                    opt.raise_if_failed(call)
                poller.idle()
                if time.monotonic() - start > poller.timeout:
                    raise StallError(f"{self.label}: {call}: the other workers "
                                     f"did not reach it within {poller.timeout:g} s "
                                     f"(MPISYNC_TIMEOUT)")
        except BaseException:
            self._abandoned.append((req, mine, calls))   # MPI may still write into calls
            raise
        poller.busy()
        for opt in open_optimizers:
            opt.park(False)
        _check_calls([bytes(row).rstrip().decode(errors="replace") for row in calls],
                     self.label, "worker" if meet is self._meet_comm else "rank")

    # -- helpers among the workers (mpisync/runtime/collectives.py, mpisync/data.py) -------------
    def reduce(self, value: Any, op: str = "sum") -> Any:
        """``value`` reduced over the workers, on every worker: ``"sum"``, ``"mean"``,
        ``"max"`` or ``"min"`` of a tensor, a number, or a dict/list/tuple of them.

        Collective: call it on every worker, with values of the same structure, shapes
        and dtypes (a mismatch is a ``MismatchError`` on every worker). The workers meet
        first as before any collective on ``worker_comm``, so it is safe between steps in
        strict sync, and a ``DeadlockError`` instead of a hang otherwise. Result dtypes:
        see ``mpisync.runtime.collectives``.
        """
        from .runtime import collectives
        return collectives.reduce(self.helper_comm("reduce"), value, op)

    def batch_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        """Each value of the list reduced as ``reduce`` does, all in one exchange (one
        ``Allreduce`` per kind of number: integers, floating point, complex). Collective."""
        from .runtime import collectives
        return collectives.batch_reduce(self.helper_comm("batch_reduce"), values, op)

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Worker ``src``'s value on every worker (the others' ``value`` is ignored).
        Collective; see ``mpisync.runtime.collectives.broadcast``."""
        from .runtime import collectives
        return collectives.broadcast(self.helper_comm("broadcast"), value, src)

    def sampler(self, dataset: Sized, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> WorkerSampler:
        """This worker's ``mpisync.data.WorkerSampler`` (a ``DistributedSampler`` over the
        workers only): every example once per epoch, or ``n // W`` each with
        ``drop_last``; call ``set_epoch(epoch)`` before each epoch."""
        if self.worker_index is None:
            raise RuntimeError(f"{self.label}: sampler() is for workers")
        from .data import WorkerSampler
        return WorkerSampler(dataset, self.num_workers, self.worker_index, shuffle, seed,
                             drop_last)

    def helper_comm(self, what: str) -> MPI.Intracomm:
        """Meet the workers as before a collective on ``worker_comm``, then a private
        communicator of the workers for the helper's own collectives."""
        if self.is_ps:
            raise RuntimeError(f"{self.label}: {what}() is a collective among the workers; "
                               f"ps ranks call cluster.serve()")
        self._check_open(what)
        call = "opt.update()" if what == "update" else f"cluster.{what}()"
        self._before_collective(what, self._meet_comm, call)
        if self._helpers_comm is None:
            self._helpers_comm = self._worker_comm.Dup()     # every worker is here: met
        return self._helpers_comm

    def _met(self, req: MPI.Request, call: str) -> bool:
        try:
            return req.Test()
        except MPI.Exception as exc:
            if self.losses is None or not self.losses.note(exc):
                raise
            raise RuntimeError(
                f"{self.label}: {call}: {self.describe_lost()} lost: a "
                f"collective among the workers cannot complete without them; a job that "
                f"survives lost workers keeps such collectives out of training") from None

    def describe_lost(self, ranks: Sequence[int] | None = None) -> str:
        """``worker 2 (rank 2 on n1)``, for the ranks lost (default: every one noticed)."""
        if ranks is None:
            ranks = self.losses.lost if self.losses is not None else []
        return ", ".join(f"{role} {index} (rank {r} on {self.nodes[r]})"
                         for r in ranks for role, index in [self.layout.role(r)])

    def describe(self) -> str:
        """The roles on each node, one line a node: ``n2: worker 1 (rank 2), ps 1 (rank 3)``."""
        return self.layout.describe(self.nodes)

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this machine than cores they may run on: waits must not spin long."""
        return self.local_ranks > self.local_cores

    def ps_rank(self, ps_index: int) -> int:
        """World rank of ps ``ps_index``."""
        return self.layout.ps_ranks[ps_index]

    def worker_rank(self, worker_index: int) -> int:
        """World rank of worker ``worker_index``."""
        return self.layout.worker_ranks[worker_index]

    @property
    def coordinator_rank(self) -> int:
        """The world rank of ps 0, the coordinator: it runs the token barrier (collects
        each step's completion from every ps rank and broadcasts the new global step)."""
        return self.layout.coordinator_rank

    @property
    def label(self) -> str:
        """How messages name this rank: role, index, rank and host."""
        role = f"ps {self.ps_index}" if self.is_ps else f"worker {self.worker_index}"
        return f"{role} (rank {self.rank} on {self.host})"

    def serve(self) -> dict | list[dict]:
        """Serve every optimizer the workers create, until every worker left the job.

        Blocks. Call once on every ps rank. Workers train, ``close()`` their optimizers
        and leave the job with ``cluster.close()`` or by ending (mpisync sends the word at
        exit). Returns the final step statistics of the optimizer served, or a list of
        them in creation order when the workers created several (side by side, like a
        GAN's two, or one after another).

        Raises:
            RuntimeError: on a worker rank, when called again, or after ``close()``.
        """
        if not self.is_ps:
            raise RuntimeError(f"{self.label}: serve() is for ps ranks; workers train and "
                               f"then call opt.close()")
        self._check_open("serve")
        if self.stats is not None:
            raise RuntimeError(f"{self.label}: serve() already returned: every worker has "
                               f"left the job")
        from .ps.loop import serve  # late: the ps side pulls in torch

        self.stats = serve(self)
        return self.stats

    def _leave(self) -> None:
        """A worker tells every ps rank that it leaves the job (once)."""
        if self.is_ps or self.left or self.closed or MPI.Is_finalized():
            return
        for opt in list(self.optimizers):
            opt.close_at_exit()          # an open optimizer closes first
        self.left = True
        for rank in self.layout.ps_ranks:
            self.p2p_comm.send(None, dest=rank, tag=Tag.DONE)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{self.label}: {what}() after cluster.close()")

    def close(self) -> None:
        """Leave the job and free the communicators this cluster created.

        Call on every rank, at the end (a worker's optimizers close first, and it waits
        for the other workers to close theirs: their final statistics come then).
        """
        if self.closed or MPI.Is_finalized():
            return
        self._leave()
        for opt in self.optimizers:      # nothing may be left unread on the communicators
            opt.final_stats()
        self.closed = True
        for comm in (self.p2p_comm, self._meet_comm, self._worker_comm, self.ps_comm,
                     self._helpers_comm):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()

    def __repr__(self) -> str:
        return (f"Cluster({self.label}, num_workers={self.num_workers}, "
                f"num_ps={self.num_ps})")


#: Bytes of the name of the collective each member of a meeting tells the others.
_CALL_BYTES = 48
#: Methods that are the same MPI collective under another name: they meet as that one.
_SAME_CALL = {"worker_comm.barrier()": "worker_comm.Barrier()"}


def _check_calls(calls: list[str], label: str, member: str) -> None:
    """Raise ``MismatchError`` when the members of a meeting are in different collectives
    (on every member alike: each has every member's ``calls``)."""
    if len(set(calls)) > 1:
        each = ", ".join(f"{member} {i} in {c}" for i, c in enumerate(calls))
        raise MismatchError(f"{label}: the workers met for different collectives ({each}); "
                            f"every worker must call the same collectives, in the same order "
                            f"(Metric.compute() is a cluster.batch_reduce(); mpisync.save(), "
                            f"load() and Checkpointer use worker_comm)", collective=True)


_current: Cluster | None = None


def init(num_ps: int | None = None, comm: MPI.Comm | None = None,
         timeout: float | None = None, abort_on_error: bool = True,
         survive_worker_loss: bool | None = None,
         cuda_aware: bool | str = "auto") -> Cluster:
    """Split the MPI world into ps ranks and workers. Call on every rank.

    Args:
        num_ps: number of parameter-server ranks; default: the ``MPISYNC_NUM_PS``
            environment variable (set by ``python -m mpisync.launch --ps``), else 1;
            given beside an ``MPISYNC_NUM_PS`` of another value, it is refused on every
            rank. On one node they are the last ranks; on several, one per node first
            (``RankLayout.per_node``);
            ``MPISYNC_PS_LAYOUT=last`` or ``per_node`` chooses. A rank's node is
            ``MPISYNC_NODE``, else the Slurm node it runs on, else the host the launcher
            put it on (``python -m mpisync.launch --hosts``), else its host name.
        comm: the communicator to split; default ``MPI.COMM_WORLD``.
        timeout: seconds any wait may last before the job is declared stalled;
            default ``MPISYNC_TIMEOUT`` or 1800 (the first setup waits up to
            ``MPISYNC_SETUP_TIMEOUT``, 3600); ps 0 warns every ``MPISYNC_STALL_WARNING``
            seconds (60) that nothing arrived, naming the workers it waits for.
        abort_on_error: install an exception hook that reports an uncaught exception
            with this rank's name, tells the other ranks, and aborts the whole job, so
            that one failing rank never leaves the others waiting.
        survive_worker_loss: go on when workers die, as long as the others can complete
            every step (at least ``replicas_to_aggregate`` left; see
            docs/guides/lost-workers.md); default: ``MPISYNC_SURVIVE_WORKER_LOSS`` (set by
            ``python -m mpisync.launch --survive-worker-loss``), else off. Needs Open MPI
            started with ``mpirun --with-ft ulfm``; with another MPI rank 0 says why not
            and the job ends when a rank dies, as without it. The ranks of a job that lost
            workers and trained to its end exit with status 3 (``LOST_WORKERS_EXIT``).
        cuda_aware: whether MPI may be handed CUDA device buffers: ``"auto"`` (default:
            where the MPI library says it takes them), ``True`` (required: refused on
            every rank when the library does not) or ``False``; ``cluster.cuda_aware``
            holds the answer (``mpisync.worker.devices``).

    Each worker gets a device, ``cluster.device``: ``cuda:k`` for the k-th worker of its
    node among the GPUs it sees (``CUDA_VISIBLE_DEVICES``; more workers than GPUs share
    them round-robin), made torch's current CUDA device; ``cpu`` without CUDA. The ps
    ranks always compute on the CPU and never touch a GPU.

    From here on SIGUSR1 and SIGUSR2 (a preemption's or a time limit's warning) are noted,
    not fatal, where the program set no handler for them: an ``mpisync.Checkpointer`` made
    later stops the job politely at its first ``maybe_save()`` (``mpisync.runtime.stopping``).

    Torch's optimizers import ``torch._dynamo`` (over a second of CPU) the first time one is
    built, only to keep ``torch.compile`` out of methods nothing compiles yet: from
    ``init()`` on they import it when something else did (``torch.compile``), and behave
    as before in every other way (``mpisync.runtime.lazydynamo``).

    Raises:
        WorldTooSmallError: on every rank, when the world cannot hold ``num_ps`` ps
            ranks and at least one worker.
        ConfigError: on every rank, when any rank's environment holds a malformed
            ``MPISYNC_*`` variable (``check_environment``: a ``MPISYNC_BULK`` that is not 1
            or 0, an ``MPISYNC_NUM_PS`` that is not a number of ranks, ...), the ranks run
            different versions of mpisync or of its wire format, or ``MPISYNC_NUM_PS``
            differs from ``num_ps``; for a bad ``cuda_aware`` or ``True`` with an MPI
            library that takes no CUDA buffers.
        RuntimeError: ``init()`` was called already on this rank (and not closed).
    """
    global _current
    comm = MPI.COMM_WORLD if comm is None else comm
    lazydynamo.spare()
    stopping.listen_early()      # a preemption's warning before the Checkpointer: not lost
    if abort_on_error:
        install_excepthook(lambda: _current)
    if _current is not None and not _current.closed and not MPI.Is_finalized():
        raise RuntimeError(f"{_current.label}: mpisync.init() was called already on this "
                           f"rank; call it once per job and pass the cluster it returned "
                           f"(or cluster.close() first)")
    check_environment(comm)          # first: before any rank may wait on another
    num_ps = _agreed_num_ps(comm, num_ps)
    size = comm.Get_size()
    if num_ps < 1 or num_ps >= size:
        need = max(num_ps, 1) + 1
        raise WorldTooSmallError(
            f"rank {comm.Get_rank()}: num_ps={num_ps} needs 1 <= num_ps < world size; found "
            f"{size} MPI ranks but {num_ps} ps ranks and at least one worker need "
            f"{need}: start the job with at least {need} ranks (mpiexec -n {need} ..., or "
            f"python -m mpisync.launch --workers 1 --ps {max(num_ps, 1)} -- ...)")
    _check_versions(comm)
    cuda_aware = resolve_cuda_aware(cuda_aware, comm, f"rank {comm.Get_rank()}")
    placement = locate(comm)
    if placement.note and comm.Get_rank() == 0:
        print(f"[mpisync] {placement.note}", file=sys.stderr, flush=True)
    layout = RankLayout.choose(placement.nodes, num_ps, os.environ)
    survive = _survive(survive_worker_loss, comm.Get_rank())
    cluster = Cluster(comm, layout, DEFAULT_TIMEOUT if timeout is None else float(timeout),
                      placement, survive)
    cluster.cuda_aware = cuda_aware
    if not cluster.is_ps:
        cluster.device = worker_device(cluster.workers_only)
    _current = cluster
    if survive:           # runs after the worker left the job, before MPI finalizes
        atexit.register(exit_status, _current)
    atexit.register(_current._leave)      # a worker that ends leaves the job
    return _current


def check_environment(comm: MPI.Comm) -> None:
    """Every rank's ``MPISYNC_*`` variables are well formed, or every rank raises.

    Collective over ``comm``: what ``init()`` runs first, before any rank waits on another.
    Each rank reads every variable set in its environment as the registry says
    (``mpisync.environ.problem``) and the ranks agree on what they found
    (``mpisync.runtime.agreement.agree``), so that a malformed value on one rank is the
    same error on all of them, not an error on that rank while the others wait for it.
    Rank 0 then warns of each ``MPISYNC_*`` name that mpisync does not read but that is
    spelled almost as one it does (``mpisync.environ.misspelled``).

    Raises:
        ConfigError: on every rank, naming the first rank with a malformed value, the
            variable, the value and what it accepts.
    """
    found = env.problem(os.environ, {HOSTMAP_ENV: decode_host_map})
    agree(comm, found, first_problem)
    if comm.Get_rank() == 0:                 # a likely typo: said once for the job
        for text in env.misspelled():
            warnings.warn(f"rank 0: {text}", RuntimeWarning, stacklevel=3)


def _survive(asked: bool | None, rank: int) -> bool:
    """Whether this job survives lost workers: asked for, and the MPI can."""
    if asked is None:
        asked = env.switch(SURVIVE_ENV)
    if not asked:
        return False
    why_not = support()
    if why_not is not None and rank == 0:
        print(f"[mpisync] survive_worker_loss: {why_not}", file=sys.stderr, flush=True)
    return why_not is None


def _agreed_num_ps(comm: MPI.Comm, asked: int | None) -> int:
    """The number of ps ranks every rank asks for (``init(num_ps=)``, else
    ``MPISYNC_NUM_PS``, else 1), or the same ``ConfigError`` on every rank: a rank that
    asks for another number would take another role than the others give it, and wait."""
    rank = comm.Get_rank()
    try:
        mine: tuple[Exception | None, int | None] = (None, env.num_ps(asked, os.environ, rank))
    except (ConfigError, TypeError) as exc:
        mine = (exc, None)
    return agree(comm, mine, functools.partial(_num_ps_judge, rank))[0][1]


def _num_ps_judge(rank: int, found: list) -> Exception | None:
    """This rank's refusal, else the first rank's (as it was raised, collective), else a
    rank that asks for another number than rank 0."""
    failure = found[rank][0] or next((error for error, _ in found if error is not None), None)
    if failure is not None:
        error = type(failure)(*failure.args)
        if isinstance(error, ConfigError):
            error.collective = True
        return error
    counts = [n for _, n in found]
    differing = [r for r, n in enumerate(counts) if n != counts[0]]
    if not differing:
        return None
    return ConfigError(
        f"rank {rank}: every rank must ask for the same number of ps ranks: rank "
        f"{differing[0]} asks for {counts[differing[0]]} where rank 0 asks for {counts[0]} "
        f"(init(num_ps=...), else MPISYNC_NUM_PS, differs between ranks)", collective=True)


def _check_versions(comm: MPI.Comm) -> None:
    """Every rank runs the same mpisync and wire format, or every rank raises ConfigError."""
    from . import __version__  # late: defined once the package is imported
    agree(comm, (__version__, WIRE_VERSION), functools.partial(_versions_judge, comm.Get_rank()))


def _versions_judge(rank: int, versions: list) -> ConfigError | None:
    differing = [r for r, v in enumerate(versions) if v != versions[0]]
    if not differing:
        return None
    (first, wire0), (other, wire) = versions[0], versions[differing[0]]
    return ConfigError(
        f"rank {rank}: every rank must run the same mpisync: rank "
        f"{differing[0]} runs mpisync {other} (wire format {wire}) where rank 0 runs "
        f"mpisync {first} (wire format {wire0})"
        + (f"; ranks {differing} differ from rank 0" if len(differing) > 1 else ""),
        collective=True)
