"""The shard server: one ps rank's slices of one optimizer; reduce, apply, send, answer."""
from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch
from mpi4py import MPI

from ..accumulate import ShardAccumulator
from ..errors import NonFiniteError, ProtocolError
from ..native import kernels
from ..observe import timeline
from ..protocol.layouts import buckets_of, conversions, layouts_of, wire_layouts_of
from ..protocol.spec import JobSpec
from ..protocol.updates import Updates
from ..protocol.wire import (
    FLAG_ASSIGN,
    FLAG_RESEND,
    NOTICE_SKIPPED,
    NOTICE_WORDS,
    PARAM_HEADER_BYTES,
    Bucket,
    Control,
    ControlField,
    GradField,
    GradHeader,
    Kind,
    NoticeField,
    ParamField,
    ShardLayout,
    Tag,
    entry_views,
    region_views,
    tensor_view,
    timing_view,
)
from ..runtime import shm
from ..runtime.progress import Poller
from ..runtime.survival import Losses, improbe
from .averages import MovingAverages
from .fused import Applier, only_params
from .rows import RowShards

__all__ = ["ShardServer", "strict_sync"]


def strict_sync(spec: JobSpec) -> bool:
    """Every step takes one gradient of every worker, all computed at that step: the
    decision is known before it is made, and a ps rank applies a step as soon as every
    worker's gradient is in (ps 0 still decides, and hands out the tokens)."""
    return (not spec.asynchronous and spec.num_tokens == 0
            and spec.replicas_to_aggregate == spec.num_workers)


class _Slot:
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
        self.views = _bucket_views(t, buckets)
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


def _graded_dtype(dtype) -> bool:
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


def _bucket_views(data: torch.Tensor, buckets: tuple[Bucket, ...]) -> list[torch.Tensor | None]:
    """Per bucket, its gradients' view into ``data`` (bytes laid out as the buckets say);
    None for the module buffers' bucket and integer ones (no gradients)."""
    return [None if b.buffers or not _graded_dtype(b.dtype)
            else tensor_view(data, 0, b.dtype, b.offset, b.nbytes) for b in buckets]


class _Step:
    """A step being applied, bucket by bucket as the taken pushes' buckets arrive."""

    __slots__ = ("apply_s", "chosen", "next", "reduce_s", "started_at", "step", "taken",
                 "workers")

    def __init__(self, step: int, chosen: list[_Slot], workers, taken, started_at: float):
        self.step, self.chosen, self.workers, self.taken = step, chosen, list(workers), taken
        self.next = 0                   # the next bucket to reduce and apply
        self.reduce_s = self.apply_s = 0.0
        self.started_at = started_at


class ShardServer:
    """One ps rank's part of one optimizer: its parameters, their optimizer and averages.

    Receives every worker's pushes (a header and its buckets, on persistent receives per
    worker), holds them by step, and works through the coordinator's control messages in
    order, each with its handler: DECIDE (reduce the taken gradients in worker order,
    apply, send the new parameters), REPLY, STATE, AVERAGES, LOAD, SHUTDOWN. A step is
    applied bucket by bucket: each bucket is reduced and stepped as soon as every taken
    push has it, and its parameters go back to the workers at once, so that receiving,
    applying and sending overlap. In strict sync (``strict_sync``) a step starts as soon
    as every worker's push of it is in, without waiting for ps 0's DECIDE. It never calls
    the coordinator: ``poll()`` returns what the coordinator must hear of (pushes and
    closes, on the coordinator's own rank) and ``progress()`` the APPLIED notices.
    """

    def __init__(self, spec: JobSpec, ps_index: int, worker_ranks: tuple[int, ...],
                 coordinator_rank: int, comm: MPI.Comm, poller: Poller, label: str,
                 with_hyper: bool, losses: Losses | None = None):
        self.spec = spec
        self.losses = losses
        self.lost: set[int] = set()        # workers found dead: absent from now on
        self.ps_index = ps_index
        self.worker_ranks = worker_ranks
        self.comm = comm
        self.poller = poller
        self.label = label
        self.W = spec.num_workers
        self.notify = with_hyper           # the coordinator lives on this rank
        self.eager = strict_sync(spec)
        if spec.deterministic:
            torch.use_deterministic_algorithms(True)
        self.layout = layout = layouts_of(spec)[ps_index]
        self.wire = wire_layouts_of(spec)[ps_index]
        self.buckets, self.wbuckets = buckets_of(spec, layout, self.wire)
        self.header = GradHeader(spec.hyper.width, len(layout.entries))
        self.control = Control(self.W, spec.hyper.width)
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.GRAD, Tag.DATA, Tag.FULL,
                                                           Tag.ASSIGN, Tag.PARAMS, Tag.CTL,
                                                           Tag.CTL_OBJ, Tag.INFO, Tag.INIT,
                                                           Tag.TABLE)}
        self.rows = RowShards(spec, ps_index, worker_ranks, comm, poller, label)
        self.segment, self.shared = None, {}     # workers served through shared memory
        if shm.enabled(spec):
            self.segment, self.shared = shm.offer(comm, worker_ranks, spec.opt_id, ps_index,
                                                  layout.nbytes, len(self.buckets), poller,
                                                  label)
        self.updates = Updates()           # functions opt.update() registered
        self._build_tensors(layout)
        self.acc = ShardAccumulator(spec.reduction, spec.global_step, spec.asynchronous)
        self.global_step = spec.global_step
        self._set_version()
        self.free: list[list[_Slot]] = [[] for _ in range(self.W)]
        self.posted: list[_Slot | None] = [None] * self.W
        self.retired: list[_Slot] = []      # released while buckets were still coming
        for w in range(self.W):
            self._post(w)
        self._build_sends()
        self.assigns: list[deque] = [deque() for _ in range(self.W)]   # arrived, unclaimed
        self.claims: list[deque] = [deque() for _ in range(self.W)]    # slots waiting
        self.queue: deque = deque()
        self.current: _Step | None = None
        self.moved = False                  # a bucket was applied since the loop last asked
        self.ctl_req = None
        if not self.notify:
            self.ctl_buf = np.zeros(self.control.words, np.int64)
            self.ctl_req = comm.Recv_init([self.ctl_buf, MPI.BYTE], source=coordinator_rank,
                                          tag=self.tags[Tag.CTL])
            self.ctl_req.Start()
        self.coordinator_rank = coordinator_rank
        self.handlers = {Kind.DECIDE: self._on_decide, Kind.REPLY: self._on_reply,
                         Kind.SHUTDOWN: self._on_shutdown, Kind.STATE: self._on_state,
                         Kind.AVERAGES: self._on_averages, Kind.LOAD: self._on_load,
                         Kind.UPDATE: self._on_update}
        self.closed = [False] * self.W
        self.shutdown = False
        # timed (statistics log or timeline on): what each APPLIED notice reports
        self.timed = False
        self.first_arrival = 0.0
        self.bytes_in = self.bytes_out = 0

    def _build_tensors(self, layout: ShardLayout) -> None:
        """The parameter buffer, its views and the optimizer; what is sent to the workers
        (``send_buf``: the parameter buffer itself unless ``wire_dtype``)."""
        self.param_buf = (np.zeros(PARAM_HEADER_BYTES + layout.nbytes, np.uint8)
                          if self.segment is None else self.segment.params)
        self.send_buf = self.param_buf if self.wire == layout else np.zeros(
            PARAM_HEADER_BYTES + self.wire.nbytes, np.uint8)
        self.param_fields = self.send_buf[:PARAM_HEADER_BYTES].view(np.int64)
        pt = torch.from_numpy(self.param_buf)
        self.to_wire = conversions(self.buckets, self.wbuckets, pt[PARAM_HEADER_BYTES:],
                                   torch.from_numpy(self.send_buf)[PARAM_HEADER_BYTES:],
                                   layout, self.wire, to_wire=True)
        self.data = pt[PARAM_HEADER_BYTES:]
        self.param_views = entry_views(pt, PARAM_HEADER_BYTES, layout.entries)
        self.params = [torch.nn.Parameter(v, requires_grad=v.dtype.is_floating_point)
                       for v in self.param_views]
        self.buffer_regions = region_views(pt, PARAM_HEADER_BYTES, layout.buffer_regions)
        self.grad_buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.grads = entry_views(self.grad_buf, 0, layout.entries)
        self.grad_views = _bucket_views(self.grad_buf, self.buckets)
        part_of = dict(zip(self.spec.names, self.spec.parts))
        by_param: dict[str, list[torch.Tensor]] = {}
        for e, p in zip(layout.entries, self.params):
            by_param.setdefault(part_of[e.name][0], []).append(p)
        by_param.update(self.rows.params_by_name())
        self.optimizer = self.spec.recipe.build(by_param)
        self.name_of = {id(p): e.name for e, p in zip(layout.entries, self.params)}
        self.name_of.update(self.rows.names())
        self.table_params = self._table_params()
        self.averages = MovingAverages(self.spec.ema_decay, self.spec.ema_num_updates,
                                       self.data, layout)
        regions = layout.regions
        places = []
        for e in layout.entries:
            r = next(k for k, (d, off, n) in enumerate(regions)   # (an empty one: n == 0)
                     if d == e.dtype and off <= e.offset <= off + n)
            size = e.dtype.itemsize
            a = (e.offset - regions[r][1]) // size
            places.append((r, a, a + e.nbytes // size))
        self.applier = Applier(
            self.optimizer, self.params, self.grads, places,
            region_views(pt, PARAM_HEADER_BYTES, regions),
            [v if _graded_dtype(v.dtype) else None
             for v in region_views(self.grad_buf, 0, regions)],
            [range(b.first, b.stop) for b in self.buckets])
        self._hold()

    def _hold(self) -> None:
        """Whether the applier steps whole, sending parameters only once all are stepped:
        with ``nonfinite="skip"`` (a step is skipped whole or applied whole) and while
        ``opt.update()`` functions run after each step (the workers get their results)."""
        hold = self.spec.nonfinite == "skip" or bool(self.updates.items)
        if hold != self.applier.hold:
            self.applier.hold = hold
            self.applier.sync()

    def _table_params(self) -> list[list[torch.Tensor]]:
        """Per param group, the table shards' parameters it holds here."""
        if self.optimizer is None or not self.rows.active:
            return []
        mine = set(self.rows.names())
        return [[p for p in g["params"] if id(p) in mine] for g in self.optimizer.param_groups]

    def _build_sends(self) -> None:
        """Per worker, a persistent send of each bucket's parameters, then the header (a
        worker of this machine copies them from shared memory: ``shm.Publication``)."""
        pb, tag = self.send_buf, self.tags[Tag.PARAMS]
        base = PARAM_HEADER_BYTES
        flags = {w: self.segment.flags(i) for w, i in self.shared.items()}
        self.bucket_sends = [
            [shm.Publication(*flags[w], b.index) if w in flags else
             self.comm.Send_init([pb[base + b.offset:base + b.offset + b.nbytes], MPI.BYTE],
                                 dest=r, tag=tag) for w, r in enumerate(self.worker_ranks)]
            for b in self.wbuckets]
        self.head_sends = [shm.Nothing() if w in flags else
                           self.comm.Send_init([pb[:base], MPI.BYTE], dest=r, tag=tag)
                           for w, r in enumerate(self.worker_ranks)]
        self.sends_active: dict[int, MPI.Request] = {}     # id -> a send in flight

    def receive_initial(self, chief_rank: int, piece: dict | None) -> None:
        """Take the chief's initial parameters (and an optimizer state it already had)."""
        req = self.comm.Irecv([self.param_buf[PARAM_HEADER_BYTES:], MPI.BYTE],
                              source=chief_rank, tag=self.tags[Tag.INIT])
        self.poller.wait_all([req], lambda: "the chief's initial parameters")
        self.rows.receive_initial(chief_rank)
        if piece is not None:
            self._load(piece)
        self.averages.load(None)
        for pairs in self.to_wire:
            for dst, src in pairs:
                dst.copy_(src)

    @property
    def done(self) -> bool:
        return self.shutdown and all(self.closed)

    # -- receiving ------------------------------------------------------------------------
    def _post(self, w: int) -> None:
        slot = self.free[w].pop() if self.free[w] else _Slot(
            self.comm, w, self.worker_ranks[w], self.tags, self.header, self.wire,
            self.wbuckets, self.segment.slot(self.shared[w]) if w in self.shared else None)
        slot.assign, slot.waiting = None, False
        slot.start()
        self.posted[w] = slot

    def _release(self, slots) -> None:
        for slot in slots:
            slot.assign = None
            if self.rows.active:
                self.rows.release(slot)
            if slot.complete:
                self.free[slot.worker].append(slot)
            else:
                self.retired.append(slot)     # free once its last bucket is in

    def _ready(self, slot: _Slot, k: int) -> bool:
        return slot.ready(k, self.comm, self.worker_ranks[slot.worker], self.tags[Tag.FULL],
                          self.header.nbytes)

    def poll(self, rare: bool = False) -> tuple[bool, list[tuple]]:
        """Receive what arrived: (anything arrived, notices for the coordinator on this rank).

        Assignments are looked for when a gradient waits for one, or with ``rare``.
        """
        notices: list[tuple] = []
        progressed = False
        status = MPI.Status()
        for w in range(self.W):
            slot = self.posted[w]
            if slot is not None and self._test(w, slot, status):
                self.posted[w] = None
                self._on_message(slot, status.Get_count(MPI.BYTE), notices)
                progressed = True
        if self.retired:
            done = [s for s in self.retired if s.complete]
            for slot in done:
                self.retired.remove(slot)
                self.free[slot.worker].append(slot)
        msg = None
        if rare or any(self.claims):
            msg = improbe(self.comm, self.losses, MPI.ANY_SOURCE, self.tags[Tag.ASSIGN], status)
        if msg is not None:
            self._on_assign(msg, status)
            progressed = True
        if self.rows.active:
            progressed |= self.rows.poll()
        if rare:
            progressed |= self._table_requests(status)
        if self.ctl_req is not None and self.ctl_req.Test():
            ctl = self.ctl_buf.copy()        # tiny; frees the buffer for the next one
            self.ctl_req.Start()
            obj = None
            if ctl[ControlField.HAS_OBJ]:
                obj = self.poller.wait_message(self.coordinator_rank, self.tags[Tag.CTL_OBJ],
                                               lambda: "a control payload from ps 0")
            self.queue.append((ctl, obj))
            progressed = True
        return progressed, notices

    def _test(self, w: int, slot: _Slot, status: MPI.Status) -> bool:
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

    def _on_message(self, slot: _Slot, nbytes: int, notices: list) -> None:
        fields = slot.fields
        kind, step, w = int(fields[GradField.KIND]), int(fields[GradField.STEP]), slot.worker
        if kind == Kind.CLOSE:
            self.closed[w] = True
            self._release([slot])
            notices.append((Kind.CLOSED, w, step, timing_view(fields)))
            return
        if kind != Kind.GRAD or nbytes != self.header.nbytes:
            raise ProtocolError(f"{self.label}: worker {w} sent kind {kind} with {nbytes} "
                                f"bytes, expected a gradient header of {self.header.nbytes}")
        self._post(w)
        if self.timed:
            self.bytes_in += self.header.nbytes + self.wire.nbytes
            if not self.first_arrival:
                self.first_arrival = time.perf_counter()
        if self.rows.active:
            self.rows.attach(slot)
        flags = int(fields[GradField.FLAGS])
        slot.resend = bool(flags & FLAG_RESEND)
        if flags & FLAG_ASSIGN:
            if self.assigns[w]:
                slot.assign = self.assigns[w].popleft()
            else:
                slot.waiting = True
                self.claims[w].append(slot)
        if self.notify:
            # views: the coordinator copies them before this worker's slot can be reused
            notices.append((Kind.PUSHED, w, step, flags, slot.words, slot.codes, slot.timing))
        if not self.acc.offer(w, step, slot):
            self._release([slot])

    def lose(self, w: int) -> None:
        """Worker ``w`` died: nothing more comes from it, nothing more goes to it."""
        self.lost.add(w)
        self.closed[w] = True
        slot, self.posted[w] = self.posted[w], None
        if slot is not None:
            self._settle([slot.head_req, *slot.data_reqs])
            self.free[w].append(slot)
        sends = [self.head_sends[w], *(b[w] for b in self.bucket_sends)]
        for req in sends:
            self.sends_active.pop(id(req), None)
        self._settle([r for r in sends if isinstance(r, MPI.Request)])

    def _settle(self, reqs) -> None:
        """Cancel (where pending) and complete requests; a dead worker's failure is noted."""
        for req in reqs:
            try:
                if not req.Test():
                    req.Cancel()
                    req.Wait()
            except MPI.Exception as exc:
                if self.losses is None or not self.losses.note(exc):
                    raise

    def _on_assign(self, msg, status: MPI.Status) -> None:
        """Parameters a worker wrote between steps: they go with its next gradient."""
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        msg.Recv([buf, MPI.BYTE])
        w = self.worker_ranks.index(status.Get_source())
        if buf.nbytes != self.header.nbytes + self.layout.nbytes:
            raise ProtocolError(f"{self.label}: worker {w} sent an assignment of {buf.nbytes} "
                                f"bytes, expected {self.header.nbytes + self.layout.nbytes}")
        if self.claims[w]:
            slot = self.claims[w].popleft()
            slot.assign, slot.waiting = buf, False
        else:
            self.assigns[w].append(buf)

    def enqueue(self, ctl: np.ndarray, obj=None) -> None:
        """A control message from the coordinator on this rank."""
        self.queue.append((ctl, obj))

    # -- the control queue ----------------------------------------------------------------
    def progress(self) -> list[np.ndarray]:
        """Apply what can be and handle control messages in order; return APPLIED notices.

        In strict sync a step starts without its DECIDE, once every worker's push is in
        and no earlier control message waits.
        """
        applied: list[np.ndarray] = []
        while True:
            if self.current is None and self.eager and not self.queue:
                self._start_eagerly()
            if self.current is not None:
                notice = self._advance()
                if notice is None:
                    return applied
                applied.append(notice)
                continue
            if not self.queue:
                return applied
            ctl, obj = self.queue[0]
            handler = self.handlers.get(int(ctl[ControlField.KIND]))
            if handler is None:
                raise ProtocolError(f"{self.label}: unknown control message "
                                    f"{int(ctl[ControlField.KIND])}")
            if not handler(ctl, obj):
                return applied
            self.queue.popleft()

    def _start_eagerly(self) -> None:
        step, taken = self.global_step, (1,) * self.W
        if not self.acc.ready(step, taken):
            return
        chosen = self.acc.chosen(step, taken)
        if any(s.waiting or s.waiting_rows for s in chosen):
            return
        self._begin(step, chosen, range(self.W), (chosen[0].words, chosen[0].codes), taken)

    def _on_decide(self, ctl, obj) -> bool:
        step, taken = int(ctl[ControlField.STEP]), self.control.taken(ctl)
        if step < self.global_step:
            return True                      # applied already, as soon as it could be
        if not self.acc.ready(step, taken):
            missing = [w for w in self.lost if taken[w]]
            if missing:
                raise RuntimeError(f"{self.label}: step {step} takes the gradients of workers "
                                   f"{sorted(missing)}, which died before all of it reached "
                                   f"this ps rank: the step cannot be applied alike everywhere")
            return False
        chosen = self.acc.chosen(step, taken)
        if any(s.waiting or s.waiting_rows for s in chosen):
            return False
        self._begin(step, chosen, self.control.workers(ctl), self.control.hyper(ctl), taken)
        return False                         # handled once the step is applied

    def _on_reply(self, ctl, obj) -> bool:
        self._send_params(self.control.workers(ctl))
        return True

    def _on_shutdown(self, ctl, obj) -> bool:
        self.shutdown = True
        return True

    def _on_state(self, ctl, obj) -> bool:
        groups = [] if self.optimizer is None else [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        values = {self.name_of[id(p)]: p.detach().clone() for p in self.params}
        self.comm.send((self._state(), self.averages.values(), groups, values, self.global_step),
                       dest=self.worker_ranks[int(ctl[ControlField.ARG])],
                       tag=self.tags[Tag.INFO])
        return True

    def _on_averages(self, ctl, obj) -> bool:
        self.comm.send(self.averages.values(),
                       dest=self.worker_ranks[int(ctl[ControlField.ARG])],
                       tag=self.tags[Tag.INFO])
        return True

    def _on_load(self, ctl, obj) -> bool:
        self._load(obj)
        self.updates.refresh()             # loaded rows: opt.update()'s functions see all
        return True

    def _on_update(self, ctl, obj) -> bool:
        """The functions of ``opt.update()`` for this rank's units (they replace any before)."""
        tensors = {e.name: (p.detach(), None) for e, p in zip(self.layout.entries, self.params)}
        tensors.update((u.unit, (u.param.detach(), n)) for n, u in enumerate(self.rows.units))
        self.updates.set(obj, tensors)
        self._hold()
        return True

    # -- applying -------------------------------------------------------------------------
    def _begin(self, step: int, chosen: list[_Slot], workers, hyper, taken) -> None:
        """Start applying ``step``: writes first, then the step's hyper-parameters."""
        if step != self.global_step:
            raise ProtocolError(f"{self.label}: asked to apply step {step} at version "
                                f"{self.global_step}")
        now = time.perf_counter() if self.timed else 0.0
        self.current = _Step(step, chosen, workers, taken, now)
        if any(s.assign is not None for s in chosen):
            self._wait_sends(list(self.sends_active.values()))   # they are the send buffer
            self._assign(chosen)
        if self.optimizer is not None:
            self.spec.hyper.decode(*hyper, self.optimizer.param_groups)
            self.applier.begin(np.bitwise_or.reduce([s.mask for s in chosen]))
        self._wait_sends(self.head_sends)
        self.param_fields[ParamField.STEP] = step + 1          # the version the parameters will have
        if self.timed:
            tl = timeline.current
            if tl is not None and self.first_arrival:
                tl.span("receive", self.first_arrival, now, step)

    def _advance(self) -> np.ndarray | None:
        """Reduce, apply and send every bucket whose taken gradients are all in; the
        APPLIED notice once the step is done."""
        cur = self.current
        timed = self.timed
        while cur.next < len(self.buckets):
            b = self.buckets[cur.next]
            if not all(self._ready(s, b.index) for s in cur.chosen):
                return None
            t0 = time.perf_counter() if timed else 0.0
            self._wait_sends(self.bucket_sends[b.index])   # last step's, of these values
            finite = stepped = False
            if b.buffers:
                self._update_buffers(cur.chosen)
            else:
                finite, stepped = self._reduce(b, cur.chosen)
            if timed:
                t1 = time.perf_counter()
                cur.reduce_s += t1 - t0
            if not b.buffers and self.optimizer is not None:
                if self.spec.nonfinite == "raise" and not finite:
                    self._check_finite(cur, self._nonfinite([self.grad_views[b.index]],
                                                             b.first, b.stop))
                if not stepped:
                    self.applier.apply(b.index)
                if timed:
                    cur.apply_s += time.perf_counter() - t1
            cur.next += 1
            self.moved = True
            if not self.applier.steps_whole:     # whole: in order, once stepped
                self._send_bucket(b.index, cur.workers)
        return self._complete(cur)

    def _send_bucket(self, k: int, workers) -> None:
        """Bucket ``k``'s parameters to ``workers`` (on the wire's dtypes first)."""
        if self.to_wire[k]:
            self._wait_sends(self.bucket_sends[k])
            for dst, src in self.to_wire[k]:
                dst.copy_(src)
        for w in workers:
            if w not in self.lost:
                self._start_send(self.bucket_sends[k][w])

    def _reduce(self, b: Bucket, chosen: list[_Slot]) -> tuple[bool, bool]:
        """Bucket ``b``'s taken gradients into the reduced ones: (whether that found every
        element finite, whether it stepped the bucket's parameters too). The compiled pass
        (a mean over a power of two, or a sum) checks finiteness, and for SGD, Adam, AdamW,
        Adagrad and RMSprop steps the parameters in it (``Applier.compiled_step``); with
        non-finite gradients and ``nonfinite="raise"`` the job ends with the error, as when
        a bucket before it was stepped already."""
        out = self.grad_views[b.index]
        if out is None or self.optimizer is None:
            return False, False
        grads = [s.views[b.index] for s in chosen]
        n = len(grads)
        mean = self.acc.reduction == "mean" and n > 1
        if kernels.available(out) and all(g.dtype == out.dtype for g in grads) and \
                (not mean or n & (n - 1) == 0):
            step = self.applier.compiled_step(b.index, out) if mean else None
            if step is not None:
                return step(grads), True
            return kernels.dense_mean(out, grads, mean), False
        self.acc.reduce([out], [[g] for g in grads], n)
        return False, False

    def _complete(self, cur: _Step) -> np.ndarray:
        """Every bucket is reduced: what comes after them, then the notice."""
        t0 = time.perf_counter() if self.timed else 0.0
        step, chosen = cur.step, cur.chosen
        finite = self.optimizer is None or self.spec.nonfinite != "skip" or \
            not self._nonfinite(self.grad_views, 0, len(self.params))   # "skip": whole
        if self.optimizer is not None:
            if finite:
                self._step_rest(chosen)
            self.applier.end()
        if finite:              # opt.update()'s functions (they make the applier step whole)
            self.updates.run(self.rows, step + 1)
        if self.applier.steps_whole:
            for b in self.buckets:
                self._send_bucket(b.index, cur.workers)
        if finite:
            self.averages.update(step + 1)
        self.global_step = step + 1
        self._release(self.acc.advance(step, cur.taken))
        applied_at = time.perf_counter() if self.timed else 0.0
        if self.rows.active:
            self.rows.send_changed(cur.workers, self.global_step)
        self._send_heads(cur.workers)
        if self.timed:
            cur.apply_s += applied_at - t0
        notice = np.zeros(NOTICE_WORDS, np.int64)
        notice[NoticeField.KIND], notice[NoticeField.STEP] = Kind.APPLIED, step
        notice[NoticeField.SENDER] = self.ps_index
        notice[NoticeField.FLAGS] = 0 if finite else NOTICE_SKIPPED
        if self.timed:
            self._report(cur, applied_at, notice)
        self.current = None
        return notice

    def _report(self, cur: _Step, applied_at: float, notice: np.ndarray) -> None:
        """The step's figures into its APPLIED notice, and its events onto the timeline.

        ``reduce`` and ``apply`` (the notice's figures) are the time spent reducing and
        stepping the buckets; the timeline's ``receive`` lasts from the first gradient that
        arrived since the last step to the step's start, ``reduce`` from there to the last
        bucket reduced (buckets still arriving included), ``apply`` to the last one applied
        and ``send`` until every parameter send has been started.
        """
        sent_at = time.perf_counter()
        notice[NoticeField.APPLY_US] = int(cur.apply_s * 1e6)
        notice[NoticeField.REDUCE_US] = int(cur.reduce_s * 1e6)
        notice[NoticeField.BYTES_IN] = self.bytes_in + self.rows.bytes_in
        notice[NoticeField.BYTES_OUT] = self.bytes_out + self.rows.bytes_out
        self.bytes_in = self.bytes_out = self.rows.bytes_in = self.rows.bytes_out = 0
        tl = timeline.current
        if tl is not None:
            start, step = cur.started_at, cur.step
            reduced = max(start, applied_at - cur.apply_s)
            tl.span("reduce", start, reduced, step)
            tl.span("apply", reduced, applied_at, step)
            tl.span("send", applied_at, sent_at, step)
        self.first_arrival = 0.0

    def _step_rest(self, chosen: list[_Slot]) -> None:
        """What the buckets did not step: the table shards, and every parameter where the
        applier steps whole."""
        if self.rows.active:
            self.rows.set_grads(chosen, self.optimizer)
        if self.applier.steps_whole:
            self.optimizer.step()
        elif self.rows.active:
            with only_params(self.optimizer, self.table_params):
                self.optimizer.step()
        if self.rows.active:
            self.rows.apply_rows(self.optimizer)

    def _nonfinite(self, views, first: int, stop: int) -> list[int]:
        """Parameters ``[first, stop)`` whose reduced gradient holds NaN or Inf: one sum of
        each of ``views`` (their reduced gradients) first, as NaN and Inf stay in a sum;
        only when one is not finite, parameter by parameter."""
        if all(v is None or torch.isfinite(v.sum()) for v in views):
            return []
        present = self.applier.present
        return [i for i in range(first, stop) if present[i] and self.grads[i] is not None
                and _graded_dtype(self.grads[i].dtype) and not torch.isfinite(
                    self.grads[i]).all()]

    def _check_finite(self, cur: _Step, bad: list[int]) -> None:
        """``nonfinite="raise"``: NonFiniteError naming the first such parameter and the
        workers whose gradient of it was not finite; the step is not applied."""
        if not bad:
            return
        entry = self.layout.entries[bad[0]]
        name = dict(zip(self.spec.names, self.spec.parts))[entry.name][0]
        views = [(s.worker, entry_views(s.data, 0, self.wire.entries)[bad[0]])
                 for s in cur.chosen]
        workers = [w for w, v in views if v.dtype.is_floating_point and not
                   torch.isfinite(v).all()]
        ranks = [self.worker_ranks[w] for w in workers]
        raise NonFiniteError(
            f"{self.label}: the gradient of parameter {name!r} for global step {cur.step} "
            f"holds NaN or Inf, from workers {workers} (ranks {ranks}); the step is not "
            f"applied (nonfinite='raise'; nonfinite='skip' would skip such steps)")

    def _start_send(self, req: MPI.Request) -> None:
        if id(req) in self.sends_active:
            self._wait_sends([req])
        req.Start()
        self.sends_active[id(req)] = req

    def _wait_sends(self, reqs) -> None:
        """The sends among ``reqs`` still in flight are done (their buffer may change)."""
        active = [r for r in reqs if id(r) in self.sends_active]
        if not active:
            return
        mpi = [r for r in active if isinstance(r, MPI.Request)]
        if self.losses is None:
            if mpi:
                self.poller.wait_all(mpi, lambda: "parameter sends to workers")
        else:
            for req in mpi:         # one by one: a send to a worker that died fails
                try:
                    self.poller.wait_all([req], lambda: "parameter sends to workers")
                except MPI.Exception as exc:
                    if not self.losses.note(exc):
                        raise
        if len(mpi) < len(active):
            shared = [r for r in active if not isinstance(r, MPI.Request)]
            self.poller.wait_until(lambda: all(r.Test() for r in shared),
                                   lambda: "workers copying parameters from shared memory")
        for r in active:
            del self.sends_active[id(r)]

    def _send_params(self, workers) -> None:
        """The current parameters to ``workers``: every bucket, then the header."""
        if self.rows.active:
            self.rows.send_changed(workers, self.global_step)
        for b in self.buckets:
            self._send_bucket(b.index, workers)
        self._send_heads(workers)

    def _send_heads(self, workers) -> None:
        """The header (version) to ``workers``: it ends what they get of a step."""
        for w in workers:
            if w not in self.lost:
                self._start_send(self.head_sends[w])
        if self.timed:
            self.bytes_out += len(set(workers) - self.lost) * self.send_buf.nbytes

    def _assign(self, chosen: list[_Slot]) -> None:
        """Each written parameter takes the value of the lowest-index worker that wrote it."""
        done = set()
        for slot in chosen:                 # worker order, then arrival
            if slot.assign is None:
                continue
            _, _, _, mask = self.header.views(slot.assign)
            written = entry_views(torch.from_numpy(slot.assign), self.header.nbytes,
                                  self.layout.entries)
            for i in np.flatnonzero(mask):
                if i not in done:
                    self.param_views[i].copy_(written[i])
                    done.add(i)

    def _update_buffers(self, chosen: list[_Slot]) -> None:
        """Module buffers: the lowest-index worker's values, or their mean ("mean")."""
        mean = self.spec.buffer_mode == "mean" and len(chosen) > 1
        for r, out in enumerate(self.buffer_regions):
            if mean and out.dtype.is_floating_point:
                self.acc.reduce([out], [[s.buffers[r]] for s in chosen], len(chosen),
                                reduction="mean")
            else:
                out.copy_(chosen[0].buffers[r])

    def _set_version(self) -> None:
        self.param_fields[ParamField.KIND] = Kind.PARAMS
        self.param_fields[ParamField.STEP] = self.global_step

    # -- optimizer state ------------------------------------------------------------------
    def _state(self) -> dict:
        """This shard's optimizer state, keyed by unit name (tables on the ps: not here)."""
        if self.optimizer is None:
            return {}
        resident = self.rows.resident_units()
        return {self.name_of[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v)
                                      for k, v in s.items()}
                for p, s in self.optimizer.state.items() if self.name_of[id(p)] not in resident}

    def _table_requests(self, status: MPI.Status) -> bool:
        """A worker reads or writes one shard of a table that lives here."""
        msg = improbe(self.comm, self.losses, MPI.ANY_SOURCE, self.tags[Tag.TABLE], status)
        if msg is None:
            return False
        request = msg.recv()
        self.rows.on_table_request(request, status.Get_source(), self.optimizer)
        if request[0] not in ("read", "hash_stats"):    # rows written: as after a load
            self.updates.refresh()
        return True

    def _load(self, piece: dict) -> None:
        """Load optimizer state for this shard's parameters (``{name: state}``)."""
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            order = [self.name_of[id(p)] for g in self.optimizer.param_groups
                     for p in g["params"]]
            index = {name: i for i, name in enumerate(order)}
            resident = {index[n] for n in self.rows.resident_units()}
            kept = {i: s for i, s in sd["state"].items() if i in resident}
            sd["state"] = {index[n]: s for n, s in piece["state"].items()}
            sd["state"].update(kept)
            for group, saved in zip(sd["param_groups"], piece["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            self.optimizer.load_state_dict(sd)
            self.applier.sync()
        self.averages.load(piece.get("averages"))
        self.rows.reset()
        self.global_step = piece["global_step"]
        self._release(self.acc.reset(self.global_step))     # held for before the load
        self._set_version()

    def finish(self) -> None:
        """Wait for the last sends; cancel and free every persistent request."""
        self._wait_sends(list(self.sends_active.values()))
        self.rows.finish()
        slots = [s for s in self.posted if s is not None] + self.retired + [
            s for f in self.free for s in f]
        reqs = [r for s in slots for r in [s.head_req, *s.data_reqs]]
        reqs += [r for sends in self.bucket_sends for r in sends if isinstance(r, MPI.Request)]
        reqs += [r for r in self.head_sends if isinstance(r, MPI.Request)]
        if self.ctl_req is not None:
            reqs.append(self.ctl_req)
        for req in reqs:
            self._settle([req])
            req.Free()
