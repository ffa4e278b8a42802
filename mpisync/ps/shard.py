"""The shard server: one ps rank's slices of one optimizer; reduce, apply, send, answer."""
from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch
from mpi4py import MPI

from .. import timeline
from ..accumulate import ShardAccumulator
from ..errors import ProtocolError
from ..progress import Poller
from ..spec import JobSpec
from ..wire import (
    FLAG_ASSIGN,
    NOTICE_WORDS,
    PARAM_HEADER_BYTES,
    Control,
    GradHeader,
    Kind,
    ShardLayout,
    Tag,
    build_layouts,
    entry_views,
    region_views,
    timing_view,
)
from .averages import MovingAverages
from .rows import RowShards

__all__ = ["ShardServer", "layouts_of"]


def layouts_of(spec: JobSpec) -> list[ShardLayout]:
    """Every ps rank's layout for ``spec`` (the same on every rank)."""
    return build_layouts(list(spec.names), list(spec.shapes), list(spec.dtypes), spec.owners,
                         spec.num_ps, spec.buffers)


def _graded(regions):
    """The regions whose tensors can have gradients (integer parameters never do)."""
    return [r for r in regions if r[0].is_floating_point or r[0].is_complex]


class _Slot:
    """A receive buffer for one worker's gradients, with its persistent request."""

    __slots__ = ("assign", "buf", "buffers", "codes", "fields", "mask", "regions", "req", "rows",
                 "timing", "waiting", "waiting_rows", "words", "worker")

    def __init__(self, comm, worker: int, rank: int, tag: int, header: GradHeader,
                 layout: ShardLayout):
        self.worker = worker
        self.buf = np.zeros(header.nbytes + layout.nbytes, np.uint8)
        self.req = comm.Recv_init([self.buf, MPI.BYTE], source=rank, tag=tag)
        self.fields, self.words, self.codes, self.mask = header.views(self.buf)
        self.timing = timing_view(self.fields)    # the worker's previous step, if reported
        t = torch.from_numpy(self.buf)
        self.regions = region_views(t, header.nbytes, _graded(layout.regions))
        self.buffers = region_views(t, header.nbytes, layout.buffer_regions)
        self.assign = None       # the ASSIGN message that goes with this gradient
        self.waiting = False     # its ASSIGN message has not arrived yet
        self.rows = None         # its table rows: per shard here, (local ids, gradient rows)
        self.waiting_rows = False


class ShardServer:
    """One ps rank's part of one optimizer: its parameters, their optimizer and averages.

    Receives every worker's gradients (a persistent receive per worker), holds them by
    step, and works through the coordinator's control messages in order, each with its
    handler: DECIDE (reduce the taken gradients in worker order, apply, send the new
    parameters), REPLY, STATE, AVERAGES, LOAD, SHUTDOWN. It never calls the
    coordinator: ``poll()`` returns what the coordinator must hear of (pushes and closes,
    on the coordinator's own rank) and ``progress()`` the APPLIED notices.
    """

    def __init__(self, spec: JobSpec, ps_index: int, worker_ranks: tuple[int, ...],
                 coordinator_rank: int, comm: MPI.Comm, poller: Poller, label: str,
                 with_hyper: bool):
        self.spec = spec
        self.ps_index = ps_index
        self.worker_ranks = worker_ranks
        self.comm = comm
        self.poller = poller
        self.label = label
        self.W = spec.num_workers
        self.notify = with_hyper           # the coordinator lives on this rank
        if spec.deterministic:
            torch.use_deterministic_algorithms(True)
        self.layout = layout = layouts_of(spec)[ps_index]
        self.header = GradHeader(spec.hyper.width if with_hyper else 0, len(layout.entries))
        self.msg_nbytes = self.header.nbytes + layout.nbytes
        self.control = Control(self.W, spec.hyper.width)
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.GRAD, Tag.ASSIGN, Tag.PARAMS,
                                                           Tag.CTL, Tag.CTL_OBJ, Tag.INFO,
                                                           Tag.INIT, Tag.TABLE)}
        self.rows = RowShards(spec, ps_index, worker_ranks, comm, poller, label)
        self._build_tensors(layout)
        self.acc = ShardAccumulator(spec.reduction, spec.global_step, spec.asynchronous)
        self.global_step = spec.global_step
        self._set_version()
        self.free: list[list[_Slot]] = [[] for _ in range(self.W)]
        self.posted: list[_Slot | None] = [None] * self.W
        for w in range(self.W):
            self._post(w)
        self.param_sends = [comm.Send_init([self.param_buf, MPI.BYTE], dest=r,
                                           tag=self.tags[Tag.PARAMS]) for r in worker_ranks]
        self.sends_active: list[MPI.Request] = []
        self.assigns: list[deque] = [deque() for _ in range(self.W)]   # arrived, unclaimed
        self.claims: list[deque] = [deque() for _ in range(self.W)]    # slots waiting
        self.queue: deque = deque()
        self.ctl_req = None
        if not self.notify:
            self.ctl_buf = np.zeros(self.control.words, np.int64)
            self.ctl_req = comm.Recv_init([self.ctl_buf, MPI.BYTE], source=coordinator_rank,
                                          tag=self.tags[Tag.CTL])
            self.ctl_req.Start()
        self.coordinator_rank = coordinator_rank
        self.handlers = {Kind.DECIDE: self._on_decide, Kind.REPLY: self._on_reply,
                         Kind.SHUTDOWN: self._on_shutdown, Kind.STATE: self._on_state,
                         Kind.AVERAGES: self._on_averages, Kind.LOAD: self._on_load}
        self.closed = [False] * self.W
        self.shutdown = False
        # timed (statistics log or timeline on): what each APPLIED notice reports
        self.timed = False
        self.first_arrival = self.reduced_at = 0.0
        self.bytes_in = self.bytes_out = 0

    def _build_tensors(self, layout: ShardLayout) -> None:
        """The parameter buffer (sent to the workers as is), its views and the optimizer."""
        self.param_buf = np.zeros(PARAM_HEADER_BYTES + layout.nbytes, np.uint8)
        self.param_fields = self.param_buf[:PARAM_HEADER_BYTES].view(np.int64)
        pt = torch.from_numpy(self.param_buf)
        self.data = pt[PARAM_HEADER_BYTES:]
        self.param_views = entry_views(pt, PARAM_HEADER_BYTES, layout.entries)
        self.params = [torch.nn.Parameter(v, requires_grad=v.dtype.is_floating_point)
                       for v in self.param_views]
        self.buffer_regions = region_views(pt, PARAM_HEADER_BYTES, layout.buffer_regions)
        self.grad_buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.grads = entry_views(self.grad_buf, 0, layout.entries)
        self.grad_regions = region_views(self.grad_buf, 0, _graded(layout.regions))
        part_of = dict(zip(self.spec.names, self.spec.parts))
        by_param: dict[str, list[torch.Tensor]] = {}
        for e, p in zip(layout.entries, self.params):
            by_param.setdefault(part_of[e.name][0], []).append(p)
        by_param.update(self.rows.params_by_name())
        self.optimizer = self.spec.recipe.build(by_param)
        self.name_of = {id(p): e.name for e, p in zip(layout.entries, self.params)}
        self.name_of.update(self.rows.names())
        self.averages = MovingAverages(self.spec.ema_decay, self.spec.ema_num_updates,
                                       self.data, layout)

    def receive_initial(self, chief_rank: int, piece: dict | None) -> None:
        """Take the chief's initial parameters (and an optimizer state it already had)."""
        req = self.comm.Irecv([self.param_buf[PARAM_HEADER_BYTES:], MPI.BYTE],
                              source=chief_rank, tag=self.tags[Tag.INIT])
        self.poller.wait_all([req], lambda: "the chief's initial parameters")
        self.rows.receive_initial(chief_rank)
        if piece is not None:
            self._load(piece)
        self.averages.load(None)

    @property
    def done(self) -> bool:
        return self.shutdown and all(self.closed)

    # -- receiving ------------------------------------------------------------------------
    def _post(self, w: int) -> None:
        slot = self.free[w].pop() if self.free[w] else _Slot(
            self.comm, w, self.worker_ranks[w], self.tags[Tag.GRAD], self.header, self.layout)
        slot.assign, slot.waiting = None, False
        slot.req.Start()
        self.posted[w] = slot

    def _release(self, slots) -> None:
        for slot in slots:
            slot.assign = None
            if self.rows.active:
                self.rows.release(slot)
            self.free[slot.worker].append(slot)

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
        msg = None
        if rare or any(self.claims):
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=self.tags[Tag.ASSIGN],
                                    status=status)
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
            if ctl[3]:
                obj = self.poller.wait_message(self.coordinator_rank, self.tags[Tag.CTL_OBJ],
                                               lambda: "a control payload from ps 0")
            self.queue.append((ctl, obj))
            progressed = True
        return progressed, notices

    def _test(self, w: int, slot: _Slot, status: MPI.Status) -> bool:
        """Whether worker ``w``'s message arrived; one larger than a gradient is refused."""
        try:
            return slot.req.Test(status)
        except MPI.Exception as exc:
            what = ("larger than" if exc.Get_error_class() == MPI.ERR_TRUNCATE else
                    f"that MPI could not receive ({exc.Get_error_string().splitlines()[0]}) "
                    f"as")
            raise ProtocolError(f"{self.label}: worker {w} sent a message {what} a gradient "
                                f"message of {self.msg_nbytes} bytes; every rank must run the "
                                f"same mpisync, and nothing else may use its communicator") \
                from None

    def _on_message(self, slot: _Slot, nbytes: int, notices: list) -> None:
        kind, step, w = int(slot.fields[0]), int(slot.fields[1]), slot.worker
        if kind == Kind.CLOSE:
            self.closed[w] = True
            self._release([slot])
            notices.append((Kind.CLOSED, w, step, timing_view(slot.fields)))
            return
        if kind != Kind.GRAD or nbytes != self.msg_nbytes:
            raise ProtocolError(f"{self.label}: worker {w} sent kind {kind} with {nbytes} "
                                f"bytes, expected a gradient of {self.msg_nbytes}")
        self._post(w)
        if self.timed:
            self.bytes_in += nbytes
            if not self.first_arrival:
                self.first_arrival = time.perf_counter()
        if self.rows.active:
            self.rows.attach(slot)
        flags = int(slot.fields[4])
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
        """Handle control messages in order while they can be; return APPLIED notices."""
        applied: list[np.ndarray] = []
        while self.queue:
            ctl, obj = self.queue[0]
            handler = self.handlers.get(int(ctl[0]))
            if handler is None:
                raise ProtocolError(f"{self.label}: unknown control message {int(ctl[0])}")
            if not handler(ctl, obj, applied):
                break
            self.queue.popleft()
        return applied

    def _on_decide(self, ctl, obj, applied) -> bool:
        step, taken = int(ctl[1]), self.control.taken(ctl)
        if not self.acc.ready(step, taken):
            return False
        chosen = self.acc.chosen(step, taken)
        if any(s.waiting or s.waiting_rows for s in chosen):
            return False
        start = self.reduced_at = time.perf_counter() if self.timed else 0.0
        self._apply(step, chosen, self.control.hyper(ctl))
        self._release(self.acc.advance(step, taken))
        notice = np.zeros(NOTICE_WORDS, np.int64)
        notice[0], notice[1], notice[2] = Kind.APPLIED, step, self.ps_index
        if self.timed:
            applied_at = time.perf_counter()
            self._send_params(self.control.workers(ctl))
            self._report(step, start, applied_at, notice)
        else:
            self._send_params(self.control.workers(ctl))
        applied.append(notice)
        return True

    def _report(self, step: int, start: float, applied_at: float, notice: np.ndarray) -> None:
        """The step's figures into its APPLIED notice, and its events onto the timeline.

        ``receive`` lasts from the first gradient that arrived since the last step to the
        start of this one; ``reduce`` includes waiting for the last parameters' sends.
        """
        sent_at = time.perf_counter()
        reduced_at = self.reduced_at
        notice[4] = int((applied_at - reduced_at) * 1e6)
        notice[5] = int((reduced_at - start) * 1e6)
        notice[6] = self.bytes_in + self.rows.bytes_in
        notice[7] = self.bytes_out + self.rows.bytes_out
        self.bytes_in = self.bytes_out = self.rows.bytes_in = self.rows.bytes_out = 0
        tl = timeline.current
        if tl is not None:
            if self.first_arrival:
                tl.span("receive", self.first_arrival, start, step)
            tl.span("reduce", start, reduced_at, step)
            tl.span("apply", reduced_at, applied_at, step)
            tl.span("send", applied_at, sent_at, step)
        self.first_arrival = 0.0

    def _on_reply(self, ctl, obj, applied) -> bool:
        self._send_params(self.control.workers(ctl))
        return True

    def _on_shutdown(self, ctl, obj, applied) -> bool:
        self.shutdown = True
        return True

    def _on_state(self, ctl, obj, applied) -> bool:
        groups = [] if self.optimizer is None else [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        values = {self.name_of[id(p)]: p.detach().clone() for p in self.params}
        self.comm.send((self._state(), self.averages.values(), groups, values, self.global_step),
                       dest=self.worker_ranks[int(ctl[2])], tag=self.tags[Tag.INFO])
        return True

    def _on_averages(self, ctl, obj, applied) -> bool:
        self.comm.send(self.averages.values(), dest=self.worker_ranks[int(ctl[2])],
                       tag=self.tags[Tag.INFO])
        return True

    def _on_load(self, ctl, obj, applied) -> bool:
        self._load(obj)
        return True

    # -- applying -------------------------------------------------------------------------
    def _apply(self, step: int, chosen: list[_Slot], hyper) -> None:
        """Writes, then the reduced gradients with the step's hyper-parameters, then averages."""
        if step != self.global_step:
            raise ProtocolError(f"{self.label}: asked to apply step {step} at version "
                                f"{self.global_step}")
        # the parameters are the send buffer: finish sending the old ones first
        self.poller.wait_all(self.sends_active, lambda: "parameter sends to workers")
        self.sends_active = []
        self._assign(chosen)
        if self.optimizer is not None:
            self.acc.reduce(self.grad_regions, [s.regions for s in chosen], len(chosen))
            if self.timed:
                self.reduced_at = time.perf_counter()
            present = np.bitwise_or.reduce([s.mask for s in chosen])
            for p, g, has in zip(self.params, self.grads, present):
                p.grad = g if has else None
            self.spec.hyper.decode(*hyper, self.optimizer.param_groups)
            if self.rows.active:
                self.rows.set_grads(chosen, self.optimizer)
            self.optimizer.step()
            if self.rows.active:
                self.rows.apply_rows(self.optimizer)
        self._update_buffers(chosen)
        self.averages.update(step + 1)
        self.global_step = step + 1
        self._set_version()

    def _assign(self, chosen: list[_Slot]) -> None:
        """Each written parameter takes the value of the lowest-index worker that wrote it."""
        done = set()
        for slot in chosen:                 # worker order, then arrival
            if slot.assign is None:
                continue
            mask = self.header.views(slot.assign)[3]
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

    def _send_params(self, workers) -> None:
        if self.rows.active:
            self.rows.send_changed(workers, self.global_step)
        for w in workers:
            req = self.param_sends[w]
            if req in self.sends_active:
                req.Wait()
                self.sends_active.remove(req)
            req.Start()
            self.sends_active.append(req)
        if self.timed:
            self.bytes_out += len(workers) * self.param_buf.nbytes

    def _set_version(self) -> None:
        self.param_fields[0] = Kind.PARAMS
        self.param_fields[1] = self.global_step

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
        msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=self.tags[Tag.TABLE], status=status)
        if msg is None:
            return False
        request = msg.recv()
        self.rows.on_table_request(request, status.Get_source(), self.optimizer)
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
        self.averages.load(piece.get("averages"))
        self.rows.reset()
        self.global_step = piece["global_step"]
        self._release(self.acc.reset(self.global_step))     # held for before the load
        self._set_version()

    def finish(self) -> None:
        """Wait for the last sends; cancel and free every persistent request."""
        self.poller.wait_all(self.sends_active, lambda: "parameter sends to workers")
        self.rows.finish()
        for w, slot in enumerate(self.posted):
            if slot is not None:
                slot.req.Cancel()
                slot.req.Wait()
                self.free[w].append(slot)
        reqs = [s.req for f in self.free for s in f] + self.param_sends
        if self.ctl_req is not None:
            reqs.append(self.ctl_req)
        for req in reqs:
            if req.Test() is False:
                req.Cancel()
                req.Wait()
            req.Free()


