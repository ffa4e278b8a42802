"""The worker's transport for dense parameters: the dense channel (route ``dense_ps``)."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ..errors import DeadlockError, ProtocolError
from ..native.bulk import grads_of
from ..protocol.layouts import buckets_of, wire_layouts_of
from ..protocol.spec import JobSpec
from ..protocol.wire import (
    FLAG_ASSIGN,
    PARAM_HEADER_BYTES,
    TOKEN_WORDS,
    GradField,
    GradHeader,
    HyperField,
    Kind,
    ShardLayout,
    Tag,
    TokenField,
    entry_views,
    hyper_views,
    hyper_words,
    is_still_question,
    timing_view,
)
from ..runtime import shm
from ..runtime.progress import SETUP_TIMEOUT, Pace, Poller
from .adoption import GradAdopter
from .buckets import GradBuckets
from .dense_shard import DenseShard
from .devices import Staging, host_bytes, raw_bytes, staged

__all__ = ["DenseChannel"]


#: Steps a worker pushes only at ``step()`` after one whose gradients changed once sent
#: (clipped, or a backward more than the step before: gradient accumulation).
QUIET_STEPS = 64


class DenseChannel:
    """Parameters that live whole on one ps rank (route ``dense_ps``), and module buffers.

    Per ps rank (a ``DenseShard``), one fused gradient buffer (a header, then every
    gradient it owns) and one fused parameter buffer, allocated once and cut into buckets
    (``wire.bucket_layout``). The model's parameters become views into the parameter
    buffers, so the pull lands in the model; the gradients are views into the gradient
    buffers once ``zero_grad`` or a push adopted them (``GradAdopter``), so ``backward()``
    writes what the push sends. While backward runs, gradient hooks send each bucket as
    soon as its gradients are complete (``bucket_ready``), as DDP and Horovod start their
    all-reduces; ``step()`` sends the header and whatever is left. A bucket that changed
    after it was sent (its version counter moved: clipping, or another backward before the
    step) goes again with the whole region (``FLAG_RESEND``), and the next ``QUIET_STEPS``
    steps push only at ``step()``; a step after several backward passes sends from hooks
    in the last of them.
    """

    def __init__(self, spec: JobSpec, layouts: list[ShardLayout], cluster,
                 params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 poller: Poller):
        self.spec = spec
        self.cluster = cluster
        self.poller = poller
        self.comm = comm = cluster.p2p_comm
        self.label = cluster.label
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.GRAD, Tag.DATA, Tag.FULL,
                                                           Tag.ASSIGN, Tag.PARAMS, Tag.TOKEN,
                                                           Tag.INIT, Tag.HYPER, Tag.INFO)}
        self.part_of = dict(zip(spec.names, spec.parts))    # unit -> (name, start, stop)
        self.names = list(dict.fromkeys(name for name, _, _ in spec.parts))
        self.params = [params[n] for n in self.names]
        index = {n: i for i, n in enumerate(self.names)}
        self.place: list[list[tuple[int, int]]] = [[] for _ in self.names]   # (ps, entry)
        self.shards: list[DenseShard] = []
        self.pviews: list[torch.Tensor] = [None] * len(self.names)
        self.gviews: list[torch.Tensor] = [None] * len(self.names)
        # partitioned parameters stay whole here: (index, start, stop, unit pview, unit gview)
        self.pieces: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
        self.piece_entries: dict[tuple[int, int], tuple] = {}     # (ps, entry) -> piece
        # parameters and buffers off the CPU stay there; host buffers stage them
        self.staging = Staging(self.label)
        pinned = torch.cuda.is_available() and any(
            t.device.type == "cuda" for t in (*self.params, *buffers.values()))
        self.landing: list[int] = []     # buckets whose gradients are on the way to the host
        for u, (name, _, _) in self.part_of.items():
            i = index[name]
            if u != name and self.pviews[i] is None:
                self._own(i, pinned)
        shared = [None] * spec.num_ps
        if shm.enabled(spec):
            with poller.patience(SETUP_TIMEOUT):
                shared = shm.accept(comm, [cluster.ps_rank(j) for j in range(spec.num_ps)],
                                    spec.opt_id, poller)
        for j, (layout, wire) in enumerate(zip(layouts, wire_layouts_of(spec))):
            shard = DenseShard(GradHeader(spec.hyper.width, len(layout.entries)), layout,
                               wire, *buckets_of(spec, layout, wire), comm, cluster.ps_rank(j),
                               self.tags, shared[j], pinned)
            self._bind(j, shard, layout, index, buffers)
            self.shards.append(shard)
        # the gradients' views stay the parameters' .grad; has_grad: which have one
        self.adopter = GradAdopter(self.label, self.names, self.params, self.gviews,
                                   [s.gmem for s in self.shards], self.staging)
        self.has_grad = self.adopter.has_grad
        self.token = np.zeros(TOKEN_WORDS, np.int64)
        self.token_req = comm.Recv_init([self.token, MPI.BYTE], source=cluster.coordinator_rank,
                                        tag=self.tags[Tag.TOKEN])
        self.recvs = [r for s in self.shards for r in s.recvs]
        self.sends = [r for s in self.shards for r in (s.head_send, *s.data_sends, s.full_send)
                      if r is not None]
        self.shared = [s for s in self.shards if s.segment is not None]
        self.recvs_started = False
        self.bytes_per_ps = [s.gbuf.nbytes for s in self.shards]
        self.pending: list[MPI.Request] = []
        self.timed = False          # note when the token arrives (mpisync.worker.stepclock)
        self.token_at = 0.0
        self.piece_copies = [(raw_bytes(self.pviews[i][start:stop]), raw_bytes(pview))
                             for i, start, stop, pview, _ in self.pieces]
        self._bucket_members()
        # CUDA's gradient hooks run on autograd's device thread: they send only where MPI
        # allows calls from another thread (one at a time), else step() sends
        self.hook_sends = (not self.staging.cuda
                           or MPI.Query_thread() >= MPI.THREAD_SERIALIZED)
        landing = self._send_landed if self.staging.cuda and self.hook_sends else None
        # through shared memory every bucket goes at step(): no hooks then (they cost
        # each parameter a Python call per backward and would send nothing)
        hooked = [n for n, (j, _) in enumerate(self.order) if self.shards[j].segment is None]
        self.hooks = GradBuckets([self.members[n][0] for n in hooked],
                                 [self.order[n][0] for n in hooked],
                                 lambda k: self.bucket_ready(hooked[k]),
                                 landing or (lambda: None),
                                 on_hook=landing and (lambda _: landing()))
        self.pace = Pace()               # how long the token took lately
        self.expected_backwards = 1      # backward passes per step, as the last step had
        self.quiet = 0                   # steps left that push only at step()
        self.counts = {"buckets": 0, "from_hooks": 0, "resent": 0}   # sent, of them, again
        self._resend: set[int] = set()       # ps ranks whose buckets go again (gather())

    def _own(self, i: int, pinned: bool) -> None:
        """A partitioned parameter keeps its own tensor; its units are copied in and out
        (a staged one through a whole host copy of its own)."""
        p = self.params[i]
        if staged(p):
            nbytes = p.numel() * p.element_size()
            self.pviews[i], self.gviews[i] = (
                torch.from_numpy(host_bytes(nbytes, pinned)).view(p.dtype).view(p.shape)
                for _ in range(2))
            self.staging.add(i, p, self.pviews[i], self.gviews[i])
            return
        if not p.is_contiguous():
            torch._C.TensorBase.data.__set__(p, p.detach().contiguous())
        self.pviews[i] = p.detach()
        self.gviews[i] = torch.zeros_like(self.pviews[i])
        if p.grad is not None:
            self.gviews[i].copy_(p.grad)
            p.grad = self.gviews[i]

    def _bind(self, j: int, shard: DenseShard, layout: ShardLayout, index: dict,
              buffers: dict[str, torch.Tensor]) -> None:
        """Make the model's tensors views into this shard's buffers (values copied in)."""
        pt = torch.from_numpy(shard.pmem)
        pviews = entry_views(pt, PARAM_HEADER_BYTES, layout.entries)
        gviews = [None] * len(layout.entries)
        for b, base in zip(shard.buckets, shard.bases):
            entries = layout.entries[b.first:b.stop]
            gviews[b.first:b.stop] = entry_views(base, -b.offset, entries)
        idx = []
        for k, (e, pview, gview) in enumerate(zip(layout.entries, pviews, gviews)):
            name, start, stop = self.part_of[e.name]
            i = index[name]
            p = self.params[i]
            self.place[i].append((j, k))
            idx.append(i)
            if e.name != name:          # one shard of a partitioned parameter
                pview.copy_(self.pviews[i][start:stop])
                self.pieces.append((i, start, stop, pview, gview))
                self.piece_entries[(j, k)] = (i, start, stop, gview)
                continue
            self.pviews[i], self.gviews[i] = pview, gview
            if staged(p):               # it stays on its device; the pull is copied there
                self.staging.add(i, p, pview, gview)
                continue
            pview.copy_(p.detach())
            torch._C.TensorBase.data.__set__(p, pview)   # the pull lands in the model
            if p.grad is not None:                        # a gradient made before wrapping
                gview.copy_(p.grad)
                p.grad = gview
        shard.idx = np.array(idx, np.int64)
        for e, view in zip(layout.buffer_entries,
                           entry_views(pt, PARAM_HEADER_BYTES, layout.buffer_entries)):
            b = buffers[e.name]
            if staged(b):
                self.staging.add_buffer(b, view)
                continue
            view.copy_(b)
            b.data = view

    def _bucket_members(self) -> None:
        """Every bucket of every ps (the buffers' buckets aside, they go at ``step()``):
        ``order[n] = (ps, bucket)``, ``members[n] = (parameters, their indices, their
        gradient views, the indices as an array, whether their ``.grad`` is read plainly,
        whether backward wrote each in place: a ``bulk.Grads``)``; ``in_place``: the
        latter for every parameter."""
        self.order, self.members = [], []
        self.in_place = self.adopter.grads()
        self.pieces_of: dict[tuple[int, int], list] = {}
        for j, shard in enumerate(self.shards):
            for b in shard.buckets:
                if b.buffers:
                    continue
                ids = list(dict.fromkeys(int(i) for i in shard.idx[b.first:b.stop]))
                self.order.append((j, b.index))
                grads = self.adopter.grads(ids)
                self.members.append((grads.params, ids, grads.views, np.array(ids, np.intp),
                                     grads.plain, grads))
        for (j, k), piece in self.piece_entries.items():
            b = next(b for b in self.shards[j].buckets if b.first <= k < b.stop)
            self.pieces_of.setdefault((j, b.index), []).append(piece)
        self.piece_versions = {id(g): -1 for _, _, _, _, g in self.pieces}
        # every parameter a bucket holds (all of them, unless a gradient view is missing)
        self.bucketed = np.unique(np.concatenate([m[3] for m in self.members] or
                                                 [np.zeros(0, np.intp)]))

    # -- set-up ---------------------------------------------------------------------------
    def send_initial(self) -> None:
        """The chief's parameters and buffers become every ps rank's (call on the chief)."""
        reqs = [self.comm.Isend([s.pmem[PARAM_HEADER_BYTES:], MPI.BYTE],
                                dest=self.cluster.ps_rank(j), tag=self.tags[Tag.INIT])
                for j, s in enumerate(self.shards)]
        self.poller.wait_all(reqs, lambda: "the initial parameters reaching the ps ranks")

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool) -> None:
        """torch's ``zero_grad``: a gradient that is None stays None."""
        if set_to_none:
            if not self.in_place.clear():
                for p in self.params:
                    p.grad = None
            return
        if not self.in_place.in_place():     # (the usual step: backward wrote them all)
            self.adopter.point_home()
        for shard in self.shards:
            for b, base in zip(shard.buckets, shard.bases):
                if not b.buffers:
                    base.zero_()
        for i in {i for i, *_ in self.pieces}:
            self.gviews[i].zero_()
        self.has_grad.fill(0)

    def bucket_ready(self, n: int) -> None:
        """Backward filled bucket ``n`` (of ``order``): send it, unless this step pushes
        only at ``step()``. Staged gradients are sent once their copy reached the host
        (``_send_landed``, from the next hooks, backward's end or the push)."""
        hooks = self.hooks
        if self.quiet or hooks.backwards < self.expected_backwards:
            return
        j, k = self.order[n]
        shard = self.shards[j]
        if self.landing:    # earlier buckets of this ps on their way count as sent
            k -= sum(1 for m in self.landing if self.order[m][0] == j)
        if k != shard.sent:
            return        # an earlier bucket of this ps is not sent yet
        self._prepare(n)
        self.staging.record(n)
        self.landing.append(n)
        if self.hook_sends:
            self._send_landed()

    def _send_landed(self, wait: bool = False) -> None:
        """Send, in order, the buckets handed out whose gradients are on the host."""
        landing = self.landing
        while landing and self.staging.landed(landing[0], wait):
            j, k = self.order[landing.pop(0)]
            shard = self.shards[j]
            shard.versions[k] = shard.bases[k]._version
            shard.send(k)
            shard.sent = k + 1
            self.counts["from_hooks"] += 1

    def _prepare(self, n: int) -> None:
        """Bucket ``n``'s gradients into its buffer; note which parameters have one."""
        params, ids, views, where, plain, grads = self.members[n]
        if grads.in_place():
            self.has_grad[where] = 1        # the usual step: backward wrote them
        elif not grads.adopt():             # (backward's own tensors: copied in, one call)
            self.adopter.take(params, ids, grads_of(params, plain), views)
        self._copy_pieces(n)

    def _copy_pieces(self, n: int) -> None:
        """The pieces of partitioned parameters in bucket ``n``: cut from their gradients."""
        staging = self.staging
        pieces = self.pieces_of.get(self.order[n], ())
        if pieces and staging.cuda:
            staging.sync()            # the whole gradient on the host before it is cut
        for i, start, stop, gview in pieces:
            whole = self.gviews[i]
            if self.piece_versions[id(gview)] != whole._version:
                gview.copy_(whole[start:stop])
                self.piece_versions[id(gview)] = whole._version

    def gather(self) -> None:
        """Every bucket's gradients in its send buffer, ``has_grad`` noted; the ps ranks
        whose buckets sent during backward changed since (they go again, whole)."""
        resend = self._resend
        resend.clear()
        if self.in_place.in_place():     # the usual step: backward wrote every buffer
            self.has_grad[self.bucketed] = 1
            taken = True
        else:                            # backward's own tensors: copied in, in one call
            taken = self.in_place.adopt()
            if not taken:
                self.adopter.unalias()
        self._send_landed(wait=True)     # staged buckets handed out in backward: sent
        for n, (j, k) in enumerate(self.order):
            if taken:
                self._copy_pieces(n)
            else:
                self._prepare(n)
            shard = self.shards[j]
            if k < shard.sent and shard.bases[k]._version != shard.versions[k]:
                resend.add(j)
        if self.staging:
            self.staging.sync()          # every gradient on the host before it is sent
            self.staging.buffers_to_host()

    def push(self, step: int, worker: int, seq: int, flags: int, written: list[int]) -> None:
        """Send this worker's gradients (and first what it wrote) to every ps rank, after
        ``gather()``: per ps the header and the buckets not sent yet, in order, and those
        sent during backward that changed since again."""
        self.hooks.hook_new()
        if written and self.staging:
            self.staging.params_to_host(written)    # written on their devices
        assigned = self._assign(written, step, worker, seq) if written else ()
        resend = self._resend
        self._start_recvs()
        words, codes = self.hyper_out
        for j, shard in enumerate(self.shards):
            if j:
                shard.words[:], shard.codes[:] = words, codes   # every ps may apply the step
            shard.push(step, worker, seq, flags | (FLAG_ASSIGN if j in assigned else 0),
                       self.has_grad, j in resend)
            self.counts["buckets"] += len(shard.data_sends)
        self.counts["resent"] += bool(resend)         # pushes that sent buckets again
        self._end_push(bool(resend))

    def _end_push(self, resent: bool) -> None:
        """How the next step sends: from hooks in its last backward, or only at step()."""
        hooks = self.hooks
        if self.quiet:
            self.quiet -= 1
        elif resent and hooks.backwards <= self.expected_backwards:
            self.quiet = QUIET_STEPS       # changed after backward (clipping): send at step()
        if hooks.backwards:
            self.expected_backwards = hooks.backwards
        hooks.new_step()
        self.staging.forget_grads()

    def _start_recvs(self) -> None:
        self.staging.wait_host_free()    # the last copies to the devices read these buffers
        if not self.recvs_started:
            MPI.Prequest.Startall(self.recvs)
            self.recvs_started = True

    def _assign(self, written: list[int], step: int, worker: int, seq: int) -> set[int]:
        """Send the parameters written since the last step to their ps ranks."""
        by_ps: dict[int, list[int]] = {}
        for i in written:
            for j, k in self.place[i]:
                by_ps.setdefault(j, []).append(k)
        with torch.no_grad():
            for i, start, stop, pview, _ in self.pieces:
                pview.copy_(self.pviews[i][start:stop])
        for j, entries in by_ps.items():
            message = self.shards[j].assignment(entries, step, worker, seq)
            self.pending.append(self.comm.Isend([message, MPI.BYTE],
                                                dest=self.cluster.ps_rank(j),
                                                tag=self.tags[Tag.ASSIGN]))
        return set(by_ps)

    def pull(self, on_hyper: Callable[[int], tuple[np.ndarray, np.ndarray]] | None
             ) -> tuple[int, int, bool, float]:
        """Wait for the token and, with it, the parameters.

        Returns (kind, step, whether the step took this worker's gradient, seconds waited).

        A HYPER token (asynchronous mode) asks for the hyper-parameters of the step that
        applies this worker's gradient: ``on_hyper(step)`` gives them, and the wait goes on.
        """
        start = time.perf_counter()
        poller = self.poller
        self.token_req.Start()
        self._start_recvs()
        while True:
            poller.wait_all([self.token_req], lambda: "the token", self.pace,
                            self._copy_published if self.shared else None)
            token = self.token
            kind, step = int(token[TokenField.KIND]), int(token[TokenField.STEP])
            if kind != Kind.HYPER:
                break
            self._send_hyper(step, on_hyper(step))
            self.token_req.Start()
        if self.timed:
            self.token_at = time.perf_counter()
        if kind == Kind.GO:
            self._take_params(step)
        else:
            for r in self.recvs:
                r.Cancel()
            MPI.Request.Waitall(self.recvs)
            self.recvs_started = False
            if kind == Kind.FAIL:
                raise DeadlockError(self.answer(self.cluster.coordinator_rank, "the reason"))
            if kind not in (Kind.GRANT, Kind.STOP):
                raise ProtocolError(f"{self.label}: unknown token kind {kind}")
        self.recvs_started = False
        for shard in self.shared:
            shard.due = [x + 1 for x in shard.seen]
        poller.wait_all(self.sends + self.pending, lambda: "gradient sends")
        for shard in self.shards:
            shard.sent = 0
        self.pending = []
        return kind, step, bool(self.token[TokenField.ARG]), time.perf_counter() - start

    def _copy_published(self) -> bool:
        done = True
        for shard in self.shared:
            done &= shard.copy_published()
        return done

    def _take_params(self, step: int) -> None:
        """Wait for every ps rank's parameters of ``step``; into the model."""
        self.poller.wait_all(self.recvs, lambda: f"the parameters of step {step}")
        if self.shared:
            self.poller.wait_until(self._copy_published,
                                   lambda: f"the parameters of step {step} in shared memory")
        for j, shard in enumerate(self.shards):
            if shard.segment is not None:
                continue          # copied bucket by bucket, each as the ps published it
            shard.take_params(step, self.label, j)
        for dst, src in self.piece_copies:
            np.copyto(dst, src)     # raw memory: not a write the tracker should see
        if self.staging:
            self.staging.to_devices()

    def _send_hyper(self, step: int, hyper: tuple[np.ndarray, np.ndarray]) -> None:
        words, codes = hyper
        width = len(words)
        msg = np.zeros(hyper_words(width), np.int64)
        msg[HyperField.STEP] = step
        msg_words, msg_codes = hyper_views(msg, width)
        msg_words[:] = words
        msg_codes[:] = codes
        self.comm.Send([msg, MPI.BYTE], dest=self.cluster.coordinator_rank,
                       tag=self.tags[Tag.HYPER])

    @property
    def hyper_out(self) -> tuple[np.ndarray, np.ndarray]:
        """Where this worker's hyper-parameters go: the header of the message to ps 0."""
        return self.shards[0].words, self.shards[0].codes

    def close(self, global_step: int, worker: int) -> None:
        """Leave: tell every ps (the last worker out stops them)."""
        bye = np.zeros(GradField.COUNT, np.int64)
        bye[GradField.KIND], bye[GradField.STEP] = Kind.CLOSE, global_step
        bye[GradField.WORKER] = worker
        timing_view(bye)[:] = timing_view(self.shards[0].fields)  # the last step's, if measured
        for j in range(len(self.shards)):
            self.comm.Send([bye, MPI.BYTE], dest=self.cluster.ps_rank(j), tag=self.tags[Tag.GRAD])
        self.hooks.remove()
        if self.recvs_started:
            for r in self.recvs:
                r.Cancel()
            MPI.Request.Waitall(self.recvs)
        for req in self.sends + self.recvs:
            req.Free()
        self.token_req.Free()

    def final_stats(self) -> dict:
        """The job's final statistics; waits for the last worker's close (after close())."""
        return self.answer(self.cluster.coordinator_rank,
                           "the final statistics (every worker's close)")

    def answer(self, source: int, what: str):
        """The next answer from ``source``, past the coordinator's questions whether this
        worker is still in a collective among the workers: one that comes after the
        worker left it is stale (its UNPARK tells the coordinator)."""
        while True:
            got = self.poller.wait_message(source, self.tags[Tag.INFO], lambda: what)
            if not is_still_question(got):
                return got
