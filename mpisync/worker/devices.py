"""Workers' devices: which accelerator a worker computes on, CUDA-aware MPI, and staging.

A worker keeps its parameters, gradients and buffers on its device (``cluster.device``);
the ps ranks keep the master copy and the optimizer state in CPU memory, as TensorFlow's
``/job:ps/cpu:0``. ``Staging`` moves what travels between the two through host buffers:
each bucket's gradients from backward's hooks (on a side stream, an event per bucket,
into pinned memory where CUDA), and the new parameters back with non-blocking copies on
the device's current stream, so that the next kernel that reads them runs after them.
The same code runs for parameters on the CPU (plain host buffers, plain copies), which
is how the CPU-only test suite covers it (``MPISYNC_STAGE_CPU=1``).
"""
from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .. import environ as env
from ..errors import ConfigError

__all__ = [
    "CUDA_AWARE_CHOICES",
    "STAGE_CPU_ENV",
    "Staging",
    "cuda_support",
    "default_backend",
    "gpu_identity",
    "host_bytes",
    "mpi_library",
    "nccl_group",
    "pick_device",
    "raw_bytes",
    "resolve_cuda_aware",
    "shared_gpu",
    "staged",
    "worker_device",
]

CUDA_AWARE_CHOICES = ("auto", True, False)
#: ``1``: stage CPU parameters too (host copies instead of views), the GPU path's code.
STAGE_CPU_ENV = "MPISYNC_STAGE_CPU"


def pick_device(local_index: int, device_count: int) -> str:
    """``cuda:k`` for the ``local_index``-th worker of a node with ``device_count`` GPUs.

    Workers beyond the count share GPUs round-robin (slower: they take turns on it);
    without GPUs every worker computes on the CPU.
    """
    if device_count <= 0:
        return "cpu"
    return f"cuda:{local_index % device_count}"


def worker_device(worker_comm: MPI.Comm) -> torch.device:
    """This worker's device; call on every worker (a collective over ``worker_comm``).

    The local index is this worker's rank among the workers of its node (MPI's shared
    memory domain, ``MPI.COMM_TYPE_SHARED``); ``torch.cuda`` counts the GPUs the process
    sees, so ``CUDA_VISIBLE_DEVICES`` is honoured (``cuda:0`` is its first entry). The
    device becomes torch's current CUDA device.
    """
    local = worker_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        index = local.Get_rank()
    finally:
        local.Free()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device(pick_device(index, count))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _library_cuda_query() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the MPI library mpi4py loaded (MPICH and Open MPI
    export it), or None where the library has no such function."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if os.path.basename(line.split()[-1]).startswith("libmpi")})
    except OSError:
        paths = []
    for path in paths or [None]:
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return None


def cuda_support(comm: MPI.Comm) -> tuple[bool, str]:
    """Whether the MPI library takes CUDA device buffers, and how that was found out.

    MPI 4.1's memory allocation kinds first (``mpi_memory_alloc_kinds`` of the
    communicator's info lists ``cuda`` when it does), then the library's own
    ``MPIX_Query_cuda_support()``.
    """
    kinds = None
    try:
        info = comm.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        pass
    if kinds and "cuda" in kinds:
        return True, f"mpi_memory_alloc_kinds={kinds!r}"
    queried = _library_cuda_query()
    if queried is not None:
        return queried, f"MPIX_Query_cuda_support() returned {int(queried)}"
    return False, (f"mpi_memory_alloc_kinds={kinds!r} and no MPIX_Query_cuda_support()"
                   if kinds else "the library reports no CUDA support")


def mpi_library() -> str:
    """The first line of ``MPI.Get_library_version()``: the library's name and version."""
    return MPI.Get_library_version().strip().splitlines()[0].strip()


def resolve_cuda_aware(value, comm: MPI.Comm, label: str) -> bool:
    """``cuda_aware`` of ``mpisync.init()`` as a bool. Call on every rank of ``comm``.

    ``"auto"``: whether every rank's MPI takes CUDA buffers; ``True`` asks for it and is
    refused on every rank where any rank's MPI does not; ``False``: never.

    Raises:
        ConfigError: (every rank) another value, or ``True`` with an MPI without CUDA.
    """
    if not any(value is c or (isinstance(c, str) and value == c) for c in CUDA_AWARE_CHOICES):
        raise ConfigError(f"{label}: cuda_aware must be 'auto', True or False, got {value!r}",
                          collective=True)
    if value is False:
        return False
    supported, how = cuda_support(comm)
    everywhere = comm.allreduce(int(supported), op=MPI.MIN)
    if value is True and not everywhere:
        raise ConfigError(
            f"{label}: cuda_aware=True but the MPI library {mpi_library()!r} is not "
            f"CUDA-aware on {'this rank' if not supported else 'another rank'} ({how}); the "
            f"MPI wheels from PyPI never are. Build mpi4py against a CUDA-aware site MPI "
            f"(docs/guides/gpu.md), or pass cuda_aware='auto' to stage through host memory",
            collective=True)
    return bool(everywhere)


def staged(t: torch.Tensor, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``t`` travels through host buffers instead of living in them: every tensor
    off the CPU, and CPU ones too with ``MPISYNC_STAGE_CPU=1``."""
    return t.device.type != "cpu" or env.switch(STAGE_CPU_ENV, environ=environ)


def gpu_identity(params) -> tuple[str, str] | None:
    """``(host, GPU)`` of the first parameter on CUDA (the GPU by its UUID where torch
    reports one), or None where no parameter is on CUDA: what NCCL needs distinct."""
    import socket

    device = next((p.device for p in params if torch.is_tensor(p) and p.device.type == "cuda"),
                  None)
    if device is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return socket.gethostname(), str(uuid) if uuid is not None else f"cuda:{index}"


def shared_gpu(gpus: list) -> tuple[int, int, tuple[str, str]] | None:
    """The first two workers (indices) on one GPU, with the GPU, among every worker's
    ``gpu_identity``; None where each worker on CUDA has its own."""
    first: dict = {}
    for w, gpu in enumerate(gpus):
        if gpu is None:
            continue
        if tuple(gpu) in first:
            return first[tuple(gpu)], w, tuple(gpu)
        first[tuple(gpu)] = w
    return None


def default_backend(backend: str, gpus: list) -> str:
    """``allreduce_backend="auto"``, from every worker's ``gpu_identity``: NCCL where every
    worker's parameters are on a GPU of its own (NCCL refuses two ranks on one device),
    else MPI (through host memory, where a GPU is shared)."""
    if backend != "auto":
        return backend
    own = bool(gpus) and all(g is not None for g in gpus) and shared_gpu(gpus) is None
    return "nccl" if own else "mpi"


def host_bytes(nbytes: int, pinned: bool) -> np.ndarray:
    """A zeroed host buffer of ``nbytes`` bytes: page-locked (pinned) when ``pinned``, so
    that copies to and from a CUDA device run asynchronously."""
    if pinned:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.zeros(nbytes, np.uint8)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor, as a NumPy array (writes change no torch version)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with a version counter of its own: writing it is not
    a write that mpisync's write tracker (or autograd) sees on ``t``."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return out


class Staging:
    """The staged tensors of one optimizer's dense parameters: device and host sides.

    ``add(i, param, host_param, host_grad)`` registers parameter ``i``: its values live on
    its own device, ``host_param``/``host_grad`` are its places in the fused host buffers
    that MPI sends and receives. ``grad_to_host(i, grad)`` starts the gradient's copy
    (CUDA: on the device's side stream, after what the current stream queued);
    ``record(n)`` marks bucket ``n`` complete and ``landed(n)`` says whether its bytes
    are on the host; ``to_devices()`` starts the copies of the pulled parameters back,
    and ``wait_host_free()`` waits until they have read the host buffers (before MPI
    writes them again).
    """

    def __init__(self, label: str):
        self.label = label
        self.params: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.targets: dict[int, torch.Tensor] = {}
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copied: dict[int, tuple] = {}     # i -> (weakref, version) of the grad copied
        self.side: dict[torch.device, torch.cuda.Stream] = {}
        self.events: dict[int, list] = {}                  # bucket -> CUDA events
        self.inbound: list = []                            # events after the copies back
        self.cuda = False
        self.bytes_to_host = self.bytes_to_devices = 0     # copied so far, for benchmarks

    def __bool__(self) -> bool:
        return bool(self.params) or bool(self.buffers)

    def __contains__(self, i: int) -> bool:
        return i in self.params

    def add(self, i: int, param: torch.Tensor, host_param: torch.Tensor,
            host_grad: torch.Tensor) -> None:
        """Parameter ``i`` stays on its device; its values are copied into ``host_param``
        and a gradient it already has into ``host_grad``."""
        self.params[i] = (param, host_param, host_grad)
        self.targets[i] = _alias(param.detach())
        self.cuda |= param.device.type == "cuda"
        with torch.no_grad():
            host_param.copy_(param.detach())
            if param.grad is not None:
                host_grad.copy_(param.grad)

    def add_buffer(self, buffer: torch.Tensor, host: torch.Tensor) -> None:
        """A module buffer that stays on its device; ``host`` is its place in the buffers."""
        self.buffers.append((buffer, host))
        self.cuda |= buffer.device.type == "cuda"
        host.copy_(buffer)

    def rebind(self, i: int) -> None:
        """Parameter ``i`` was given a new tensor (``p.data = x``) on its device: its
        values go to the host buffer (the tracker refused one on another device)."""
        p, host, _ = self.params[i]
        self.targets[i] = _alias(p.detach())
        with torch.no_grad():
            host.copy_(p.detach())      # deliberate: the new values must reach the ps

    # -- gradients: device to host --------------------------------------------------------
    def grad_to_host(self, i: int, grad: torch.Tensor, host: torch.Tensor) -> None:
        """Start copying ``grad`` into ``host``, unless that very gradient is there already."""
        seen = self.copied.get(i)
        if seen is not None and seen[0]() is grad and seen[1] == grad._version:
            return
        self.copied[i] = (weakref.ref(grad), grad._version)
        self.bytes_to_host += host.nbytes
        if grad.device.type == "cuda":
            device = grad.device
            stream = self.side.get(device)
            if stream is None:
                stream = self.side[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))   # backward's kernels first
            with torch.cuda.stream(stream):
                host.copy_(grad, non_blocking=True)
            grad.record_stream(stream)   # the caching allocator keeps it until the copy ran
        else:
            host.copy_(grad)            # the CPU, or a device with no streams: synchronous

    def forget_grads(self) -> None:
        """The next gradients are new ones, even in the same tensors (after a push)."""
        self.copied.clear()

    def record(self, n: int) -> None:
        """Bucket ``n``'s copies are queued: an event after them on each side stream."""
        if not self.side:
            return
        events = []
        for stream in self.side.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self.events[n] = events

    def landed(self, n: int, wait: bool = False) -> bool:
        """Whether bucket ``n``'s gradients are on the host (``wait``: wait for them)."""
        events = self.events.get(n)
        if not events:
            return True
        if wait:
            for event in events:
                event.synchronize()
        elif not all(event.query() for event in events):
            return False
        del self.events[n]
        return True

    def sync(self) -> None:
        """Every gradient copy queued so far is on the host."""
        for stream in self.side.values():
            stream.synchronize()
        self.events.clear()

    def buffers_to_host(self) -> None:
        """The module buffers' current values into their host places (before a push)."""
        for buffer, host in self.buffers:
            host.copy_(buffer)

    def params_to_host(self, indices: Sequence[int]) -> None:
        """Parameters written on their device: their values into the host buffers."""
        with torch.no_grad():
            for i in indices:
                if i in self.params:
                    p, host, _ = self.params[i]
                    host.copy_(p.detach())

    # -- parameters: host to device -------------------------------------------------------
    def to_devices(self) -> None:
        """Start copying the pulled parameters and buffers to their devices.

        Non-blocking copies on each device's current stream: whatever that stream runs
        next (the forward pass) reads the new values. The write goes through an alias, so
        it is no write the tracker counts.
        """
        devices = set()
        for i, (p, host, _) in self.params.items():
            target = self.targets[i]
            if target.data_ptr() != p.data_ptr():        # p.data = x since: follow it
                target = self.targets[i] = _alias(p.detach())
            target.copy_(host, non_blocking=True)
            self.bytes_to_devices += host.nbytes
            devices.add(p.device)
        for buffer, host in self.buffers:
            buffer.copy_(host, non_blocking=True)
            devices.add(buffer.device)
        self.inbound = []
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self.inbound.append(event)

    def wait_host_free(self) -> None:
        """The copies back to the devices have read the host buffers: MPI may write them."""
        for event in self.inbound:
            event.synchronize()
        self.inbound = []


def nccl_group(worker_comm: MPI.Comm, device: torch.device, backend: str = "nccl"):
    """A ``torch.distributed`` NCCL group (or ``backend``'s) over the ranks of
    ``worker_comm``; call on every one of them. Returns (group, whether the caller must
    destroy it).

    The rendezvous comes from MPI, with no launcher variables: rank 0 opens a ``TCPStore``
    on a free port of its host and the address travels in a broadcast over
    ``worker_comm``. Where the program initialised ``torch.distributed`` itself over
    exactly these workers, its default group is used.
    """
    import socket

    import torch.distributed as dist

    rank, size = worker_comm.Get_rank(), worker_comm.Get_size()
    if dist.is_initialized():
        if dist.get_world_size() != size:
            raise RuntimeError(
                f"torch.distributed was initialised with {dist.get_world_size()} processes but "
                f"the job has {size} workers; initialise it over the workers only "
                f"(cluster.worker_comm), or leave it to mpisync")
        return dist.group.WORLD, False
    store = None
    if rank == 0:
        store = dist.TCPStore(socket.gethostname(), 0, size, is_master=True,
                              wait_for_workers=False)
    host, port = worker_comm.bcast((socket.gethostname(), store.port) if rank == 0 else None,
                                   root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            device_id=torch.device(device) if backend == "nccl" else None)
    return dist.group.WORLD, True
