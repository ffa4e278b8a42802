"""Dense parameters averaged among the workers (``dense="allreduce"``), updated on each worker.

What DDP does, beside the ps ranks: gradients are summed over the workers' communicator
in buckets, each started from gradient hooks as soon as backward has produced all of its
gradients, and finished when backward ends, so that after ``loss.backward()`` every
``.grad`` holds the mean over the workers (clipping it is then exact). Every worker then
applies the wrapped optimizer to these parameters itself; their state stays on the
workers. Embedding tables and partitioned parameters stay on the ps ranks.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from .buckets import GradBuckets
from .devices import shared_gpu

__all__ = ["AllreduceChannel", "LocalAverages", "backend_problem"]

# 16-bit floats are summed in float32: MPI has no predefined type for them
_REDUCE_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class _Bucket:
    """Gradients of some parameters of one dtype, then one presence flag per parameter."""

    __slots__ = ("array", "dtype", "flags", "flat", "index", "name", "numel", "params",
                 "same_dtype", "views")

    def __init__(self, index: int, params: list[torch.Tensor], opt_id: int,
                 device: torch.device | None = None):
        dtype = params[0].dtype
        reduce_dtype = _REDUCE_DTYPE.get(dtype, dtype)
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.numel + len(params), dtype=reduce_dtype, device=device)
        self.flags = self.flat[self.numel:]
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.dtype = dtype
        self.same_dtype = reduce_dtype == dtype
        # mpi4py takes MPI's own type from the NumPy typecode (or a CUDA tensor's interface)
        self.array = self.flat.numpy() if self.flat.device.type == "cpu" else self.flat
        self.name = f"mpisync.{opt_id}.bucket{index}"


def _buckets(params: list[torch.Tensor], bucket_bytes: int, opt_id: int,
             on_device: bool = False) -> list[_Bucket]:
    """Buckets in the order backward produces gradients: the last parameters first; one
    dtype and one device each, held on that device (``on_device``) or on the host."""
    out: list[_Bucket] = []
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    size: dict[tuple, int] = {}
    for p in reversed(params):
        kind = (p.dtype, p.device if on_device else torch.device("cpu"))
        group = by_kind.setdefault(kind, [])
        if group and size[kind] + p.numel() * p.element_size() > bucket_bytes:
            out.append(_Bucket(len(out), group, opt_id, kind[1]))
            group = by_kind[kind] = []
            size[kind] = 0
        group.append(p)
        size[kind] = size.get(kind, 0) + p.numel() * p.element_size()
    out.extend(_Bucket(len(out), group, opt_id, kind[1])
               for kind, group in by_kind.items() if group)
    return out


def backend_problem(backend: str, worker_comm: MPI.Comm, num_workers: int,
                    gpus: list | None = None) -> str | None:
    """What keeps ``backend`` from averaging among the workers, or None (every worker).

    ``gpus``: every worker's ``devices.gpu_identity`` (NCCL needs a GPU per worker).

    Horovod is initialised here, on the workers' communicator, before the workers agree
    on the set-up, so that a missing or wrongly initialised Horovod is refused on every
    rank, the ps ranks included.
    """
    if backend == "nccl":
        shared = shared_gpu(gpus or [])
        if shared is not None:
            a, b, (host, gpu) = shared
            return (f"allreduce_backend='nccl' needs a GPU of its own for each worker, but "
                    f"workers {a} and {b} share GPU {gpu} on {host} (NCCL refuses two ranks "
                    f"on one device): give each worker its own GPU (CUDA_VISIBLE_DEVICES), "
                    f"or leave allreduce_backend='auto', which averages through host memory "
                    f"where workers share a GPU")
        if not (torch.cuda.is_available() and torch.distributed.is_available()
                and torch.distributed.is_nccl_available()):
            return ("allreduce_backend='nccl' needs CUDA and a torch built with NCCL; use "
                    "allreduce_backend='mpi' for parameters on the CPU")
        return None
    if backend != "horovod":
        return None
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
                 "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        return (f"allreduce_backend='horovod' needs MPI initialised with MPI_THREAD_MULTIPLE "
                f"(Horovod's thread calls MPI while this one does), but MPI runs with "
                f"{names.get(level, level)}: leave mpi4py.rc.thread_level at 'multiple' "
                f"(mpi4py's default; an MPI built without thread support cannot), or use "
                f"allreduce_backend='mpi'")
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        return f"allreduce_backend='horovod' needs horovod (make horovod installs it): {exc}"
    if not hvd.is_initialized():
        hvd.init(comm=worker_comm)
    if hvd.size() != num_workers:
        return (f"horovod was initialised with {hvd.size()} processes but the job has "
                f"{num_workers} workers; let mpisync initialise it (on the workers only: the "
                f"ps ranks take no part), or call hvd.init(comm=cluster.worker_comm)")
    return None


class _MpiReducer:
    """mpi4py's ``Iallreduce``, in place, on a private copy of the workers' communicator.

    The wait blocks in MPI: its progress engine then moves a large reduction twice as
    fast as a loop of tests does. It cannot hang the job: a worker that fails aborts it,
    and one that stalls stops its pushes, which ps 0 reports and ends the job for.
    """

    def __init__(self, comm: MPI.Comm):
        self.comm = comm

    def start(self, bucket: _Bucket):
        return self.comm.Iallreduce(MPI.IN_PLACE, bucket.array, op=MPI.SUM)

    @staticmethod
    def poke(handles: list) -> None:
        """Let MPI move the reductions in flight while backward computes."""
        MPI.Request.Testall(handles)

    @staticmethod
    def wait(handles: list) -> None:
        MPI.Request.Waitall(handles)

    def close(self) -> None:
        pass


class _NcclReducer:
    """``torch.distributed`` with NCCL over the workers, set up from their communicator
    (``mpisync.worker.devices.nccl_group``): buckets on the GPU, summed on NCCL's stream."""

    def __init__(self, comm: MPI.Comm, device: torch.device):
        from .devices import nccl_group
        self.dist = torch.distributed
        self.group, self.owned = nccl_group(comm, device)

    def start(self, bucket: _Bucket):
        return self.dist.all_reduce(bucket.flat, op=self.dist.ReduceOp.SUM, group=self.group,
                                    async_op=True)

    @staticmethod
    def poke(handles: list) -> None:
        """NCCL's stream moves them."""

    @staticmethod
    def wait(handles: list) -> None:
        for h in handles:
            h.wait()          # the current stream waits for the sum: later kernels see it

    def close(self) -> None:
        if self.owned:
            self.dist.destroy_process_group(self.group)


class _HorovodReducer:
    """Horovod's allreduce, initialised on the workers' communicator (``backend_problem``)."""

    users = 0

    def __init__(self):
        import horovod.torch as hvd
        self.hvd = hvd
        _HorovodReducer.users += 1

    def start(self, bucket: _Bucket):
        return self.hvd.allreduce_async_(bucket.flat, name=bucket.name, op=self.hvd.Sum)

    @staticmethod
    def poke(handles: list) -> None:
        """Horovod's own thread moves them."""

    def wait(self, handles: list) -> None:
        for h in handles:
            self.hvd.synchronize(h)

    def close(self) -> None:
        _HorovodReducer.users -= 1
        if _HorovodReducer.users == 0:
            self.hvd.shutdown()


class AllreduceChannel:
    """The dense parameters of route ``allreduce``: their gradients, averaged among workers.

    One round sums every bucket over the workers, in bucket order on every worker (MPI's
    nonblocking collectives must start in the same order everywhere). A round runs at
    the end of each ``backward()`` that produced a gradient for one of them (buckets
    whose gradients are all there start while backward still runs), and in ``step()`` if
    none ran since the last step (a worker whose batch touched none of them). So every
    worker must call ``backward()`` equally often between two steps, as with DDP.

    A parameter without a gradient on some workers counts as zeros there (the mean over
    the combined batch); one without a gradient on every worker keeps ``.grad = None``.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], worker_comm: MPI.Comm, *,
                 num_workers: int, reduction: str, bucket_bytes: int, backend: str,
                 opt_id: int, label: str, cuda_aware: bool = False):
        self.label = label
        self.name_of = {id(p): n for n, p in zip(names, params)}
        self.params = [p for p in params if p.is_floating_point() or p.is_complex()]
        self.scale = 1.0 / num_workers if reduction == "mean" else 1.0
        # NCCL, and a CUDA-aware MPI, sum the buckets where the gradients are; the others
        # through host memory
        on_device = backend == "nccl" or (backend == "mpi" and cuda_aware)
        self.buckets = _buckets(self.params, bucket_bytes, opt_id, on_device)
        self.comm = worker_comm.Dup()
        if backend == "nccl":
            self.reducer = _NcclReducer(self.comm, self.params[0].device)
        elif backend == "horovod":
            self.reducer = _HorovodReducer()
        else:
            self.reducer = _MpiReducer(self.comm)
        self.chief_words = self.chief_codes = None
        self.rounds = 0                 # rounds since the last step
        self.handles: list = []
        self.bytes = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)
        # one lane: every worker starts the buckets in the same order
        self.grads = GradBuckets([b.params for b in self.buckets], [0] * len(self.buckets),
                                 lambda k: self._start(self.buckets[k]), self._finish,
                                 self._again, self._poke)
        self.hooks = self.grads.hooks          # more may join (tables' gradients: touch)

    def touch(self, _tensor: torch.Tensor | None = None) -> None:
        """A backward produced a gradient mpisync sends elsewhere (a table's rows): this
        worker takes part in the round that backward's end runs, as the others do."""
        if not self.grads.in_backward:
            self.grads.begin()

    def _again(self, k: int, param: torch.Tensor) -> None:
        if self.grads.started[k]:
            raise RuntimeError(
                f"a parameter of shape {list(param.shape)} received a second gradient "
                f"in one backward pass after its bucket was sent (a parameter used "
                f"inside torch.utils.checkpoint(use_reentrant=True) and outside it); "
                f"dense='allreduce' cannot average it: use use_reentrant=False")

    def _poke(self, handed_out: bool) -> None:
        if self.handles and not handed_out:
            self.reducer.poke(self.handles)

    def _start(self, bucket: _Bucket) -> None:
        for k, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            g = p.grad
            if g is None:
                view.zero_()
                bucket.flags[k] = 0
                continue
            if g.layout is not torch.strided:
                raise TypeError(f"parameter of shape {list(p.shape)} has a sparse gradient; "
                                f"dense='allreduce' sums dense gradients (give the embedding "
                                f"to the ps ranks: mpisync.Embedding)")
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)           # deliberate: the gradient was made outside the bucket
            bucket.flags[k] = 1
        self.handles.append(self.reducer.start(bucket))

    def _finish(self) -> None:
        """End of a round: start what is left, wait, and hand each parameter the mean."""
        self.grads.flush()
        handles, self.handles = self.handles, []
        self.reducer.wait(handles)
        for bucket in self.buckets:
            self._unpack(bucket)
        self.rounds += 1

    def _unpack(self, bucket: _Bucket) -> None:
        if self.scale != 1.0:
            bucket.flat[:bucket.numel].mul_(self.scale)
        present = bucket.flags.tolist()
        for p, view, count in zip(bucket.params, bucket.views, present):
            if count == 0:
                p.grad = None
            elif view.device != p.device:     # summed on the host: back to the device
                if p.grad is None:
                    p.grad = view.to(p.device, p.dtype)
                else:
                    p.grad.copy_(view)
            elif bucket.same_dtype:
                if p.grad is not view:
                    p.grad = view       # backward accumulates into the bucket from now on
            elif p.grad is None:
                p.grad = view.to(p.dtype)
            else:
                p.grad.copy_(view)

    def before_step(self) -> None:
        """Call in ``step()``: a round, if no backward ran one since the last step."""
        for b in self.buckets:
            for p in b.params:
                if p.dtype != b.dtype:
                    raise TypeError(
                        f"{self.label}: parameter {self.name_of[id(p)]!r} became a {p.dtype} "
                        f"tensor after the "
                        f"optimizer was created (it was {b.dtype}); convert the model before "
                        f"creating the SyncReplicasOptimizer")
        self.grads.hook_new()
        if self.rounds == 0:
            self.grads.reset()
            self._finish()
        self.rounds = 0

    def zero_grad(self, set_to_none: bool) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def chief_hyper(self, words: np.ndarray, codes: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The chief's hyper-parameters (collective), or None where they equal ``words``.

        With ``dense="ps"`` a step applies the lowest-index taken worker's values, in
        strict sync the chief's; the workers applying the step themselves take them too,
        so a scheduler stepped on each worker's own metric cannot drive them apart.
        """
        if self.chief_words is None:
            self.chief_words, self.chief_codes = np.empty_like(words), np.empty_like(codes)
        if self.comm.Get_rank() == 0:
            self.chief_words[:], self.chief_codes[:] = words, codes
        self.comm.Bcast(self.chief_words, root=0)
        self.comm.Bcast(self.chief_codes, root=0)
        if np.array_equal(self.chief_words, words) and np.array_equal(self.chief_codes, codes):
            return None
        return self.chief_words, self.chief_codes

    def close(self) -> None:
        self.grads.remove()
        self.reducer.close()
        self.comm.Free()


class LocalAverages:
    """Moving averages of the parameters the workers update, as the ps ranks keep theirs."""

    def __init__(self, decay: float | None, num_updates: bool, named: list[tuple[str, torch.Tensor]]):
        self.decay = decay
        self.num_updates = num_updates
        self.named = [(n, p) for n, p in named if p.is_floating_point()] if decay is not None else []
        self.averages = {n: p.detach().clone() for n, p in self.named}

    def update(self, t: int) -> None:
        """After the t-th applied step (``min(decay, (1 + t) / (10 + t))`` with num_updates)."""
        if not self.named:
            return
        decay = min(self.decay, (1 + t) / (10 + t)) if self.num_updates else self.decay
        with torch.no_grad():
            for n, p in self.named:
                self.averages[n].lerp_(p.detach(), 1.0 - decay)

    def values(self) -> dict[str, torch.Tensor]:
        return {n: v.clone() for n, v in self.averages.items()}

    def load(self, saved: dict) -> None:
        """Saved averages; parameters without one restart from the parameter."""
        with torch.no_grad():
            for n, p in self.named:
                self.averages[n].copy_(saved[n] if n in saved else p.detach())
