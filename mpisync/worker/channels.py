"""The worker's transport: one channel per route kind."""
from __future__ import annotations

import operator
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ..errors import DeadlockError, ProtocolError
from ..native.bulk import Grads, grads_of
from ..protocol.layouts import buckets_of, conversions, wire_layouts_of
from ..protocol.spec import JobSpec
from ..protocol.wire import (
    FLAG_ASSIGN,
    FLAG_RESEND,
    PARAM_HEADER_BYTES,
    TOKEN_WORDS,
    GradField,
    GradHeader,
    HyperField,
    Kind,
    ParamField,
    ShardLayout,
    Tag,
    TokenField,
    entry_views,
    hyper_views,
    hyper_words,
    is_still_question,
    region_views,
    timing_view,
)
from ..runtime import shm
from ..runtime.progress import SETUP_TIMEOUT, Pace, Poller
from .buckets import GradBuckets
from .devices import Staging, host_bytes, staged

__all__ = ["DenseChannel", "ReplicatedChannel"]


_layout_of, _dtype_of, _shape_of, _requires_grad_of = (
    operator.attrgetter(a) for a in ("layout", "dtype", "shape", "requires_grad"))


def _plain(params: list[torch.Tensor]) -> bool:
    """Whether reading these parameters' ``.grad`` calls no ``__torch_function__`` anyway
    (tensors and parameters, ``TrackedParameter`` too): then it may skip torch's look-up."""
    return all(type(p) is torch.Tensor
               or type(p).__torch_function__ is torch._C._disabled_torch_function_impl
               for p in params)


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor, as a NumPy array (writes change no torch version)."""
    return t.reshape(-1).view(torch.uint8).numpy()


#: Steps a worker pushes only at ``step()`` after one whose gradients changed once sent
#: (clipped, or a backward more than the step before: gradient accumulation).
QUIET_STEPS = 64


class _Shard:
    """This worker's side of one ps rank: the fused buffers and their persistent requests.

    A push is a header on ``Tag.GRAD`` and the buckets, in order, on ``Tag.DATA`` (the
    first ones sent from gradient hooks while backward runs, the rest at ``step()``); the
    pull is every bucket's parameters, then the parameter header, on ``Tag.PARAMS``. With
    a ``wire_dtype`` what travels (``gbuf``, ``pbuf``) is converted from and to the
    buffers the model's gradients and parameters live in (``gmem``, ``pmem``); without, the
    two are one.
    """

    __slots__ = ("abuf", "acks", "bases", "buckets", "buffer_pairs", "codes", "copies",
                 "data_sends", "due", "fields", "from_wire", "full_send", "gbuf", "gmem",
                 "head_send", "header", "idx", "mask", "pbuf", "pfields", "pmem", "ready",
                 "recvs", "seen", "segment", "sent", "to_wire", "versions", "words")

    def __init__(self, header: GradHeader, layout: ShardLayout, wire: ShardLayout, buckets,
                 wbuckets, comm, rank: int, tags: dict, shared=None, pinned: bool = False):
        self.header = header
        self.buckets = buckets
        h, ph = header.nbytes, PARAM_HEADER_BYTES
        self.segment = None
        if shared is not None:             # a ps rank of this machine: shared memory
            self.segment, i = shared
            self.gbuf = np.zeros(h, np.uint8)            # only the header travels
            self.pbuf = self.segment.params              # read from the ps's own buffer
            self.gmem = self.segment.slot(i)             # the gradients live there
            self.pmem = host_bytes(ph + layout.nbytes, pinned)
            self.ready, self.acks = self.segment.flags(i)
            # publications copied so far (a new segment starts at 0; the ps may have
            # published the first already), and what they will be once this pull's are in
            self.seen = [0] * len(buckets)
            self.due = [1] * len(buckets)
            self.copies = [(self.pmem[ph + b.offset:ph + b.offset + b.nbytes],
                            self.pbuf[ph + b.offset:ph + b.offset + b.nbytes])
                           for b in buckets]
            wire, wbuckets = layout, buckets
        else:
            self.gbuf = host_bytes(h + wire.nbytes, pinned)
            self.pbuf = host_bytes(ph + wire.nbytes, pinned)
            same = wire == layout
            self.gmem = self.gbuf[h:] if same else host_bytes(layout.nbytes, pinned)
            self.pmem = self.pbuf if same else host_bytes(ph + layout.nbytes, pinned)
        self.fields, self.words, self.codes, self.mask = header.views(self.gbuf)
        self.pfields = self.pbuf[:ph].view(np.int64)
        # each bucket's gradients are a tensor of their own: its version counter tells
        # whether they changed after the bucket was sent
        self.bases = [torch.from_numpy(self.gmem[b.offset:b.offset + b.nbytes]) for b in buckets]
        # tensors of their own too: converting into the model's parameters is no write
        # that the write tracker should see
        gwire = torch.from_numpy(self.gmem if self.segment else self.gbuf[h:])
        pwire = torch.from_numpy(self.pmem if self.segment else self.pbuf)[ph:]
        self.to_wire = conversions(buckets, wbuckets, torch.from_numpy(self.gmem), gwire,
                                   layout, wire, to_wire=True, push=True)
        self.from_wire = conversions(buckets, wbuckets, torch.from_numpy(self.pmem)[ph:], pwire,
                                     layout, wire, to_wire=False)
        # buffers travel both ways: their values into what is pushed, pulled into pmem
        self.buffer_pairs = list(zip(region_views(gwire, 0, wire.buffer_regions),
                                     region_views(torch.from_numpy(self.pmem), ph,
                                                  layout.buffer_regions)))
        self.head_send = comm.Send_init([self.gbuf[:h], MPI.BYTE], dest=rank, tag=tags[Tag.GRAD])
        self.data_sends, self.recvs, self.full_send = [], [], None
        if self.segment is None:
            self.data_sends = [comm.Send_init([self.gbuf[h + b.offset:h + b.offset + b.nbytes],
                                               MPI.BYTE], dest=rank, tag=tags[Tag.DATA])
                               for b in wbuckets]
            self.full_send = comm.Send_init([self.gbuf[h:], MPI.BYTE], dest=rank,
                                            tag=tags[Tag.FULL])
            self.recvs = [comm.Recv_init([self.pbuf[ph + b.offset:ph + b.offset + b.nbytes],
                                          MPI.BYTE], source=rank, tag=tags[Tag.PARAMS])
                          for b in wbuckets]
            self.recvs.append(comm.Recv_init([self.pbuf[:ph], MPI.BYTE], source=rank,
                                             tag=tags[Tag.PARAMS]))
        self.sent = 0                  # buckets sent so far in this push (a prefix)
        self.versions = [0] * len(buckets)
        self.abuf = None
        self.idx = np.zeros(0, np.int64)

    def send(self, k: int) -> None:
        """Start bucket ``k``'s send (on the wire's dtypes first)."""
        for dst, src in self.to_wire[k]:
            dst.copy_(src)
        self.data_sends[k].Start()

    def copy_published(self) -> bool:
        """Shared memory: copy the buckets the ps published since; whether every bucket
        of this pull is in (each pull that brings parameters brings each bucket once)."""
        ready, seen = self.ready, self.seen
        for k, (dst, src) in enumerate(self.copies):
            if seen[k] != int(ready[k]):
                seen[k] = int(ready[k])
                np.copyto(dst, src)     # raw memory: not a write the tracker should see
                self.acks[k] = seen[k]
        return seen == self.due


class DenseChannel:
    """Parameters that live whole on one ps rank (route ``dense_ps``), and module buffers.

    Per ps rank, one fused gradient buffer (a header, then every gradient it owns) and one
    fused parameter buffer, allocated once and cut into buckets (``wire.bucket_layout``).
    The model's parameters become views into the parameter buffers, so the pull lands in
    the model; the gradients are views into the gradient buffers once ``zero_grad`` or a
    push adopted them, so ``backward()`` writes what the push sends. While backward runs,
    gradient hooks send each bucket as soon as its gradients are complete
    (``bucket_ready``), as DDP and Horovod start their all-reduces; ``step()`` sends the
    header and whatever is left. A bucket that changed after it was sent (its version
    counter moved: clipping, or another backward before the step) goes again with the
    whole region (``FLAG_RESEND``), and the next ``QUIET_STEPS`` steps push only at
    ``step()``; a step after several backward passes sends from hooks in the last of them.
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
        self.shards: list[_Shard] = []
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
            shard = _Shard(GradHeader(spec.hyper.width, len(layout.entries)), layout, wire,
                           *buckets_of(spec, layout, wire), comm, cluster.ps_rank(j), self.tags,
                           shared[j], pinned)
            self._bind(j, shard, layout, index, buffers)
            self.shards.append(shard)
        self._has = bytearray(len(self.names))      # fast to set one by one ...
        self.has_grad = np.frombuffer(self._has, np.uint8)   # ... and seen here as an array
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
        self.piece_copies = [(_raw(self.pviews[i][start:stop]), _raw(pview))
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

    def _bind(self, j: int, shard: _Shard, layout: ShardLayout, index: dict,
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
        # aliases of the gradient views that no ``p.grad.data = x`` can move, and where
        # they start: a view whose memory moved holds the user's tensor (``_rehome``)
        self.ghomes = [None if g is None else g.detach() for g in self.gviews]
        self.gptrs = [0 if g is None else g.data_ptr() for g in self.gviews]
        self.order, self.members = [], []
        self.plain = _plain(self.params)
        self.guards = guards = self._grad_memory()
        self.in_place = Grads(self.params, self.gviews, self.plain, has=self.has_grad,
                              guards=guards)
        self.pieces_of: dict[tuple[int, int], list] = {}
        for j, shard in enumerate(self.shards):
            for b in shard.buckets:
                if b.buffers:
                    continue
                ids = list(dict.fromkeys(int(i) for i in shard.idx[b.first:b.stop]))
                self.order.append((j, b.index))
                params = [self.params[i] for i in ids]
                views, plain = [self.gviews[i] for i in ids], _plain(params)
                self.members.append((params, ids, views, np.array(ids, np.intp), plain,
                                     Grads(params, views, plain, ids, self.has_grad, guards)))
        for (j, k), piece in self.piece_entries.items():
            b = next(b for b in self.shards[j].buckets if b.first <= k < b.stop)
            self.pieces_of.setdefault((j, b.index), []).append(piece)
        self.piece_versions = {id(g): -1 for _, _, _, _, g in self.pieces}
        # every parameter a bucket holds (all of them, unless a gradient view is missing)
        self.bucketed = np.unique(np.concatenate([m[3] for m in self.members] or
                                                 [np.zeros(0, np.intp)]))

    def _grad_memory(self) -> list[tuple[int, int]]:
        """The address ranges of every gradient buffer (the shards' and the partitioned
        parameters' own), merged."""
        spans = sorted([(s.gmem.ctypes.data, s.gmem.ctypes.data + s.gmem.nbytes)
                        for s in self.shards] +
                       [(g.data_ptr(), g.data_ptr() + g.numel() * g.element_size())
                        for g in self.gviews if g is not None])
        merged: list[tuple[int, int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

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
            self._point_grads_home()
        for shard in self.shards:
            for b, base in zip(shard.buckets, shard.bases):
                if not b.buffers:
                    base.zero_()
        for i in {i for i, *_ in self.pieces}:
            self.gviews[i].zero_()
        self.has_grad.fill(0)

    def _point_grads_home(self) -> None:
        """``zero_grad(set_to_none=False)`` where some ``.grad`` is not its view in place:
        each becomes its view (zeroed by the caller), a staged one is zeroed on its
        device."""
        staging, staged = self.staging, bool(self.staging)
        for i, (p, view) in enumerate(zip(self.params, self.gviews)):
            g = p.grad
            if g is None:
                continue
            if g is view:
                if self._moved(i, view):      # p.grad.data = x, or t_(), since
                    self._adopt_grad(i, p, self._rehome(i, view), view, copy=False)
                continue
            if staged and i in staging:
                g.zero_()                   # on its device, as torch does
            else:
                p.grad = view               # the fused buffer, zeroed below: no copy later

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
            self._take_grads(params, ids, grads_of(params, plain), views)
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

    def _take_grads(self, params: list[torch.Tensor], ids: list[int],
                    grads: list[torch.Tensor | None], views: list[torch.Tensor]) -> None:
        """``_prepare`` where some gradients are not their send buffer's views already."""
        staging = self.staging
        has, fresh, staged = self._has, [], bool(staging)
        for p, i, g, view in zip(params, ids, grads, views):
            if g is view and self._moved(i, view):     # p.grad.data = x, or t_()
                fresh.append((i, p, self._rehome(i, view), view))
            elif g is view:
                has[i] = 1
            elif g is None:
                if has[i]:
                    view.zero_()   # absent: zeros, so the other workers' sum is exact
                    has[i] = 0
            elif staged and i in staging:
                if g.layout is not torch.strided:
                    self._adopt_grad(i, p, g, view)     # refused: a sparse gradient
                staging.grad_to_host(i, g, view)
                has[i] = 1
            else:
                fresh.append((i, p, g, view))
        if fresh:
            self._adopt_grads(fresh)

    def _adopt_grads(self, fresh: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]
                     ) -> None:
        """``_adopt_grad`` for each ``(i, p, g, view)``; the copies in one call where every
        gradient is dense and of its parameter's shape and dtype (after ``zero_grad()``'s
        ``set_to_none=True``, torch's default, every gradient of a step comes here)."""
        has = self._has
        ids, params, grads, views = zip(*fresh)
        if any(lay is not torch.strided for lay in map(_layout_of, grads)) or \
                list(map(_dtype_of, grads)) != list(map(_dtype_of, views)) or \
                list(map(_shape_of, grads)) != list(map(_shape_of, views)) or \
                any(map(_requires_grad_of, grads)):
            for i, p, g, view in fresh:     # one by one: the first not taken raises, and
                self._adopt_grad(i, p, g, view)     # create_graph's gradients keep copy_'s graph
                has[i] = 1
            return
        torch._foreach_copy_(views, grads)    # (one already over its view: torch skips it)
        for i, p, view in zip(ids, params, views):
            p.grad = view
            has[i] = 1

    def _moved(self, i: int, view: torch.Tensor) -> bool:
        """Whether parameter ``i``'s gradient view no longer is the memory it was made as:
        given another tensor (``p.grad.data = x``) or other strides (``p.grad.t_()``)."""
        home = self.ghomes[i]
        return view.data_ptr() != self.gptrs[i] or view.stride() != home.stride() or \
            view.shape != home.shape

    def _in_grad_memory(self, g: torch.Tensor) -> bool:
        """Whether ``g`` shares memory with a gradient buffer (another parameter's buffer,
        or its own seen through other strides): taking it must read it before any buffer
        is written."""
        if g.layout is not torch.strided or g.device.type != "cpu":
            return False
        storage = g.untyped_storage()
        lo = storage.data_ptr()
        hi = lo + storage.nbytes()
        return any(lo < end and start < hi for start, end in self.guards)

    def _rehome(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s gradient view was given another tensor (``p.grad.data = x``)
        or other strides: point it back into the send buffer; returns the tensor it held
        (a copy where that lies in a gradient buffer, which the taking overwrites)."""
        held = view.detach()
        if self._in_grad_memory(held):
            held = held.clone()     # deliberate: read before the buffer is written
        torch._C.TensorBase.data.__set__(view, self.ghomes[i])
        return held

    def _adopt_grad(self, i: int, p: torch.Tensor, g: torch.Tensor, view: torch.Tensor,
                    copy: bool = True) -> None:
        """A gradient made outside the send buffer: copy it in (unless ``copy`` is False:
        ``zero_grad`` zeroes it), and keep using the buffer."""
        if g.layout is not torch.strided:
            raise TypeError(f"{self.label}: parameter {self.names[i]!r} has a sparse gradient "
                            f"({g.layout}) but is not the weight of an nn.Embedding or "
                            f"nn.EmbeddingBag with sparse=True, whose rows mpisync sends as "
                            f"rows; use such a module (or mpisync.Embedding), or a dense gradient")
        if g.shape != view.shape or g.dtype != view.dtype:
            raise ValueError(f"{self.label}: the gradient of parameter {self.names[i]!r} is "
                             f"{g.dtype} {list(g.shape)}, the parameter {view.dtype} "
                             f"{list(view.shape)}; .grad must have its parameter's shape and "
                             f"dtype")
        if copy and (g.data_ptr() != view.data_ptr() or g.stride() != view.stride()):
            view.copy_(g)              # deliberate: the gradient was made outside our buffer
        p.grad = view

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
                self._unalias()
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

    def _unalias(self) -> None:
        """Before the buckets' gradients are taken one bucket after another: a gradient
        given by hand that shares memory with a gradient buffer (another parameter's
        buffer or a view of it, ``a.grad, b.grad = b.grad.data, a.grad.data``) becomes a
        copy of it first."""
        grads = grads_of(self.params, self.plain)
        if all(map(operator.is_, grads, self.gviews)):
            return                      # a view's memory moved: _prepare brings it back
        for p, g, view in zip(self.params, grads, self.gviews):
            if g is not None and g is not view and self._in_grad_memory(g):
                p.grad = g.clone()     # deliberate: read before the buffer is written

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
            fields = shard.fields
            fields[GradField.KIND], fields[GradField.STEP] = Kind.GRAD, step
            fields[GradField.WORKER], fields[GradField.SEQ] = worker, seq
            fields[GradField.FLAGS] = (flags | (FLAG_ASSIGN if j in assigned else 0)
                                       | (FLAG_RESEND if j in resend else 0))
            np.take(self.has_grad, shard.idx, out=shard.mask)
            for out, current in shard.buffer_pairs:
                out.copy_(current)     # deliberate: the buffers' values travel with the step
            shard.head_send.Start()
            for k in range(shard.sent, len(shard.data_sends)):
                shard.send(k)
            self.counts["buckets"] += len(shard.data_sends)
            if j in resend:
                for pairs in shard.to_wire[:shard.sent]:
                    for dst, src in pairs:
                        dst.copy_(src)
                shard.full_send.Start()
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
            shard = self.shards[j]
            if shard.abuf is None:         # the header, then every value as the model has it
                shard.abuf = np.zeros(shard.header.nbytes + shard.gmem.nbytes, np.uint8)
            fields, _, _, mask = shard.header.views(shard.abuf)
            fields[GradField.KIND], fields[GradField.STEP] = Kind.ASSIGN, step
            fields[GradField.WORKER], fields[GradField.SEQ] = worker, seq
            mask[:] = 0
            mask[entries] = 1
            shard.abuf[shard.header.nbytes:] = shard.pmem[PARAM_HEADER_BYTES:]
            self.pending.append(self.comm.Isend([shard.abuf, MPI.BYTE],
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
            sent = shard.pfields[ParamField.STEP]
            if sent != step:
                raise ProtocolError(f"{self.label}: ps {j} sent parameters of step "
                                    f"{int(sent)} with token {step}")
            for pairs in shard.from_wire:
                for dst, src in pairs:
                    dst.copy_(src)
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


class ReplicatedChannel:
    """Parameters no optimizer group holds: the chief's values, broadcast once."""

    def __init__(self, worker_comm: MPI.Comm, tensors: list[torch.Tensor]):
        self.worker_comm = worker_comm
        self.tensors = tensors

    def setup(self) -> None:
        """Every worker takes the chief's values (collective over the workers)."""
        with torch.no_grad():
            for t in self.tensors:
                data = t.detach()
                if data.is_contiguous() and data.device.type == "cpu":
                    self.worker_comm.Bcast([_raw(data), MPI.BYTE], root=0)
                else:              # strided, or on a device: through a host copy
                    buf = data.contiguous().cpu()
                    self.worker_comm.Bcast([_raw(buf), MPI.BYTE], root=0)
                    data.copy_(buf)
