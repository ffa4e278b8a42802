"""A ps rank's receive slots: per worker, the buffers its pushes land in and their requests."""
from __future__ import annotations

from collections import deque

import numpy as np
import torch
from mpi4py import MPI

from ..errors import ProtocolError
from ..protocol.wire import (
    Bucket,
    GradHeader,
    ShardLayout,
    Tag,
    region_views,
    tensor_view,
    timing_view,
)
from ..runtime.survival import Losses, improbe, settle

__all__ = ["PushSlots", "Slot", "bucket_views", "graded_dtype"]


class Slot:
    """A receive buffer for one worker's push, with its persistent requests.

    The push comes as a header on ``Tag.GRAD`` and its buckets, in order, on ``Tag.DATA``;
    with ``FLAG_RESEND`` the whole gradient region follows once more on ``Tag.FULL``.
    """

    __slots__ = ("assign", "buf", "buffers", "codes", "data", "data_reqs", "done", "fields",
                 "full_req", "head_req", "mask", "resend", "rows", "timing", "views",
                 "waiting", "waiting_rows", "words", "worker")

    def __init__(self, comm, worker: int, rank: int, tags: dict, header: GradHeader,
                 layout: ShardLayout, buckets: tuple[Bucket, ...],
                 shared: np.ndarray | None = None):
        # ``layout`` and ``buckets``: on the wire (``wire_dtype`` may make them smaller);
        # ``shared``: the worker's slot of shared memory, where its gradients are
        self.worker = worker
        base = header.nbytes
        self.buf = np.zeros(base + (layout.nbytes if shared is None else 0), np.uint8)
        data = self.buf[base:] if shared is None else shared
        self.head_req = comm.Recv_init([self.buf[:base], MPI.BYTE], source=rank,
                                       tag=tags[Tag.GRAD])
        self.data_reqs = [] if shared is not None else [
            comm.Recv_init([data[b.offset:b.offset + b.nbytes], MPI.BYTE], source=rank,
                           tag=tags[Tag.DATA]) for b in buckets]
        self.fields, self.words, self.codes, self.mask = header.views(self.buf)
        self.timing = timing_view(self.fields)    # the worker's previous step, if reported
        t = self.data = torch.from_numpy(data)        # the data region, here or shared
        self.views = bucket_views(t, buckets)
        self.buffers = region_views(t, 0, layout.buffer_regions)
        self.done = 0            # buckets received, in order
        self.resend = False      # the whole region comes again (Tag.FULL)
        self.full_req = None
        self.assign = None       # the ASSIGN message that goes with this gradient
        self.waiting = False     # its ASSIGN message has not arrived yet
        self.rows = None         # its table rows: per shard here, (local ids, gradient rows)
        self.waiting_rows = False

    def start(self) -> None:
        self.done, self.resend, self.full_req = 0, False, None
        self.head_req.Start()
        if self.data_reqs:
            MPI.Prequest.Startall(self.data_reqs)

    def ready(self, k: int, comm, rank: int, tag: int, base: int) -> bool:
        """Whether bucket ``k`` of this push is in (tests the receives it waits for)."""
        if not self.data_reqs:         # shared memory: in place once the header came
            return True
        if not self.resend:
            return self._drain() > k
        if self._drain() < len(self.data_reqs):
            return False
        if self.full_req is None:      # every bucket is in: the region again, over them
            self.full_req = comm.Irecv([self.buf[base:], MPI.BYTE], source=rank, tag=tag)
        if not self.full_req.Test():
            return False
        self.resend, self.full_req = False, None
        return True

    @property
    def complete(self) -> bool:
        """Every receive of this push is done: the buffer may be posted again."""
        return self._drain() == len(self.data_reqs) and self.full_req is None and \
            not self.resend

    def _drain(self) -> int:
        """How many buckets are in, in order (tests the receives of the next ones)."""
        reqs = self.data_reqs
        while self.done < len(reqs) and self._arrived(reqs[self.done]):
            self.done += 1
        return self.done

    def _arrived(self, req: MPI.Request) -> bool:
        """Whether the next bucket is in; one larger than the bucket is a ProtocolError."""
        try:
            return req.Test()
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                raise               # a dead worker's failure: the caller's to note
            raise ProtocolError(f"worker {self.worker} sent bucket {self.done} of a push in a "
                                f"message larger than the bucket; every rank must run the same "
                                f"mpisync, and nothing else may use its communicator") from None


def graded_dtype(dtype) -> bool:
    """Whether ``dtype`` (None: no dtype) has gradients: floating point or complex."""
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


def bucket_views(data: torch.Tensor, buckets: tuple[Bucket, ...]) -> list[torch.Tensor | None]:
    """Per bucket, its gradients' view into ``data`` (bytes laid out as the buckets say);
    None for the module buffers' bucket and integer ones (no gradients)."""
    return [None if b.buffers or not graded_dtype(b.dtype)
            else tensor_view(data, 0, b.dtype, b.offset, b.nbytes) for b in buckets]


class PushSlots:
    """Every worker's receive slots: the one posted for its next push, the free ones, and
    the retired ones (released while buckets were still coming); and the ASSIGN messages
    (parameters a worker wrote between steps), matched to the pushes they go with.

    A slot is taken off when its header arrives (``arrived``), held while the step that
    takes it is applied, and released back (``release``); a new one is posted at once.
    """

    def __init__(self, comm: MPI.Comm, worker_ranks: tuple[int, ...], tags: dict,
                 header: GradHeader, wire: ShardLayout, wbuckets: tuple[Bucket, ...],
                 assign_nbytes: int, segment, shared: dict, rows, losses: Losses | None,
                 label: str):
        # ``segment``, ``shared``: the shared memory and the workers served through it;
        # ``rows``: the table shards (a released push's rows go back to them)
        self.comm, self.worker_ranks, self.tags = comm, worker_ranks, tags
        self.header, self.wire, self.wbuckets = header, wire, wbuckets
        self.assign_nbytes = assign_nbytes
        self.segment, self.shared, self.rows = segment, shared, rows
        self.losses, self.label = losses, label
        W = len(worker_ranks)
        self.free: list[list[Slot]] = [[] for _ in range(W)]
        self.posted: list[Slot | None] = [None] * W
        self.retired: list[Slot] = []      # released while buckets were still coming
        self.assigns: list[deque] = [deque() for _ in range(W)]   # arrived, unclaimed
        self.claims: list[deque] = [deque() for _ in range(W)]    # slots waiting
        for w in range(W):
            self.post(w)

    def post(self, w: int) -> None:
        """A slot for worker ``w``'s next push: a free one, or a new one."""
        slot = self.free[w].pop() if self.free[w] else Slot(
            self.comm, w, self.worker_ranks[w], self.tags, self.header, self.wire,
            self.wbuckets, self.segment.slot(self.shared[w]) if w in self.shared else None)
        slot.assign, slot.waiting = None, False
        slot.start()
        self.posted[w] = slot

    def release(self, slots) -> None:
        """``slots`` are done with: free, or retired until their last bucket is in."""
        for slot in slots:
            slot.assign = None
            if self.rows.active:
                self.rows.release(slot)
            if slot.complete:
                self.free[slot.worker].append(slot)
            else:
                self.retired.append(slot)     # free once its last bucket is in

    def ready(self, slot: Slot, k: int) -> bool:
        """Whether bucket ``k`` of the push in ``slot`` is in."""
        return slot.ready(k, self.comm, self.worker_ranks[slot.worker], self.tags[Tag.FULL],
                          self.header.nbytes)

    def arrived(self, w: int, status: MPI.Status) -> Slot | None:
        """Worker ``w``'s posted slot once its message arrived (``status`` says how large),
        taken off; else None."""
        slot = self.posted[w]
        if slot is None or not self._test(w, slot, status):
            return None
        self.posted[w] = None
        return slot

    def _test(self, w: int, slot: Slot, status: MPI.Status) -> bool:
        """Whether worker ``w``'s message arrived; one larger than a gradient is refused."""
        try:
            return slot.head_req.Test(status)
        except MPI.Exception as exc:
            if self.losses is not None and self.losses.note(exc):
                self.posted[w] = None          # failed: never test it again
                self.free[w].append(slot)
                return False
            what = ("larger than" if exc.Get_error_class() == MPI.ERR_TRUNCATE else
                    f"that MPI could not receive ({exc.Get_error_string().splitlines()[0]}) "
                    f"as")
            raise ProtocolError(f"{self.label}: worker {w} sent a message {what} a gradient "
                                f"header of {self.header.nbytes} bytes; every rank must run the "
                                f"same mpisync, and nothing else may use its communicator") \
                from None

    def sweep(self) -> None:
        """Retired slots whose last bucket is in are free again."""
        if self.retired:
            done = [s for s in self.retired if s.complete]
            for slot in done:
                self.retired.remove(slot)
                self.free[slot.worker].append(slot)

    def expect_assign(self, slot: Slot) -> None:
        """The push in ``slot`` comes with an ASSIGN message: it takes the one that arrived
        first, or waits for it."""
        w = slot.worker
        if self.assigns[w]:
            slot.assign = self.assigns[w].popleft()
        else:
            slot.waiting = True
            self.claims[w].append(slot)

    def poll_assigns(self, status: MPI.Status, rare: bool) -> bool:
        """Receive an ASSIGN message, looked for when a push waits for one, or with
        ``rare``; whether one came."""
        msg = None
        if rare or any(self.claims):
            msg = improbe(self.comm, self.losses, MPI.ANY_SOURCE, self.tags[Tag.ASSIGN], status)
        if msg is None:
            return False
        self._on_assign(msg, status)
        return True

    def _on_assign(self, msg, status: MPI.Status) -> None:
        """Parameters a worker wrote between steps: they go with its next gradient."""
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        msg.Recv([buf, MPI.BYTE])
        w = self.worker_ranks.index(status.Get_source())
        if buf.nbytes != self.assign_nbytes:
            raise ProtocolError(f"{self.label}: worker {w} sent an assignment of {buf.nbytes} "
                                f"bytes, expected {self.assign_nbytes}")
        if self.claims[w]:
            slot = self.claims[w].popleft()
            slot.assign, slot.waiting = buf, False
        else:
            self.assigns[w].append(buf)

    def lose(self, w: int) -> None:
        """Worker ``w`` died: its posted receives are cancelled."""
        slot, self.posted[w] = self.posted[w], None
        if slot is not None:
            settle([slot.head_req, *slot.data_reqs], self.losses)
            self.free[w].append(slot)

    def requests(self) -> list[MPI.Prequest]:
        """Every slot's persistent requests (to free them at the end)."""
        slots = [s for s in self.posted if s is not None] + self.retired + [
            s for f in self.free for s in f]
        return [r for s in slots for r in [s.head_req, *s.data_reqs]]
