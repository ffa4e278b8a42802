"""The shard server: one ps rank's slices of one optimizer; reduce, apply, send, answer."""
from __future__ import annotations

from collections import deque

import numpy as np
import torch
from mpi4py import MPI

from ..accumulate import ShardAccumulator
from ..errors import NonFiniteError, ProtocolError
from ..protocol.layouts import buckets_of, layouts_of, wire_layouts_of
from ..protocol.spec import JobSpec
from ..protocol.updates import Updates
from ..protocol.wire import (
    FLAG_ASSIGN,
    FLAG_RESEND,
    NOTICE_SKIPPED,
    NOTICE_WORDS,
    PARAM_HEADER_BYTES,
    Control,
    ControlField,
    GradField,
    GradHeader,
    Kind,
    NoticeField,
    Tag,
    entry_views,
    timing_view,
)
from ..runtime import lazydynamo, shm
from ..runtime.progress import Poller
from ..runtime.survival import Losses, improbe, settle
from . import snapshot
from .averages import MovingAverages
from .parameters import ShardParameters
from .rows import RowShards
from .sends import ParameterSends
from .slots import PushSlots, Slot
from .timings import StepTimings

__all__ = ["ShardServer", "strict_sync"]


def strict_sync(spec: JobSpec) -> bool:
    """Every step takes one gradient of every worker, all computed at that step: the
    decision is known before it is made, and a ps rank applies a step as soon as every
    worker's gradient is in (ps 0 still decides, and hands out the tokens)."""
    return (not spec.asynchronous and spec.num_tokens == 0
            and spec.replicas_to_aggregate == spec.num_workers)


class _Step:
    """A step being applied, bucket by bucket as the taken pushes' buckets arrive."""

    __slots__ = ("chosen", "next", "step", "taken", "workers")

    def __init__(self, step: int, chosen: list[Slot], workers, taken):
        self.step, self.chosen, self.workers, self.taken = step, chosen, list(workers), taken
        self.next = 0                   # the next bucket to reduce and apply


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

    It orders the step and answers the messages; the rest it hands on: the receive slots
    and assignments to ``slots`` (``PushSlots``), the parameters, their optimizer and a
    step's arithmetic to ``parameters`` (``ShardParameters``), the parameter sends to
    ``sends`` (``ParameterSends``), the table shards to ``rows`` (``RowShards``), and the
    figures each APPLIED notice reports to ``timings`` (``StepTimings``).
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
            lazydynamo.deterministic()
        self.layout = layout = layouts_of(spec)[ps_index]
        self.wire = wire_layouts_of(spec)[ps_index]
        self.buckets, self.wbuckets = buckets_of(spec, layout, self.wire)
        self.header = GradHeader(spec.hyper.width, len(layout.entries))
        self.control = Control(self.W, spec.hyper.width)
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.GRAD, Tag.DATA, Tag.FULL,
                                                           Tag.ASSIGN, Tag.PARAMS, Tag.CTL,
                                                           Tag.CTL_OBJ, Tag.INFO, Tag.INIT,
                                                           Tag.TABLE, Tag.SNAP)}
        self.rows = RowShards(spec, ps_index, worker_ranks, comm, poller, label)
        self.segment, self.shared = None, {}     # workers served through shared memory
        if shm.enabled(spec):
            self.segment, self.shared = shm.offer(comm, worker_ranks, spec.opt_id, ps_index,
                                                  layout.nbytes, len(self.buckets), poller,
                                                  label)
        self.updates = Updates()           # functions opt.update() registered
        self.acc = ShardAccumulator(spec.reduction, spec.global_step, spec.asynchronous)
        self.parameters = params = ShardParameters(spec, layout, self.wire, self.buckets,
                                                   self.wbuckets, self.segment, self.rows,
                                                   self.acc, self.header)
        self.optimizer = params.optimizer
        self.averages = MovingAverages(spec.ema_decay, spec.ema_num_updates, params.data,
                                       layout)
        self._hold()
        self.global_step = spec.global_step
        params.set_version(self.global_step)
        self.slots = PushSlots(comm, worker_ranks, self.tags, self.header, self.wire,
                               self.wbuckets, self.header.nbytes + layout.nbytes,
                               self.segment, self.shared, self.rows, losses, label)
        self.sends = ParameterSends(comm, worker_ranks, self.tags[Tag.PARAMS], params.send_buf,
                                    self.wbuckets, params.to_wire, self.segment, self.shared,
                                    poller, losses, self.lost)
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
        self.timings = StepTimings()        # on with the statistics log or the timeline

    def _hold(self) -> None:
        """Whether the applier steps whole (``ShardParameters.hold``): also while
        ``opt.update()`` functions run after each step."""
        self.parameters.hold(bool(self.updates.items))

    def receive_initial(self, chief_rank: int, piece: dict | None) -> None:
        """Take the chief's initial parameters (and an optimizer state it already had)."""
        req = self.comm.Irecv([self.parameters.param_buf[PARAM_HEADER_BYTES:], MPI.BYTE],
                              source=chief_rank, tag=self.tags[Tag.INIT])
        self.poller.wait_all([req], lambda: "the chief's initial parameters")
        self.rows.receive_initial(chief_rank)
        if piece is not None:
            self._load(piece)
        self.averages.load(None)
        self.parameters.to_wire_all()

    @property
    def done(self) -> bool:
        return self.shutdown and all(self.closed)

    # -- receiving ------------------------------------------------------------------------
    def poll(self, rare: bool = False) -> tuple[bool, list[tuple]]:
        """Receive what arrived: (anything arrived, notices for the coordinator on this rank).

        Assignments are looked for when a gradient waits for one, or with ``rare``.
        """
        notices: list[tuple] = []
        progressed = False
        status = MPI.Status()
        for w in range(self.W):
            slot = self.slots.arrived(w, status)
            if slot is not None:
                self._on_message(slot, status.Get_count(MPI.BYTE), notices)
                progressed = True
        self.slots.sweep()
        progressed |= self.slots.poll_assigns(status, rare)
        if self.rows.active:
            progressed |= self.rows.poll()
        if rare or self.rows.snaps:     # a checkpoint's snapshot is read while steps go on
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

    def _on_message(self, slot: Slot, nbytes: int, notices: list) -> None:
        fields = slot.fields
        kind, step, w = int(fields[GradField.KIND]), int(fields[GradField.STEP]), slot.worker
        if kind == Kind.CLOSE:
            self.closed[w] = True
            self.slots.release([slot])
            notices.append((Kind.CLOSED, w, step, timing_view(fields)))
            return
        if kind != Kind.GRAD or nbytes != self.header.nbytes:
            raise ProtocolError(f"{self.label}: worker {w} sent kind {kind} with {nbytes} "
                                f"bytes, expected a gradient header of {self.header.nbytes}")
        self.slots.post(w)
        self.timings.arrived(self.header.nbytes + self.wire.nbytes)
        if self.rows.active:
            self.rows.attach(slot)
        flags = int(fields[GradField.FLAGS])
        slot.resend = bool(flags & FLAG_RESEND)
        if flags & FLAG_ASSIGN:
            self.slots.expect_assign(slot)
        if self.notify:
            # views: the coordinator copies them before this worker's slot can be reused
            notices.append((Kind.PUSHED, w, step, flags, slot.words, slot.codes, slot.timing))
        if not self.acc.offer(w, step, slot):
            self.slots.release([slot])

    def lose(self, w: int) -> None:
        """Worker ``w`` died: nothing more comes from it, nothing more goes to it."""
        self.lost.add(w)
        self.closed[w] = True
        self.slots.lose(w)
        self.sends.lose(w)

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
        params = self.parameters
        self.comm.send((params.state(), self.averages.values(), params.groups(),
                        params.values(), self.global_step),
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
        tensors = {e.name: (p.detach(), None)
                   for e, p in zip(self.layout.entries, self.parameters.params)}
        tensors.update((u.unit, (u.param.detach(), n)) for n, u in enumerate(self.rows.units))
        self.updates.set(obj, tensors)
        self._hold()
        return True

    # -- applying -------------------------------------------------------------------------
    def _begin(self, step: int, chosen: list[Slot], workers, hyper, taken) -> None:
        """Start applying ``step``: writes first, then the step's hyper-parameters."""
        if step != self.global_step:
            raise ProtocolError(f"{self.label}: asked to apply step {step} at version "
                                f"{self.global_step}")
        self.timings.begin(step)
        self.current = _Step(step, chosen, workers, taken)
        if any(s.assign is not None for s in chosen):
            self.sends.wait_all()                    # they are the send buffer
            self.parameters.assign(chosen)
        if self.optimizer is not None:
            self.spec.hyper.decode(*hyper, self.optimizer.param_groups)
            self.parameters.applier.begin(np.bitwise_or.reduce([s.mask for s in chosen]))
        self.sends.wait_heads()
        self.parameters.set_version(step + 1)        # the version the parameters will have

    def _advance(self) -> np.ndarray | None:
        """Reduce, apply and send every bucket whose taken gradients are all in; the
        APPLIED notice once the step is done."""
        cur, params, timings = self.current, self.parameters, self.timings
        while cur.next < len(self.buckets):
            b = self.buckets[cur.next]
            if not all(self.slots.ready(s, b.index) for s in cur.chosen):
                return None
            t0 = timings.clock()
            self.sends.wait_bucket(b.index)      # last step's, of these values
            finite = stepped = False
            if b.buffers:
                params.update_buffers(cur.chosen)
            else:
                finite, stepped = params.reduce(b, cur.chosen)
            t1 = timings.reduced(t0)
            if not b.buffers and self.optimizer is not None:
                if self.spec.nonfinite == "raise" and not finite:
                    self._check_finite(cur, params.nonfinite([params.grad_views[b.index]],
                                                             b.first, b.stop))
                if not stepped:
                    params.applier.apply(b.index)
                timings.applied(t1)
            cur.next += 1
            self.moved = True
            if not params.applier.steps_whole:     # whole: in order, once stepped
                self.sends.bucket(b.index, cur.workers)
        return self._complete(cur)

    def _complete(self, cur: _Step) -> np.ndarray:
        """Every bucket is reduced: what comes after them, then the notice."""
        t0 = self.timings.clock()
        step, chosen, params = cur.step, cur.chosen, self.parameters
        finite = self.optimizer is None or self.spec.nonfinite != "skip" or \
            not params.nonfinite(params.grad_views, 0, len(params.params))  # "skip": whole
        if self.optimizer is not None:
            if finite:
                params.step_rest(chosen)
            params.applier.end()
        if finite:              # opt.update()'s functions (they make the applier step whole)
            self.updates.run(self.rows, step + 1)
        if params.applier.steps_whole:
            for b in self.buckets:
                self.sends.bucket(b.index, cur.workers)
        if finite:
            self.averages.update(step + 1)
        self.global_step = step + 1
        self.slots.release(self.acc.advance(step, cur.taken))
        applied_at = self.timings.clock()
        if self.rows.active:
            self.rows.send_changed(cur.workers, self.global_step)
        self._send_heads(cur.workers)
        notice = np.zeros(NOTICE_WORDS, np.int64)
        notice[NoticeField.KIND], notice[NoticeField.STEP] = Kind.APPLIED, step
        notice[NoticeField.SENDER] = self.ps_index
        notice[NoticeField.FLAGS] = 0 if finite else NOTICE_SKIPPED
        self.timings.report(step, t0, applied_at, notice, self.rows)
        self.current = None
        return notice

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

    def _send_params(self, workers) -> None:
        """The current parameters to ``workers``: every bucket, then the header."""
        if self.rows.active:
            self.rows.send_changed(workers, self.global_step)
        for b in self.buckets:
            self.sends.bucket(b.index, workers)
        self._send_heads(workers)

    def _send_heads(self, workers) -> None:
        """The header (version) to ``workers``: it ends what they get of a step."""
        self.sends.heads(workers)
        self.timings.sent(workers, self.lost, self.parameters.send_buf.nbytes)

    # -- optimizer state ------------------------------------------------------------------
    def _table_requests(self, status: MPI.Status) -> bool:
        """A worker reads or writes one shard of a table that lives here."""
        msg = improbe(self.comm, self.losses, MPI.ANY_SOURCE, self.tags[Tag.SNAP], status)
        if msg is not None:         # a checkpoint's snapshot: begun, read, or ended
            request = msg.recv()
            self.rows.settle()
            self.comm.send(snapshot.answer(self.rows, request, self.optimizer),
                           dest=status.Get_source(), tag=self.tags[Tag.SNAP])
            return True
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
        self.parameters.load(piece)
        self.averages.load(piece.get("averages"))
        self.rows.reset()
        self.global_step = piece["global_step"]
        self.slots.release(self.acc.reset(self.global_step))     # held for before the load
        self.parameters.set_version(self.global_step)

    def finish(self) -> None:
        """Wait for the last sends; cancel and free every persistent request."""
        self.sends.wait_all()
        self.rows.finish()
        reqs = self.slots.requests() + self.sends.requests()
        if self.ctl_req is not None:
            reqs.append(self.ctl_req)
        for req in reqs:
            settle([req], self.losses)
            req.Free()
