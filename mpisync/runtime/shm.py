"""A worker and a ps rank on one machine: gradients and parameters through shared memory.

For each optimizer a ps rank makes one shared segment (an anonymous ``memfd``) holding its
parameters, and per worker of its machine a gradient slot and two flags per bucket. Such a
worker's gradients *are* its slot (``backward()`` writes them there, the ps reduces them
from there), so a push sends only its header; the ps publishes each bucket of new
parameters by raising the worker's ``ready`` flag, and the worker copies it into its own
parameters and raises ``ack`` (what an MPI send's completion tells the ps otherwise). So
neither side copies a gradient, and each worker copies the parameters itself, in parallel,
bucket by bucket while the ps applies the next ones.

Which pairs use it is settled at set-up: every worker tells every ps rank its machine
(``nodes.machine_id``); a ps rank offers a segment to the workers of its machine
(``/proc/<ps pid>/fd/<fd>``), each maps it or says it cannot, and the ps closes the
descriptor once all answered. The segment never has a name in ``/dev/shm``: the kernel frees
it when the last mapping goes (the optimizer closes, or the process ends however it ends),
so nothing is left behind and two jobs on one machine cannot collide. Pairs on two
machines, and every pair when ``shared_memory`` is off (``MPISYNC_SHARED_MEMORY=0``), a
``wire_dtype`` is set, or ``num_tokens`` lets a worker push again before its gradient
was applied, exchange MPI messages as before. The flags are single aligned 8-byte words,
written after the data they announce: ordered on x86-64 (the only machines where the
path is on by default).
"""
from __future__ import annotations

import mmap
import os
import platform

import numpy as np

from .. import environ as env
from ..protocol.wire import ALIGN, PARAM_HEADER_BYTES, Tag
from .nodes import machine_id

__all__ = ["Nothing", "Publication", "Segment", "accept", "enabled", "offer", "wants"]

_FDS = "/proc/self/fd"
_MAGIC = 0x6D707379_6E637368        # "mpsyncsh"
_PAGE = 4096


def enabled(spec) -> bool:
    """Whether this optimizer's ranks look for pairs to join through shared memory: the
    same on every rank (the chief's spec). Each rank takes part only if it ``wants`` to."""
    return bool(spec.shared_memory and spec.wire_dtype is None and spec.num_tokens == 0)


def wants() -> bool:
    """Whether this rank pairs through shared memory: its own ``MPISYNC_SHARED_MEMORY``
    and system. A pair joins only when both ranks want it, so ranks whose settings differ
    exchange MPI messages instead."""
    return bool(env.switch("MPISYNC_SHARED_MEMORY",       # unset: on x86-64 only
                           platform.machine().lower() in ("x86_64", "amd64"))
                and hasattr(os, "memfd_create") and os.path.isdir(_FDS))


def _up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def _layout(data_nbytes: int, num_buckets: int, num_local: int) -> tuple[int, ...]:
    """(parameters at, flags at, slots at, bytes per slot, total bytes) of a segment."""
    params_at = _PAGE
    flags_at = _up(params_at + PARAM_HEADER_BYTES + data_nbytes, _PAGE)
    slots_at = _up(flags_at + 16 * max(1, num_buckets) * num_local, _PAGE)
    slot_bytes = _up(max(1, data_nbytes), _PAGE)
    return params_at, flags_at, slots_at, slot_bytes, slots_at + slot_bytes * num_local


class Segment:
    """One ps rank's shared memory for one optimizer: parameters, flags, gradient slots.

    Layout (bytes): a header of int64 words (magic, data bytes, buckets, workers), the
    parameter buffer (``PARAM_HEADER_BYTES`` + data), then per worker of the machine its
    ``ready`` and ``ack`` flags (int64 per bucket), then per worker its gradient slot
    (data), each page-aligned.
    """

    def __init__(self, mm: mmap.mmap, data_nbytes: int, num_buckets: int, num_local: int):
        self.mm = mm
        self.buf = np.frombuffer(mm, np.uint8)
        self.params_at, self.flags_at, self.slots_at, self.slot_bytes, _ = _layout(
            data_nbytes, num_buckets, num_local)
        self.data_nbytes, self.num_buckets, self.num_local = data_nbytes, num_buckets, num_local

    @property
    def params(self) -> np.ndarray:
        """The parameter buffer: header, then the data region (the ps's master copy)."""
        return self.buf[self.params_at:self.params_at + PARAM_HEADER_BYTES + self.data_nbytes]

    def flags(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ready, ack) of local worker ``i``: int64 per bucket."""
        k = max(1, self.num_buckets)
        at = self.flags_at + 16 * k * i
        words = self.buf[at:at + 16 * k].view(np.int64)
        return words[:k], words[k:]

    def slot(self, i: int) -> np.ndarray:
        """Local worker ``i``'s gradients (the data region of its pushes)."""
        at = self.slots_at + self.slot_bytes * i
        return self.buf[at:at + self.data_nbytes]

    def close(self) -> None:
        """Drop this process's mapping (after every view of it is gone)."""
        self.buf = None
        try:
            self.mm.close()
        except BufferError:      # a view is still alive: the mapping goes with the process
            pass


def offer(comm, worker_ranks, opt_id: int, ps_index: int, data_nbytes: int,
          num_buckets: int, poller, label: str) -> tuple[Segment | None, dict[int, int]]:
    """On a ps rank: a segment for the workers of this machine that can map it.

    Call on every ps rank while every worker calls ``accept`` (set-up). Returns the
    segment (None if no worker shares it) and, for each worker that does, its slot.
    """
    tag = Tag.of(Tag.SHM, opt_id)
    mine = machine_id()
    machines = [poller.wait_message(r, tag, lambda w=w: f"worker {w}'s machine")
                for w, r in enumerate(worker_ranks)]
    local = [w for w, m in enumerate(machines) if m == mine and m is not None and wants()]
    segment, fd, path = None, -1, None
    if local:
        try:
            size = _layout(data_nbytes, num_buckets, len(local))[-1]
            fd = os.memfd_create(f"mpisync-o{opt_id}-p{ps_index}", os.MFD_CLOEXEC)
            path = f"/proc/{os.getpid()}/fd/{fd}"
            os.ftruncate(fd, size)
            segment = Segment(mmap.mmap(fd, size), data_nbytes, num_buckets, len(local))
            segment.buf[:8 * 4].view(np.int64)[:] = (_MAGIC, data_nbytes, num_buckets,
                                                     len(local))
        except OSError:
            segment, local = None, []
    try:
        for w, r in enumerate(worker_ranks):
            comm.send((path, local.index(w)) if w in local else None, dest=r, tag=tag)
        answers = {w: poller.wait_message(worker_ranks[w], tag,
                                          lambda w=w: f"worker {w} mapping {label}'s memory")
                   for w in local}
    finally:
        if fd >= 0:
            os.close(fd)             # mapped where it is needed; the kernel frees the rest
    shared = {w: local.index(w) for w in local if answers.get(w)}
    if segment is not None and not shared:
        segment.close()
        segment = None
    return segment, shared


def accept(comm, ps_ranks, opt_id: int, poller) -> list[tuple[Segment, int] | None]:
    """On a worker: tell every ps rank this machine; map the segments offered.

    Returns, per ps rank, (its segment, this worker's index in it) or None.
    """
    tag = Tag.of(Tag.SHM, opt_id)
    mine = machine_id() if wants() else None
    for r in ps_ranks:
        comm.send(mine, dest=r, tag=tag)
    out = []
    for j, r in enumerate(ps_ranks):
        got = poller.wait_message(r, tag, lambda j=j: f"ps {j}'s shared-memory offer")
        mapped = None
        if got is not None:
            path, index = got
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                head = np.frombuffer(mm, np.int64, count=4)
                magic, data_nbytes, num_buckets, num_local = (int(x) for x in head)
                del head
                if magic == _MAGIC:
                    mapped = (Segment(mm, data_nbytes, num_buckets, num_local), index)
            except OSError:
                mapped = None
        if got is not None:
            comm.send(mapped is not None, dest=r, tag=tag)
        out.append(mapped)
    return out


class Publication:
    """One bucket of parameters published to one worker of the machine.

    Stands where an MPI send of the bucket would (``Start``, ``Test``): ``Start`` raises
    the worker's ``ready`` flag to a new number, ``Test`` tells whether the worker copied
    it (its ``ack`` flag caught up), after which the ps may change the bucket again.
    """

    __slots__ = ("ack", "k", "ready", "seq")

    def __init__(self, ready: np.ndarray, ack: np.ndarray, k: int):
        self.ready, self.ack, self.k = ready, ack, k
        self.seq = 0                     # a new segment's flags are zeros

    def Start(self) -> None:
        self.seq += 1
        self.ready[self.k] = self.seq

    def Test(self) -> bool:
        return int(self.ack[self.k]) == self.seq


class Nothing:
    """What a send the shared memory makes unnecessary stands for (the parameters' header)."""

    __slots__ = ()

    def Start(self) -> None:
        pass

    def Test(self) -> bool:
        return True
