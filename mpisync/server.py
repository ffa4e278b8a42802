"""The ps serve loop: hold a shard, reduce the taken gradients, apply, send parameters back."""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from .accumulate import Action, ShardAccumulator, StepCoordinator
from .errors import ConfigError, ProtocolError, StallError
from .progress import SETUP_TIMEOUT, STALL_WARNING, Poller, spin_seconds
from .wire import PARAM_HEADER_BYTES, TOKEN_WORDS, GradHeader, Kind, Tag, build_layouts, tensor_view

__all__ = ["Server"]


class _RecvSlot:
    """A receive buffer for one worker's gradients, with its persistent request."""

    __slots__ = ("buf", "fields", "hyper", "mask", "regions", "req", "worker")

    def __init__(self, comm, worker, nbytes, header, layout):
        self.worker = worker
        self.buf = np.zeros(nbytes, np.uint8)
        self.req = comm.Recv_init([self.buf, MPI.BYTE], source=worker, tag=Tag.GRAD)
        self.fields, self.hyper, self.mask = header.views(self.buf)
        t = torch.from_numpy(self.buf)
        self.regions = [tensor_view(t, header.nbytes, d, off, n) for d, off, n in layout.regions]


class Server:
    """One ps rank: its shard of the parameters, their optimizer, and (on ps 0) the token barrier."""

    @classmethod
    def from_setup(cls, cluster) -> Server:
        """Receive the chief's setup message; raise its error on this rank if it sent one."""
        poller = Poller(cluster.p2p_comm, cluster.timeout, cluster.label,
                        spin_seconds(cluster.oversubscribed))
        kind, payload = poller.wait_message(0, Tag.SETUP, lambda: "the chief's model setup",
                                            timeout=max(SETUP_TIMEOUT, cluster.timeout))
        if kind == "error":
            exc_type, text = payload
            raise exc_type(f"{cluster.label}: setup failed: {text}", collective=True)
        return cls(cluster, payload, poller)

    def __init__(self, cluster, spec: dict, poller: Poller):
        self.cluster = cluster
        self.comm = cluster.p2p_comm
        self.poller = poller
        self.ps = cluster.ps_index
        self.W = cluster.num_workers
        self.is_coordinator = self.ps == 0
        if spec.get("deterministic"):
            torch.use_deterministic_algorithms(True)
        layouts = build_layouts(spec["names"], spec["shapes"], spec["dtypes"], spec["owners"],
                                cluster.num_ps)
        self.layout = layout = layouts[self.ps]
        self.schema = spec["schema"]
        self.header = GradHeader(self.schema.width, len(layout.entries))
        self.msg_nbytes = self.header.nbytes + layout.nbytes

        # parameters: views into the buffer that is sent to the workers as is
        self.param_buf = np.zeros(PARAM_HEADER_BYTES + layout.nbytes, np.uint8)
        self.param_buf[PARAM_HEADER_BYTES:] = spec["shard_data"]
        self.param_fields = self.param_buf[:PARAM_HEADER_BYTES].view(np.int64)
        pt = torch.from_numpy(self.param_buf)
        self.params = [torch.nn.Parameter(tensor_view(pt, PARAM_HEADER_BYTES, e.dtype, e.offset,
                                                      e.nbytes, e.shape))
                       for e in layout.entries]
        self.grad_buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.grads = [tensor_view(self.grad_buf, 0, e.dtype, e.offset, e.nbytes, e.shape)
                      for e in layout.entries]
        self.grad_regions = [tensor_view(self.grad_buf, 0, d, off, n)
                             for d, off, n in layout.regions]
        by_name = {e.name: p for e, p in zip(layout.entries, self.params)}
        self.optimizer = None
        if self.params:
            groups = [dict(hyper, params=[by_name[n] for n in members if n in by_name])
                      for hyper, members in spec["groups"]]
            self.optimizer = spec["opt_cls"](groups, **spec["opt_kwargs"])
        self.name_of = {id(p): e.name for e, p in zip(layout.entries, self.params)}
        self.averages = _MovingAverages(spec.get("ema_decay"), spec.get("ema_num_updates"),
                                        pt[PARAM_HEADER_BYTES:], layout)

        self.global_step = spec["global_step"]
        asynchronous = spec.get("asynchronous", False)
        self.acc = ShardAccumulator(spec["reduction"], self.global_step, asynchronous)
        self.coord = None
        if self.is_coordinator:
            self.coord = StepCoordinator(self.W, spec["replicas_to_aggregate"],
                                         spec["num_tokens"], self.global_step, asynchronous,
                                         spec.get("max_staleness"))
        self._set_version()

        # receive slots per worker (persistent), param sends per worker (persistent)
        self.free: list[list[_RecvSlot]] = [[] for _ in range(self.W)]
        self.posted: list[_RecvSlot | None] = [None] * self.W
        for w in range(self.W):
            self._post(w)
        self.param_sends = [self.comm.Send_init([self.param_buf, MPI.BYTE], dest=w,
                                                tag=Tag.PARAMS) for w in range(self.W)]
        self.sends_active: list[MPI.Request] = []
        self.ctl_words = 4 + 2 * self.W
        self.ctl_buf = np.zeros(self.ctl_words, np.int64)
        self.ctl_queue: list[np.ndarray] = []
        self.ctl_req = None
        self.ack_buf = np.zeros(2, np.int64)
        coord_rank = cluster.coordinator_rank
        if self.is_coordinator:
            self.ack_bufs = [np.zeros(2, np.int64) for _ in range(cluster.num_ps)]
            self.ack_reqs = [self.comm.Recv_init([self.ack_bufs[j], MPI.BYTE],
                                                 source=cluster.ps_rank(j), tag=Tag.ACK)
                             for j in range(1, cluster.num_ps)]
            for r in self.ack_reqs:
                r.Start()
            self.acks = 0
            self.decided: tuple[int, ...] = ()
            self.deferred: list[tuple[int, tuple]] = []
            self.token_buf = np.zeros(TOKEN_WORDS, np.int64)
        else:
            self.ctl_req = self.comm.Recv_init([self.ctl_buf, MPI.BYTE], source=coord_rank,
                                               tag=Tag.CTL)
            self.ctl_req.Start()
        self.closed = [False] * self.W
        self.shutdown = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_progress = time.monotonic()
        self.next_warning = STALL_WARNING

    # -- buffers ------------------------------------------------------------------------
    def _post(self, w: int) -> None:
        slot = self.free[w].pop() if self.free[w] else _RecvSlot(
            self.comm, w, self.msg_nbytes, self.header, self.layout)
        slot.req.Start()
        self.posted[w] = slot

    def _release(self, slots) -> None:
        for slot in slots:
            self.free[slot.worker].append(slot)

    def _set_version(self) -> None:
        self.param_fields[0] = Kind.PARAMS
        self.param_fields[1] = self.global_step

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> dict:
        """Serve until every worker closed and (on ps > 0) the coordinator said shutdown."""
        if self.is_coordinator:
            self._do(self.coord.start())
        poller = self.poller
        status = MPI.Status()
        while not (self.shutdown and all(self.closed)):
            progressed = False
            for w in range(self.W):
                slot = self.posted[w]
                if slot is not None and slot.req.Test(status):
                    self.posted[w] = None
                    self._on_grad(slot, status.Get_count(MPI.BYTE))
                    progressed = True
            if self.ctl_req is not None and self.ctl_req.Test():
                self.ctl_queue.append(self.ctl_buf.copy())   # tiny; frees the buffer
                self.ctl_req.Start()
                progressed = True
            if self.is_coordinator:
                for r in self.ack_reqs:
                    if r.Test():
                        r.Start()
                        self._on_ack()
                        progressed = True
                msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=Tag.REQ, status=status)
                if msg is not None:
                    self._on_request(status.Get_source(), msg.recv())
                    progressed = True
            if progressed:
                self._progress()
                poller.busy()
                self.last_progress = time.monotonic()
                self.next_warning = STALL_WARNING
            else:
                poller.idle()
                idle_s = time.monotonic() - self.last_progress
                if idle_s > poller.timeout:
                    raise StallError(f"{self.cluster.label}: no message for {poller.timeout:g} s "
                                     f"(MPISYNC_TIMEOUT); {self._describe_wait()}")
                if idle_s > self.next_warning:
                    self.next_warning += STALL_WARNING
                    print(f"[mpisync] {self.cluster.label}: nothing arrived for {idle_s:.0f} s; "
                          f"{self._describe_wait()}", file=sys.stderr, flush=True)
        self._finish()
        return self.coord.stats() if self.coord else {"global_step": self.global_step}

    def _describe_wait(self) -> str:
        if self.coord is not None:
            c = self.coord
            return (f"global step {c.global_step} has {c.num_taken} of "
                    f"{c.replicas_to_aggregate} gradients; workers still computing: "
                    f"{sorted(c.computing)}, closed: {sorted(c.closed)}")
        if self.ctl_queue:
            return f"waiting for gradients to apply step {int(self.ctl_queue[0][1])}"
        return "waiting for the coordinator (ps 0)"

    def _finish(self) -> None:
        self.poller.wait_all(self.sends_active, lambda: "parameter sends to workers")
        for w, slot in enumerate(self.posted):
            if slot is not None:
                slot.req.Cancel()
                slot.req.Wait()
                self.free[w].append(slot)
        for reqs in ([s.req for f in self.free for s in f] + self.param_sends
                     + ([self.ctl_req] if self.ctl_req else [])
                     + (self.ack_reqs if self.is_coordinator else [])):
            if reqs.Test() is False:
                reqs.Cancel()
                reqs.Wait()
            reqs.Free()

    # -- events -------------------------------------------------------------------------
    def _on_grad(self, slot: _RecvSlot, nbytes: int) -> None:
        kind, step, w = int(slot.fields[0]), int(slot.fields[1]), slot.worker
        self.bytes_in += nbytes
        if kind == Kind.CLOSE:
            self.closed[w] = True
            self._release([slot])
            if self.coord is not None:
                self._do(self.coord.close(w))
                self._reply_stats(w)
            return
        if kind != Kind.GRAD or nbytes != self.msg_nbytes:
            raise ProtocolError(f"{self.cluster.label}: worker {w} sent kind {kind} with "
                                f"{nbytes} bytes, expected a gradient of {self.msg_nbytes}")
        self._post(w)
        if not self.acc.offer(w, step, slot):
            self._release([slot])
        if self.coord is not None:
            self._do(self.coord.push(w, step))

    def _on_ack(self) -> None:
        self.acks += 1
        if self.acks == self.cluster.num_ps:
            self.acks = 0
            self._do(self.coord.applied(self.decided))
            deferred, self.deferred = self.deferred, []
            for w, req in deferred:
                self._on_request(w, req)

    def _progress(self) -> None:
        """Work through the ordered control queue as far as the arrived gradients allow."""
        while self.ctl_queue:
            ctl = self.ctl_queue[0]
            kind, step, arg = int(ctl[0]), int(ctl[1]), int(ctl[2])
            taken = ctl[4:4 + self.W]
            workers = ctl[4 + self.W:]
            if kind == Kind.DECIDE:
                t = tuple(int(x) for x in taken)
                if not self.acc.ready(step, t):
                    return
                self._apply(step, t)
                self._send_params(workers)
                if self.is_coordinator:
                    self._on_ack()
                else:
                    self.ack_buf[0], self.ack_buf[1] = Kind.DECIDE, step
                    self.comm.Send([self.ack_buf, MPI.BYTE], dest=self.cluster.coordinator_rank,
                                   tag=Tag.ACK)
            elif kind == Kind.REPLY:
                self._send_params(workers)
            elif kind == Kind.SHUTDOWN:
                self.shutdown = True
            elif kind == Kind.STATE:
                self.comm.send((self._state(), self.averages.values()), dest=arg, tag=Tag.INFO)
            elif kind == Kind.AVERAGES:
                self.comm.send(self.averages.values(), dest=arg, tag=Tag.INFO)
            elif kind == Kind.LOAD:
                self._load(self.comm.recv(source=self.cluster.coordinator_rank,
                                          tag=Tag.CTL_OBJ))
            self.ctl_queue.pop(0)

    def _apply(self, step: int, taken: tuple[int, ...]) -> None:
        """Reduce the taken gradients in a fixed order, set the hyper-parameters, step."""
        if step != self.global_step:
            raise ProtocolError(f"{self.cluster.label}: asked to apply step {step} at "
                                f"version {self.global_step}")
        chosen = self.acc.chosen(step, taken)
        if self.optimizer is not None:
            self.acc.reduce(self.grad_regions, [s.regions for s in chosen], len(chosen))
            present = np.bitwise_or.reduce([s.mask for s in chosen])
            for p, g, has in zip(self.params, self.grads, present):
                p.grad = g if has else None
            self.schema.decode(chosen[0].hyper, self.optimizer.param_groups)
            # the parameters are the send buffer: finish sending the old ones first
            self.poller.wait_all(self.sends_active, lambda: "parameter sends to workers")
            self.sends_active = []
            self.optimizer.step()
            self.averages.update(step + 1)
        self.global_step = step + 1
        self._set_version()
        self._release(self.acc.advance(step, taken))

    def _send_params(self, workers) -> None:
        for w in np.flatnonzero(workers):
            req = self.param_sends[w]
            if req in self.sends_active:
                req.Wait()
                self.sends_active.remove(req)
            req.Start()
            self.sends_active.append(req)
            self.bytes_out += self.param_buf.nbytes

    # -- coordinator --------------------------------------------------------------------
    def _ctl(self, kind: int, step: int, arg: int = 0, taken=(), workers=()) -> None:
        """Send one control message to every ps (ps 0 queues its own), in order."""
        ctl = np.zeros(self.ctl_words, np.int64)
        ctl[0], ctl[1], ctl[2] = kind, step, arg
        if taken:
            ctl[4:4 + self.W] = taken
        for w in workers:
            ctl[4 + self.W + w] = 1
        for j in range(1, self.cluster.num_ps):
            self.comm.Send([ctl, MPI.BYTE], dest=self.cluster.ps_rank(j), tag=Tag.CTL)
        self.ctl_queue.append(ctl)

    def _token(self, kind: int, step: int, workers, params_follow: bool) -> None:
        tok = self.token_buf
        tok[0], tok[1], tok[2] = kind, step, int(params_follow)
        for w in workers:
            self.comm.Send([tok, MPI.BYTE], dest=w, tag=Tag.TOKEN)

    def _do(self, actions: list[Action]) -> None:
        for a in actions:
            if a.kind == "decide":
                self.decided = a.workers
                self._ctl(Kind.DECIDE, a.step, taken=a.taken, workers=a.workers)
            elif a.kind == "reply":
                self._ctl(Kind.REPLY, a.step, workers=a.workers)
                self._token(Kind.GO, a.step, a.workers, True)
            elif a.kind == "token":
                self._token(Kind.GO, a.step, a.workers, True)
            elif a.kind == "grant":
                self._token(Kind.GO, a.step, a.workers, False)
            elif a.kind == "stop":
                self._token(Kind.STOP, a.step, a.workers, False)
            elif a.kind == "shutdown":
                self._ctl(Kind.SHUTDOWN, a.step)
        self._progress()

    def _reply_stats(self, w: int) -> None:
        stats = self.coord.stats()
        stats["ps_bytes_in"] = self.bytes_in
        self.comm.send(stats, dest=w, tag=Tag.INFO)

    def _on_request(self, w: int, req: tuple) -> None:
        what = req[0]
        if what != "stats" and self.coord.applying:
            self.deferred.append((w, req))   # answered at version global_step, after the apply
            return
        if what == "stats":
            self._reply_stats(w)
        elif what == "resync":
            self._do(self.coord.resync(w))
        elif what == "state":
            self._ctl(Kind.STATE, self.coord.global_step, arg=w)
        elif what == "averages":
            self._ctl(Kind.AVERAGES, self.coord.global_step, arg=w)
        elif what == "load":
            pieces, global_step = req[1], req[2]
            c = self.coord
            if c.num_taken or c.applying:
                self.comm.send(ConfigError(
                    f"{self.cluster.label}: load_state_dict() while step {c.global_step} "
                    f"already holds gradients; call it on every worker before training"),
                    dest=w, tag=Tag.INFO)
                return
            for j in range(1, self.cluster.num_ps):
                self._ctl_obj(j, pieces[j])
            self._load(pieces[0])
            c.global_step = global_step
            self.comm.send(None, dest=w, tag=Tag.INFO)
        else:
            raise ProtocolError(f"{self.cluster.label}: unknown request {what!r} from "
                                f"worker {w}")

    def _ctl_obj(self, j: int, obj) -> None:
        ctl = np.zeros(self.ctl_words, np.int64)
        ctl[0] = Kind.LOAD
        self.comm.Send([ctl, MPI.BYTE], dest=self.cluster.ps_rank(j), tag=Tag.CTL)
        self.comm.send(obj, dest=self.cluster.ps_rank(j), tag=Tag.CTL_OBJ)

    # -- optimizer state ----------------------------------------------------------------
    def _state(self) -> dict:
        """This shard's optimizer state, keyed by parameter name."""
        if self.optimizer is None:
            return {}
        return {self.name_of[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v)
                                      for k, v in s.items()}
                for p, s in self.optimizer.state.items()}

    def _load(self, piece: dict) -> None:
        """Load optimizer state for this shard's parameters (``{name: state}``)."""
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            order = [self.name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
            index = {name: i for i, name in enumerate(order)}
            sd["state"] = {index[n]: s for n, s in piece["state"].items()}
            for group, saved in zip(sd["param_groups"], piece["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            self.optimizer.load_state_dict(sd)
        self.averages.load(piece.get("averages"))
        self.global_step = piece["global_step"]
        self.acc.global_step = self.global_step
        self._set_version()


class _MovingAverages:
    """Exponential moving averages of one shard's floating-point parameters.

    ``average = decay * average + (1 - decay) * parameter`` after every applied step, over
    each fused region of the shard at once. With ``num_updates`` the decay is
    ``min(decay, (1 + t) / (10 + t))`` after the t-th update, as TensorFlow's
    ``ExponentialMovingAverage(decay, num_updates=global_step)`` does. The averages start
    equal to the parameters. Without a decay every method does nothing.
    """

    def __init__(self, decay: float | None, num_updates: bool, params: torch.Tensor,
                 layout) -> None:
        self.decay = decay
        self.num_updates = bool(num_updates)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.views: dict[str, torch.Tensor] = {}
        if decay is None or not layout.entries:
            return
        buf = params[:layout.nbytes].clone()
        self.pairs = [(tensor_view(buf, 0, d, off, n), tensor_view(params, 0, d, off, n))
                      for d, off, n in layout.regions if d.is_floating_point]
        self.views = {e.name: tensor_view(buf, 0, e.dtype, e.offset, e.nbytes, e.shape)
                      for e in layout.entries if e.dtype.is_floating_point}

    def update(self, t: int) -> None:
        if not self.pairs:
            return
        decay = min(self.decay, (1 + t) / (10 + t)) if self.num_updates else self.decay
        for average, param in self.pairs:
            average.lerp_(param, 1.0 - decay)

    def values(self) -> dict[str, torch.Tensor]:
        """``{name: average}``, copies."""
        return {name: v.clone() for name, v in self.views.items()}

    def load(self, saved: dict | None) -> None:
        """Restore saved averages; parameters without a saved one restart from the parameter."""
        if not self.pairs:
            return
        for average, param in self.pairs:
            average.copy_(param)
        for name, value in (saved or {}).items():
            self.views[name].copy_(value)
