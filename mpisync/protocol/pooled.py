"""Lookups of several tables in one message, and bags pooled where their rows live (no MPI).

A worker's lookup to one ps rank has a part per shard held there (as a rows lookup):
absent, a *rows* part (local ids; their rows come back) or a *pooled* part (local ids,
the bag of each, their weights; the ps sums its rows per bag). The pooled parts of one
table share one block in the reply: ``num_bags`` rows, the sum over that ps's shards. A
push carries the same pooled parts after its rows message, and one block per table: the
gradient of each bag's sum; the ps turns it into the gradient of each row on arrival.

A push whose pooled parts are those of the worker's last lookup to that ps rank (one
forward a step, the usual case) names that lookup instead (``AS_LOOKUP``, the lookup's
sequence number): the ps rank kept its parts, checked, when it answered it, so the ids,
bags and weights travel once a step and are checked once.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ..native import kernels
from .rowsmsg import rows_counts
from .wire import ROWS_HEAD, RowsField, pad8

__all__ = ["AS_LOOKUP", "EXCHANGE", "POOLED", "Part", "answer", "as_lookup_nbytes",
           "bag_grads", "block_order", "gather_rows", "lookup_seq", "pack_as_lookup",
           "pack_parts", "parts_nbytes", "pooled_only", "reply_nbytes", "row_grads", "rows_of",
           "rows_section_nbytes", "unpack_parts"]

EXCHANGE = -2   # RowsField.MARK of a lookup in this layout (a rows lookup, ``pack_rows``, -1)
POOLED = -3     # RowsField.MARK of a push's pooled section, after its rows message
AS_LOOKUP = -4  # ... of one whose parts are those of the lookup of its SEQ: blocks alone
HEAD = RowsField.COUNT    # int64 words: [mark, 0, parts] (RowsField), then per part:
PER_PART = 3              # [count, num_bags, flags]
WEIGHTED = 1              # flags: the part has weights
AS_OFFSETS = 2            # flags: its bags as num_bags + 1 offsets (bags never decreasing)


@dataclass
class Part:
    """One shard's piece: local ids, and for a pooled part their bags and weights."""

    ids: torch.Tensor
    bag: torch.Tensor | None = None          # None: a rows part
    weights: torch.Tensor | None = None      # None: every weight is 1
    num_bags: int = -1
    # the bags as they travel: offsets where they never decrease (a lookup's bags come in
    # order: num_bags + 1 words instead of one a position), else the bag of each position;
    # found once (``wire_bags``), for the lookup and again for the push
    wire: tuple[torch.Tensor, int] | None = field(default=None, repr=False, compare=False)

    @property
    def pooled(self) -> bool:
        return self.bag is not None

    def wire_bags(self) -> tuple[torch.Tensor, int]:
        """(what a message holds of the bags, its flag: ``AS_OFFSETS`` or 0)."""
        if self.bag is None:
            raise ValueError("a rows part has no bags")
        if self.wire is None:
            offsets = kernels.bag_offsets(self.bag, self.num_bags) if self.num_bags > 0 \
                else None
            self.wire = (self.bag.reshape(-1), 0) if offsets is None else (offsets, AS_OFFSETS)
        return self.wire


def parts_nbytes(parts: list[Part | None], blocks: list[torch.Tensor]) -> int:
    """The bytes of ``pack_parts(mark, parts, blocks)``."""
    size = 8 * (HEAD + PER_PART * len(parts))
    for p in parts:
        if p is not None:
            size += 8 * (len(p.ids) + (len(p.wire_bags()[0]) if p.pooled else 0))
            if p.weights is not None:
                size += pad8(p.weights.numel() * p.weights.element_size())
    return size + sum(pad8(b.numel() * b.element_size()) for b in blocks)


def pack_parts(mark: int, parts: list[Part | None], blocks: list[torch.Tensor],
               into: np.ndarray | None = None, start: int = 0, seq: int = 0) -> np.ndarray:
    """One message: ``[mark, seq, n]``, per part ``[count, num_bags (-1: rows), flags]``
    (``WEIGHTED``, ``AS_OFFSETS``), then each part's ids, bags (``Part.wire_bags``) and
    weights (8-byte padded), then ``blocks`` (each padded). ``seq``: a lookup's number
    among the worker's lookups to that ps rank, which a push may name (``AS_LOOKUP``).

    ``into``: a byte buffer to write it into from ``start`` (``into[:start]`` is left as
    it is; the result is ``into[:start + size]``); default a new one.
    """
    size = parts_nbytes(parts, blocks)
    if into is None:
        into, start = np.empty(size, np.uint8), 0
    buf = into[start:start + size]
    words = buf[:8 * (HEAD + PER_PART * len(parts))].view(np.int64)
    words[RowsField.MARK], words[RowsField.SEQ] = mark, seq
    words[RowsField.PARTS] = len(parts)
    at = len(words) * 8
    for n, p in enumerate(parts):
        if p is None:
            words[HEAD + PER_PART * n:HEAD + PER_PART * (n + 1)] = (0, -1, 0)
            continue
        bags, flag = p.wire_bags() if p.pooled else (None, 0)
        words[HEAD + PER_PART * n:HEAD + PER_PART * (n + 1)] = (
            len(p.ids), p.num_bags if p.pooled else -1,
            (WEIGHTED if p.weights is not None else 0) | flag)
        at = _put_all(buf, at, [t.reshape(-1) for t in (p.ids, bags, p.weights)
                                if t is not None])
    _put_all(buf, at, blocks)
    return into[:start + size]


def pack_as_lookup(seq: int, num_parts: int, blocks: list[torch.Tensor], into: np.ndarray,
                   start: int) -> np.ndarray:
    """A push's pooled section that names the lookup ``seq`` for its parts (of
    ``num_parts``): ``[AS_LOOKUP, seq, num_parts]``, then ``blocks`` (each padded), written
    into ``into`` from ``start``; the result is ``into[:start + size]``."""
    size = as_lookup_nbytes(blocks)
    words = into[start:start + 8 * HEAD].view(np.int64)
    words[RowsField.MARK], words[RowsField.SEQ] = AS_LOOKUP, seq
    words[RowsField.PARTS] = num_parts
    _put_all(into[start:start + size], 8 * HEAD, blocks)
    return into[:start + size]


def pooled_only(parts: list[Part | None]) -> list[Part | None]:
    """A lookup's pooled parts, the others None: what a push that names the lookup
    (``pack_as_lookup``) stands for, kept alike by the worker and the ps."""
    return [p if p is not None and p.pooled else None for p in parts]


def as_lookup_nbytes(blocks: list[torch.Tensor]) -> int:
    """The bytes of ``pack_as_lookup`` with ``blocks``."""
    return 8 * HEAD + sum(pad8(b.numel() * b.element_size()) for b in blocks)


def _put_all(buf: np.ndarray, at: int, tensors: list[torch.Tensor]) -> int:
    """Each tensor's bytes into ``buf`` from ``at`` on, each padded to 8 with zeros; the
    offset after the last."""
    out = torch.from_numpy(buf)
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out[at:at + nbytes].view(t.dtype).view(t.shape).copy_(t)
        buf[at + nbytes:at + pad8(nbytes)] = 0
        at += pad8(nbytes)
    return at


def unpack_parts(buf: np.ndarray, dtypes: list[torch.dtype], start: int = 0
                 ) -> tuple[int, list[Part | None], int]:
    """The inverse of ``pack_parts`` up to the blocks: ``(mark, parts, blocks' offset)``.

    ``dtypes`` gives each part's weight dtype (its table's). The parts are views into ``buf``.

    Raises:
        ValueError: the message does not have the parts or the bytes expected.
    """
    if buf.nbytes < start + 8 * HEAD:
        raise ValueError(f"a lookup of {buf.nbytes - start} bytes, too short for its header")
    head = buf[start:start + 8 * HEAD].view(np.int64)
    mark, n = int(head[RowsField.MARK]), int(head[RowsField.PARTS])
    if n != len(dtypes):
        raise ValueError(f"a lookup with {n} parts, expected {len(dtypes)}")
    at = start + 8 * (HEAD + PER_PART * n)
    if buf.nbytes < at:
        raise ValueError(f"a lookup of {buf.nbytes - start} bytes, too short for {n} parts")
    words = buf[start + 8 * HEAD:at].view(np.int64).reshape(n, PER_PART).tolist()
    t = torch.from_numpy(buf)
    parts: list[Part | None] = []
    for (count, num_bags, flags), dtype in zip(words, dtypes):
        if count == 0:
            parts.append(None)
            continue
        weighted, as_offsets = flags & WEIGHTED, flags & AS_OFFSETS and num_bags >= 0
        bag_words = 0 if num_bags < 0 else num_bags + 1 if as_offsets else count
        need = 8 * (count + bag_words) + (pad8(count * dtype.itemsize) if weighted else 0)
        if count < 0 or at + need > buf.nbytes:
            raise ValueError(f"a lookup of {buf.nbytes - start} bytes, too short for its parts")
        ids = t[at:at + 8 * count].view(torch.int64)
        at += 8 * count
        bag = weights = wire = None
        if num_bags >= 0:
            bag = t[at:at + 8 * bag_words].view(torch.int64)
            at += 8 * bag_words
            if as_offsets:
                wire = (bag, AS_OFFSETS)
                bag = kernels.expand_offsets(bag, count)
                if bag is None:
                    raise ValueError("a lookup whose bags' offsets do not run from 0 to its "
                                     "count in order")
        if weighted:
            weights = t[at:at + count * dtype.itemsize].view(dtype)
            at += pad8(count * dtype.itemsize)
        parts.append(Part(ids, bag, weights, num_bags, wire))
    return mark, parts, at


def block_order(parts: list[Part | None], groups: list[int]) -> list[int]:
    """The tables (``groups[n]`` of part ``n``) with a pooled part, in their first part's order:
    the order of their blocks."""
    seen: list[int] = []
    for p, g in zip(parts, groups):
        if p is not None and p.pooled and g not in seen:
            seen.append(g)
    return seen


def reply_nbytes(parts: list[Part | None], groups: list[int], row_bytes: list[int]) -> int:
    """The bytes of the reply to a lookup of ``parts`` (``row_bytes`` per part's table)."""
    size, blocked = 0, set()
    for p, g, rb in zip(parts, groups, row_bytes):
        if p is None:
            continue
        if not p.pooled:
            size += pad8(len(p.ids) * rb)
        elif g not in blocked:
            blocked.add(g)
            size += pad8(p.num_bags * rb)
    return size


def _check(p: Part, rows: int, what: str) -> None:
    if not kernels.all_below(p.ids, rows):
        raise ValueError(f"{what} of rows outside its shard ({rows} rows)")
    if p.pooled and (p.num_bags <= 0 or not kernels.all_below(p.bag, p.num_bags)):
        raise ValueError(f"{what} with bags outside [0, {p.num_bags})")


def answer(buf: np.ndarray, params: list[torch.Tensor], groups: list[int],
           read: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
           kept: list | None = None) -> np.ndarray:
    """The ps's reply to a lookup: each rows part's rows, each table's pooled sums.

    ``params[n]`` is the shard of part ``n`` (local rows), ``groups[n]`` its table. The
    rows and sums are written straight into the reply: each part's rows gathered, each
    table's block of sums added up row after row in the order of its parts and their ids
    (``out[bag[i]] += weight[i] * row[ids[i]]``; compiled where ``mpisync.native.kernels`` is
    available, the same additions in torch otherwise). ``read[n]``: the rows of part
    ``n``'s ids come from it (a hash shard: its ids are any int64, a lookup sights them),
    never pooled.

    ``kept``: where the lookup's ``[seq, pooled parts]`` go, for ``bag_grads``.

    Raises:
        ValueError: a malformed lookup.
    """
    read = read or {}
    _, parts, at = unpack_parts(buf, [p.dtype for p in params])
    if at != buf.nbytes:
        raise ValueError(f"a lookup of {buf.nbytes} bytes, expected {at}")
    _check_lookup(parts, params, groups, read)
    if kept is not None:     # the pooled parts, checked, for a push that names them
        kept[:] = [lookup_seq(buf), pooled_only(parts)]
    reply = np.empty(reply_nbytes(parts, groups, [_row_bytes(p) for p in params]), np.uint8)
    out, at, blocks = torch.from_numpy(reply), 0, {}
    for u, (p, param, g) in enumerate(zip(parts, params, groups)):
        if p is None:
            continue
        rows = param.detach()
        n = len(p.ids) if not p.pooled else p.num_bags
        if p.pooled and g in blocks:
            _add_bags(p, rows, blocks[g])
            continue
        nbytes = n * _row_bytes(param)
        view = out[at:at + nbytes].view(param.dtype).view(n, *param.shape[1:])
        at += pad8(nbytes)
        if u in read:
            view.copy_(read[u](p.ids))
            continue
        if not p.pooled:
            gather_rows(p.ids, rows, view)
            continue
        blocks[g] = view.zero_()
        _add_bags(p, rows, view)
    return reply


def _check_lookup(parts: list[Part | None], params: list[torch.Tensor], groups: list[int],
                  read: Mapping) -> None:
    """A lookup's parts lie in their shards, no hash shard's is pooled, and the pooled
    parts of one table have one number of bags (else ValueError)."""
    bags: dict[int, int] = {}
    for n, (p, param, g) in enumerate(zip(parts, params, groups)):
        if p is None:
            continue
        if n in read:
            if p.pooled:
                raise ValueError("a lookup of bags pooled from a hash shard")
            continue
        _check(p, param.shape[0], "a lookup")
        if p.pooled and bags.setdefault(g, p.num_bags) != p.num_bags:
            raise ValueError(f"a lookup whose parts of one table have {bags[g]} and "
                             f"{p.num_bags} bags")


def _row_bytes(param: torch.Tensor) -> int:
    return math.prod(param.shape[1:]) * param.element_size()


def gather_rows(ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = rows[ids[i]]`` (ids checked to lie in ``rows``)."""
    if kernels.available(rows) and rows.is_contiguous():
        kernels.gather(ids, rows, out)
    else:
        torch.index_select(rows, 0, ids, out=out)


def _add_bags(p: Part, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[bag[i]] += weights[i] * rows[ids[i]]``, in order of ``i``."""
    weights = None if p.weights is None else p.weights.to(rows.dtype)
    if kernels.available(rows) and rows.is_contiguous():
        kernels.bag_sums(p.ids, p.bag, weights, rows, out)
        return
    each = rows[p.ids]
    if weights is not None:
        each.mul_(weights.view(-1, *[1] * (each.dim() - 1)))
    out.index_add_(0, p.bag, each)


def rows_section_nbytes(buf: np.ndarray, kinds: list[tuple[torch.dtype, tuple[int, ...]]]
                        ) -> int:
    """Where a rows message (``rowsmsg.pack_rows``, ids and values) ends inside ``buf``."""
    n = len(kinds)
    counts = [max(c, 0) for c in rows_counts(buf, n)]
    size = 8 * (ROWS_HEAD + n) + 8 * sum(counts)
    for c, (dtype, shape) in zip(counts, kinds):
        size += pad8(c * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return size


def lookup_seq(buf: np.ndarray, start: int = 0) -> int:
    """The sequence number in the header of a lookup or pooled section at ``start``."""
    return int(buf[start:start + 8 * HEAD].view(np.int64)[RowsField.SEQ])


def bag_grads(buf: np.ndarray, start: int, params: list[torch.Tensor], groups: list[int],
              last: list | None = None) -> list[tuple[Part, torch.Tensor] | None]:
    """A push's pooled section (from ``start``), checked: per part, the part and its
    table's bag gradients (``num_bags`` rows), views into ``buf``; None for no pooled part.
    A section that names a lookup (``AS_LOOKUP``) takes its parts from ``last``, the
    ``[seq, parts]`` that ``answer(kept=)`` kept of the sender's last lookup, checked then.

    Raises:
        ValueError: a malformed section, or one that names another lookup than ``last``.
    """
    if buf.nbytes >= start + 8 * HEAD and \
            int(buf[start:start + 8].view(np.int64)[0]) == AS_LOOKUP:
        seq, n = lookup_seq(buf, start), int(buf[start:start + 8 * HEAD].view(np.int64)[
            RowsField.PARTS])
        if not last or last[0] != seq or n != len(params):
            raise ValueError(f"a push whose pooled parts are those of its lookup {seq} "
                             f"({n} parts), but its last lookup here was "
                             f"{last[0] if last else None} ({len(params)} parts)")
        mark, parts, at, checked = AS_LOOKUP, last[1], start + 8 * HEAD, True
    else:
        mark, parts, at = unpack_parts(buf, [p.dtype for p in params], start)
        checked = False
    if mark not in (POOLED, AS_LOOKUP):
        raise ValueError(f"a push's pooled section marked {mark}, expected {POOLED}")
    grads: dict[int, torch.Tensor] = {}
    t = torch.from_numpy(buf)
    for g in block_order(parts, groups):
        n = next(n for n, (p, h) in enumerate(zip(parts, groups)) if h == g and p is not None
                 and p.pooled)
        shape = (parts[n].num_bags, *params[n].shape[1:])
        nbytes = math.prod(shape) * params[n].element_size()
        if at + nbytes > buf.nbytes:
            raise ValueError(f"a push of {buf.nbytes} bytes, too short for its pooled gradients")
        grads[g] = t[at:at + nbytes].view(params[n].dtype).view(shape)
        at += pad8(nbytes)
    if at != buf.nbytes:
        raise ValueError(f"a push of {buf.nbytes} bytes, expected {at}")
    out: list[tuple[Part, torch.Tensor] | None] = []
    for p, param, g in zip(parts, params, groups):
        if p is None or not p.pooled:
            out.append(None)
            continue
        if not checked:
            _check(p, param.shape[0], "a push")
        if grads[g].shape[0] != p.num_bags:
            raise ValueError(f"a push whose parts of one table have {grads[g].shape[0]} and "
                             f"{p.num_bags} bags")
        out.append((p, grads[g]))
    return out


def rows_of(p: Part, grads: torch.Tensor, num_rows: int, scratch=None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled part's bag gradients as (sorted unique local ids, row gradients).

    Each id's row gets its bag's gradient times its weight; an id met several times gets
    the sum, added in the order the ids came (with ``scratch``, the ``rowopt.RowScratch``
    of the shard of ``num_rows`` rows, in one compiled pass where ``mpisync.native.kernels`` is
    available).
    """
    if scratch is not None and kernels.available(grads) and grads.is_contiguous() and (
            p.weights is None or p.weights.dtype == grads.dtype):
        return kernels.bag_rows(p.ids, p.bag, p.weights, grads, scratch.slots(num_rows))
    each = grads[p.bag]
    if p.weights is not None:
        each.mul_(p.weights.view(-1, *[1] * (each.dim() - 1)))
    ids, inverse = torch.unique(p.ids, sorted=True, return_inverse=True)
    summed = torch.zeros(len(ids), *grads.shape[1:], dtype=grads.dtype)
    return ids, summed.index_add_(0, inverse, each)


def row_grads(buf: np.ndarray, start: int, params: list[torch.Tensor], groups: list[int],
              scratches: list | None = None, last: list | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """A push's pooled section (from ``start``): per part, (unique local ids, row gradients)
    (``bag_grads``, with ``last``, then ``rows_of``; ``scratches``: each part's
    ``rowopt.RowScratch``).

    Raises:
        ValueError: a malformed section.
    """
    return [None if got is None else
            rows_of(*got, params[n].shape[0], None if scratches is None else scratches[n])
            for n, got in enumerate(bag_grads(buf, start, params, groups, last))]
