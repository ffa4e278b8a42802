"""The worker's side of pooled lookups: one message per ps rank for every table of a batch.

``exchange(channel, requests)`` looks up rows (as ``RowsChannel.lookup``) or pooled bags
for several tables of one ``RowsChannel`` at once; ``pooled_sections`` builds what a push
adds for the bags pooled since the last one (see ``mpisync.protocol.pooled`` for the layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI

from ..native import kernels
from ..protocol.bags import Bags
from ..protocol.pooled import (
    EXCHANGE,
    POOLED,
    Part,
    as_lookup_nbytes,
    block_order,
    pack_as_lookup,
    pack_parts,
    parts_nbytes,
    pooled_only,
    reply_nbytes,
)
from ..protocol.wire import Tag, pad8

__all__ = ["Request", "Section", "exchange", "pooled_sections", "split"]


@dataclass
class Request:
    """One table's share of a lookup: the rows of ``unique`` (sorted unique ids), or ``bags``
    pooled at the owners."""

    index: int                        # the table, in the channel's order
    unique: torch.Tensor | None = None
    bags: Bags | None = None


@dataclass
class Pooled:
    """A pooled lookup whose gradient goes with the next push: its parts per shard, the
    sums' leaf (its ``.grad``: each bag's gradient)."""

    parts: list[Part | None]
    num_bags: int
    leaf: torch.Tensor


@dataclass
class Section:
    """What a push to one ps rank adds for the bags pooled there: its parts and gradient
    blocks, or (``seq`` not None) the blocks alone, naming the lookup ``seq`` whose parts
    they are (``pooled.AS_LOOKUP``: the ps rank kept them)."""

    parts: list[Part | None]
    blocks: list[torch.Tensor]
    seq: int | None = None

    def nbytes(self) -> int:
        return parts_nbytes(self.parts, self.blocks) if self.seq is None else \
            as_lookup_nbytes(self.blocks)

    def pack(self, into, start: int):
        """Written into ``into`` after its first ``start`` bytes: ``into[:start + nbytes]``."""
        if self.seq is None:
            return pack_parts(POOLED, self.parts, self.blocks, into, start)
        return pack_as_lookup(self.seq, len(self.parts), self.blocks, into, start)


def split(t, ids: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Ids of table ``t`` by shard: ``(order, counts, local rows)``: the positions ordered
    by shard (stably), each shard's count, the local rows in that order (in one compiled
    pass for a ``"mod"`` or ``"div"`` table where ``mpisync.native.kernels`` is available;
    a table of one shard keeps its ids as they are)."""
    if t.hashed is None and t.num_shards == 1 and ids.dtype == torch.int64 and \
            kernels.all_below(ids, t.num_rows):
        return torch.arange(len(ids)), [len(ids)], ids
    if t.hashed is None and kernels.available():
        got = kernels.split_ids(ids, t.strategy, t.num_rows, t.num_shards)
        if got is not None:
            return got
    shard, local = t.locate(ids)                # (ids outside the table: its error)
    order, counts = kernels.shard_order(shard, t.num_shards)
    return order, counts, local[order]


def _split_rows(t, unique: torch.Tensor):
    order, counts, local = split(t, unique)
    parts = [Part(ids) if len(ids) else None for ids in torch.split(local, counts)]
    return parts, torch.split(order, counts)


def _split_bags(t, bags: Bags) -> list[Part | None]:
    order, counts, local = split(t, bags.ids)
    if t.num_shards == 1:       # the positions in their order (the bags' own copies)
        return [Part(local, bags.bag, bags.weights, bags.num_bags) if len(local) else None]
    ids = torch.split(local, counts)
    bag = torch.split(bags.bag.index_select(0, order), counts)
    weights = (None,) * t.num_shards if bags.weights is None else \
        torch.split(bags.weights.index_select(0, order), counts)
    return [Part(i, b, w, bags.num_bags) if len(i) else None
            for i, b, w in zip(ids, bag, weights)]


def exchange(channel, requests: list[Request]) -> list[torch.Tensor]:
    """Rows or pooled sums for each request: one message to each ps rank concerned, all at once.

    Returns, per request, the rows of its unique ids, or its bags' sums of (weighted)
    rows (``num_bags`` x row); with autograd on, leaves whose gradient the next push sends.
    """
    tables = channel.tables
    split: dict[int, tuple] = {}
    for r in requests:
        t = tables[r.index].spec
        split[r.index] = _split_rows(t, r.unique) if r.bags is None else \
            (_split_bags(t, r.bags), None)
    outs = []
    for r in requests:
        t = tables[r.index].spec
        n = len(r.unique) if r.bags is None else r.bags.num_bags
        init = torch.empty if r.bags is None else torch.zeros
        outs.append(init(n, *t.row_shape, dtype=t.dtype))
    groups_on = [[i for i, _ in shards] for shards in channel.on_ps]
    reqs, replies = [], []
    for j, shards in enumerate(channel.on_ps):
        parts = [split[i][0][k] if i in split else None for i, k in shards]
        if not any(p is not None for p in parts):
            continue
        row_bytes = [tables[i].spec.row_bytes for i, _ in shards]
        # buffers kept from call to call: both are done with when this call returns
        channel.exchanged[j] = (channel.exchanged[j][0] + 1, pooled_only(parts))
        msg = pack_parts(EXCHANGE, parts, [],
                         channel.buffer(("lookup", j), parts_nbytes(parts, [])),
                         seq=channel.exchanged[j][0])
        size = reply_nbytes(parts, groups_on[j], row_bytes)
        reply = channel.buffer(("reply", j), size)[:size]
        rank = channel.cluster.ps_rank(j)
        reqs.append(channel.comm.Isend([msg, MPI.BYTE], dest=rank,
                                       tag=channel.tags[Tag.LOOKUP]))
        reqs.append(channel.comm.Irecv([reply, MPI.BYTE], source=rank,
                                       tag=channel.tags[Tag.ROWS]))
        replies.append((j, parts, reply, msg))
        channel.count_lookup(j, msg.nbytes, reply.nbytes)
    names = ", ".join(repr(tables[r.index].spec.name) for r in requests)
    channel.poller.wait_all(reqs, lambda: f"lookups of tables {names} from the ps ranks")
    slot = {r.index: n for n, r in enumerate(requests)}
    for j, parts, reply, _ in replies:
        at, filled = 0, set()
        view = torch.from_numpy(reply)
        for (i, k), p in zip(channel.on_ps[j], parts):
            if p is None:
                continue
            t, out = tables[i].spec, outs[slot[i]]
            if not p.pooled:
                nbytes = len(p.ids) * t.row_bytes
                out[split[i][1][k]] = view[at:at + nbytes].view(t.dtype).view(-1, *t.row_shape)
                at += pad8(nbytes)
            elif i not in filled:
                filled.add(i)
                nbytes = p.num_bags * t.row_bytes
                out += view[at:at + nbytes].view(t.dtype).view(-1, *t.row_shape)
                at += pad8(nbytes)
    _keep(channel, requests, outs, split)
    return outs


def _keep(channel, requests: list[Request], outs: list[torch.Tensor], split: dict) -> None:
    """The outputs of the tables that take a gradient now (``_Table.takes_grad``) become
    leaves whose gradients the next push sends."""
    for r, out in zip(requests, outs):
        table = channel.tables[r.index]
        if not table.takes_grad():
            continue
        out.requires_grad_(True)
        if channel.on_grad is not None:
            out.register_post_accumulate_grad_hook(channel.on_grad)
        if r.bags is None:
            table.pending.append((r.unique, out))
        else:
            table.pooled.append(Pooled(split[r.index][0], r.bags.num_bags, out))


def _merge(table) -> tuple[list[Part | None], torch.Tensor] | None:
    """The pooled lookups of one table since the last push that got a gradient, as one:
    their bags numbered one after another."""
    got = [p for p in table.pooled if p.leaf.grad is not None]
    table.pooled = []
    if not got:
        return None
    if len(got) == 1:
        return got[0].parts, got[0].leaf.grad
    spec = table.spec
    parts: list[Part | None] = []
    total = sum(p.num_bags for p in got)
    for k in range(spec.num_shards):
        pieces, base = [], 0
        for p in got:
            if p.parts[k] is not None:
                pieces.append((p.parts[k], base))
            base += p.num_bags
        if not pieces:
            parts.append(None)
            continue
        weighted = any(q.weights is not None for q, _ in pieces)
        weights = torch.cat([q.weights if q.weights is not None else
                             torch.ones(len(q.ids), dtype=spec.dtype) for q, _ in pieces]) \
            if weighted else None
        parts.append(Part(torch.cat([q.ids for q, _ in pieces]),
                          torch.cat([q.bag + b for q, b in pieces]), weights, total))
    return parts, torch.cat([p.leaf.grad for p in got])


def pooled_sections(channel) -> list[Section | None]:
    """Per ps rank, what this push's pooled section holds, or None (no pooled gradient for
    it). Where its parts are the very pooled parts of the last lookup to that ps rank (one
    forward since the last push, the usual case), the section names that lookup."""
    merged = {i: m for i, table in enumerate(channel.tables)
              if table.pooled and (m := _merge(table)) is not None}
    out: list[Section | None] = []
    for j, shards in enumerate(channel.on_ps):
        parts = [merged[i][0][k] if i in merged else None for i, k in shards]
        if not any(p is not None for p in parts):
            out.append(None)
            continue
        order = block_order(parts, [i for i, _ in shards])
        seq, sent = channel.exchanged[j]
        same = len(sent) == len(parts) and all(a is b for a, b in zip(parts, sent))
        out.append(Section(parts, [merged[i][1] for i in order], seq if same else None))
    return out
