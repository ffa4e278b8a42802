"""The row kernels: the ps's passes over a table step's taken rows, one loop each.

The ps's work on a table step is a few linear passes over the taken rows: turning pooled
bag gradients into row gradients, merging the workers' rows, and the optimizer's update.
In torch each pass is a sort, a gather and an ``index_add_`` (or several small kernels
per block); ``_rows.c`` does each in one loop, with the same operations in the same
order, so the results are bitwise the torch path's (``tests/unit/test_rowopt.py`` checks
both). The library is loaded by ``rowslib``; where ``available()`` is False the callers
use torch. Every function here expects ids already checked to lie in the shard. The
tables' memory (``table_zeros``) is made here too, for the rows these kernels reach at
random.

The functions that write output rows (every one but the id splits and ``mark_ids``'
passes) split a large call over the ps's threads (``rowthreads``): disjoint ranges of
output rows, each written by the same operations in the same order as one call makes,
so the result is bitwise the same with any number of threads. The update kernels'
``ids`` are distinct (as their callers give them): two ranges never write one row.
"""
from __future__ import annotations

import math
import mmap
import sys

import torch

from .rowslib import address as _ptr
from .rowslib import available
from .rowslib import function as _fn
from .rowslib import library as _kernels
from .rowthreads import PIECES
from .rowthreads import run as _run
from .rowthreads import split as _split

__all__ = [
    "adagrad_apply_rows",
    "adagrad_sum_rows",
    "all_below",
    "axpy_rows",
    "bag_offsets",
    "bag_rows",
    "bag_sums",
    "expand_offsets",
    "gather",
    "holds_distinct",
    "merge_pieces",
    "rowwise_rows",
    "set_flags",
    "shard_order",
    "slots_for",
    "split_ids",
    "table_copy",
    "table_zeros",
    "unique_inverse",
]


def _width(rows: torch.Tensor) -> int:
    """Elements per row (the product of every dimension but the first)."""
    return math.prod(rows.shape[1:])


HUGE_BYTES = 4 << 20          # tensors from this size on get huge pages (where there are)


def table_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeros for a table the row kernels reach at random (a shard, its optimizer state, its
    slot array): on Linux, from this size on, in private anonymous memory advised to use
    2 MiB pages (transparent huge pages, ``madvise``), so that random rows miss the TLB
    far less often (``docs/benchmarks.md``, "Figures behind choices in the code");
    elsewhere, or smaller, ``torch.zeros``. The memory is the kernel's
    zero pages until written, and freed with the tensor."""
    shape = tuple(shape)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_BYTES or not sys.platform.startswith("linux") or \
            not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    try:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:               # not allowed here: small pages, still zeros
        pass
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)   # keeps it alive


def table_copy(value):
    """A copy of a loaded table shard's tensor in ``table_zeros``' memory (others as is)."""
    if not torch.is_tensor(value) or value.device.type != "cpu" or \
            value.numel() * value.element_size() < HUGE_BYTES:
        return value.clone() if torch.is_tensor(value) else value
    return table_zeros(value.shape, value.dtype).copy_(value)


def all_below(values: torch.Tensor, limit: int) -> bool:
    """Whether every one of ``values`` lies in ``[0, limit)``: one pass (int64 on the CPU,
    where the kernels are built; else torch's ``min`` and ``max``)."""
    if not len(values):
        return True
    if _kernels() is None or values.dtype != torch.int64 or values.device.type != "cpu":
        return int(values.min()) >= 0 and int(values.max()) < limit
    values = values.contiguous()
    return bool(_kernels().all_below(len(values), values.data_ptr(), limit))


def bag_offsets(bag: torch.Tensor, num_bags: int) -> torch.Tensor | None:
    """Where each of ``num_bags`` bags starts in ``bag`` (int64, one a position) and where
    the last ends (``num_bags + 1`` offsets), or None where ``bag`` decreases somewhere or
    leaves ``[0, num_bags)``."""
    bag = bag.to(torch.int64).contiguous()
    if not available():
        if len(bag) and (int(bag.min()) < 0 or int(bag.max()) >= num_bags
                         or bool((bag[1:] < bag[:-1]).any())):
            return None
        return torch.searchsorted(bag, torch.arange(num_bags + 1))
    offsets = torch.empty(num_bags + 1, dtype=torch.int64)
    if _kernels().bag_offsets(len(bag), bag.data_ptr(), num_bags, offsets.data_ptr()) < 0:
        return None
    return offsets


def expand_offsets(offsets: torch.Tensor, n: int) -> torch.Tensor | None:
    """The bag of each of ``n`` positions from ``bag_offsets``' offsets, or None where they
    do not start at 0, end at ``n`` and never decrease."""
    offsets = offsets.contiguous()
    bags = len(offsets) - 1
    if not available():
        steps = offsets[1:] - offsets[:-1]
        if int(offsets[0]) != 0 or int(offsets[-1]) != n or bool((steps < 0).any()):
            return None
        return torch.repeat_interleave(torch.arange(bags), steps)
    bag = torch.empty(n, dtype=torch.int64)
    if _kernels().expand_offsets(bags, offsets.data_ptr(), n, bag.data_ptr()) < 0:
        return None
    return bag


def set_flags(ids: torch.Tensor, flags: torch.Tensor) -> None:
    """``flags[ids] = True`` (``flags`` a contiguous bool tensor, ids checked to lie in it)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    _kernels().set_flags(len(ids), ids.data_ptr(), flags.data_ptr())


def holds_distinct(ids: torch.Tensor, least: int) -> bool:
    """Whether ``ids`` (integers, each >= 0, any shape) hold at least ``least`` distinct
    values: counted in one pass that stops once it has seen them (no sort)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if least <= 0:
        return True
    if least > len(ids):
        return False
    count = _kernels().distinct_upto(len(ids), ids.data_ptr(), least)
    if count < 0:
        raise MemoryError("mpisync: no memory to count distinct ids")
    return count >= least


def unique_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` for integer ids on the CPU
    (int64 out), found with a hash table: only the distinct ids are sorted. Ids made to
    collide in the table, many that are nearly all distinct and spread wide, fewer than
    2,048 and more than 2**31 - 2 go to ``torch.unique``, which is as fast or faster there."""
    if ids.numel() < 2048:               # torch's sort is as fast here
        return torch.unique(ids.long(), sorted=True, return_inverse=True)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    n = len(flat)
    if n < 2 ** 31 - 1:                  # the kernel numbers the distinct ids in 32 bits
        uniq, inverse = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        count = _kernels().unique_inverse(n, flat.data_ptr(), uniq.data_ptr(),
                                          inverse.data_ptr())
        if count == -1:
            raise MemoryError("mpisync: no memory to find the distinct ids")
        if count >= 0:                   # a copy: not the whole batch's buffer behind it
            return uniq[:count].clone(), inverse.view(ids.shape)
    unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    return unique, inverse.view(ids.shape)


def slots_for(holder: dict, num_rows: int) -> torch.Tensor:
    """A shard's slot array (-1 everywhere), kept in ``holder`` from call to call."""
    slot = holder.get("slots")
    if slot is None or len(slot) != num_rows:
        slot = holder["slots"] = table_zeros((num_rows,), torch.int64).fill_(-1)
    return slot


def bag_rows(ids: torch.Tensor, bag: torch.Tensor, weights: torch.Tensor | None,
             grads: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted distinct ids, row gradients): row ``r`` gets the sum over the positions
    ``i`` with ``ids[i] == r`` of ``weights[i] * grads[bag[i]]``, added in order of ``i``.
    ``slot`` (``slots_for``) marks each id's output row during the call."""
    lib = _kernels()
    ids, bag, grads = ids.contiguous(), bag.contiguous(), grads.contiguous()
    weights = None if weights is None else weights.to(grads.dtype).contiguous()
    uniq = torch.empty(len(ids), dtype=torch.int64)
    count = lib.mark_ids(len(ids), ids.data_ptr(), slot.data_ptr(), uniq.data_ptr())
    try:                                  # the slots are clean again whatever happens
        found = uniq[:count].sort().values
        lib.place(count, found.data_ptr(), slot.data_ptr())
        out = torch.zeros(len(found), *grads.shape[1:], dtype=grads.dtype)
        fn, dim = _fn("bag_rows", grads.dtype), _width(grads)
        args = (len(ids), ids.data_ptr(), bag.data_ptr(), _ptr(weights), grads.data_ptr(),
                dim, slot.data_ptr())
        _run(lambda lo, hi: fn(*args, lo, hi, out.data_ptr()), _split(count, len(ids) * dim),
             pieces=1)                    # each range passes over every position
    finally:
        lib.unmark(count, uniq.data_ptr(), slot.data_ptr())
    return found, out


def bag_sums(ids: torch.Tensor, bag: torch.Tensor, weights: torch.Tensor | None,
             rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[bag[i]] += weights[i] * rows[ids[i]]`` in order of ``i`` (``out`` contiguous,
    ``rows`` contiguous: a shard). Each thread's bags are found by bisection where ``bag``
    never decreases (a lookup's bags come in order), else by a pass over every position."""
    ids, bag = ids.contiguous(), bag.contiguous()
    weights = None if weights is None else weights.to(rows.dtype).contiguous()
    dim = _width(rows)
    ranges = _split(len(out), len(ids) * dim)
    ordered = len(ranges) > 1 and _kernels().nondecreasing(len(bag), bag.data_ptr())
    fn = _fn("bag_sums_sorted" if ordered else "bag_sums", rows.dtype)
    args = (len(ids), ids.data_ptr(), bag.data_ptr(), _ptr(weights), rows.data_ptr(), dim)
    _run(lambda lo, hi: fn(*args, lo, hi, out.data_ptr()), ranges,
         pieces=PIECES if ordered else 1)


def gather(ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = rows[ids[i]]`` (``out`` and ``rows`` contiguous)."""
    ids = ids.contiguous()
    fn, dim = _fn("gather", rows.dtype), _width(rows)
    row = dim * rows.element_size()
    _run(lambda lo, hi: fn(hi - lo, ids.data_ptr() + 8 * lo, rows.data_ptr(), dim,
                           out.data_ptr() + row * lo), _split(len(ids), len(ids) * dim))


def shard_order(shard: torch.Tensor, parts: int) -> tuple[torch.Tensor, list[int]]:
    """The positions ordered by shard, stably, and each shard's count:
    ``(torch.argsort(shard, stable=True), torch.bincount(shard, minlength=parts))``,
    by counting where the kernels are available (every ``shard[i]`` in ``[0, parts)``),
    else by those torch calls."""
    if not available():
        return (torch.argsort(shard, stable=True),
                torch.bincount(shard, minlength=parts).tolist())
    shard = shard.to(torch.int64).contiguous()
    order = torch.empty(len(shard), dtype=torch.int64)
    counts = torch.empty(parts, dtype=torch.int64)
    starts = torch.empty(parts, dtype=torch.int64)
    _kernels().shard_order(len(shard), shard.data_ptr(), parts, counts.data_ptr(),
                           starts.data_ptr(), order.data_ptr())
    return order, counts.tolist()


def split_ids(ids: torch.Tensor, strategy: str, num_rows: int, parts: int
              ) -> tuple[torch.Tensor, list[int], torch.Tensor] | None:
    """``mpisync.protocol.partition.map_ids`` (``num_rows`` >= ``parts`` >= 1, or no rows) and the
    shard order in one pass: ``(order, counts, local rows in that order)``, ``order`` as
    ``torch.argsort(shard, stable=True)``; None when an id lies outside
    ``[0, num_rows)``."""
    ids = ids.to(torch.int64).contiguous()
    n = len(ids)
    counts, starts = torch.empty(parts, dtype=torch.int64), torch.empty(parts, dtype=torch.int64)
    shard, local, order, out = (torch.empty(n, dtype=torch.int64) for _ in range(4))
    if _kernels().split_ids(n, ids.data_ptr(), int(strategy == "div"), num_rows, parts,
                            counts.data_ptr(), starts.data_ptr(), shard.data_ptr(),
                            local.data_ptr(), order.data_ptr(), out.data_ptr()) < 0:
        return None
    return order, counts.tolist(), out


def merge_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], div: int,
                 out_for) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces of sorted distinct ids (and their rows) merged: (sorted distinct ids, rows);
    each id's first row copied, the later ones added in the pieces' order, the sums
    divided by ``div`` unless it is 0. ``out_for(n)`` gives the last output's n rows."""
    ids, rows = pieces[0]
    ids, rows = ids.contiguous(), rows.contiguous()
    merge = _fn("merge2_rows", rows.dtype)
    dim = _width(rows)
    for n, (more_ids, more) in enumerate(pieces[1:], 2):
        more_ids, more = more_ids.contiguous(), more.contiguous()
        cap, last = len(ids) + len(more_ids), n == len(pieces)
        out_ids = torch.empty(cap, dtype=torch.int64)
        out = out_for(cap) if last else torch.empty(cap, *rows.shape[1:], dtype=rows.dtype)
        if len(_split(cap, cap * dim)) > 1:
            k = _merge_threads(ids, rows, more_ids, more, dim, div if last else 0, out_ids,
                               out)
        else:
            k = merge(len(ids), ids.data_ptr(), rows.data_ptr(), len(more_ids),
                      more_ids.data_ptr(), more.data_ptr(), dim, div if last else 0,
                      out_ids.data_ptr(), out.data_ptr())
        ids, rows = out_ids[:k], out[:k]
    return ids, rows


def _merge_threads(ids: torch.Tensor, rows: torch.Tensor, more_ids: torch.Tensor,
                   more: torch.Tensor, dim: int, div: float, out_ids: torch.Tensor,
                   out: torch.Tensor) -> int:
    """``merge2_rows`` over threads: the merged order first (``merge2_plan``, one pass),
    then each thread's range of output rows."""
    cap = len(out_ids)
    from_a, from_b = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.int64)
    k = _kernels().merge2_plan(len(ids), ids.data_ptr(), len(more_ids), more_ids.data_ptr(),
                               out_ids.data_ptr(), from_a.data_ptr(), from_b.data_ptr())
    fill = _fn("merge2_fill", rows.dtype)
    _run(lambda lo, hi: fill(lo, hi, from_a.data_ptr(), rows.data_ptr(), from_b.data_ptr(),
                             more.data_ptr(), dim, div, out.data_ptr()), _split(k, k * dim))
    return k


def adagrad_sum_rows(ids: torch.Tensor, grad: torch.Tensor, sign: float,
                     state_sum: torch.Tensor, out: torch.Tensor, div: float = 0) -> torch.Tensor:
    """``x = sign * (grad / div)`` (div 0: grad); ``state_sum[ids] += x * x``;
    ``out = state_sum[ids]``, row by row (``state_sum`` contiguous, ``ids`` distinct)."""
    ids, grad = ids.contiguous(), grad.contiguous()
    fn, dim = _fn("adagrad_sum_rows", grad.dtype), _width(grad)
    row = dim * grad.element_size()
    _run(lambda lo, hi: fn(hi - lo, ids.data_ptr() + 8 * lo, grad.data_ptr() + row * lo, dim,
                           div, sign, state_sum.data_ptr(), out.data_ptr() + row * lo),
         _split(len(ids), len(ids) * dim))
    return out


def adagrad_apply_rows(ids: torch.Tensor, grad: torch.Tensor, std: torch.Tensor, sign: float,
                       eps: float, alpha: float, param: torch.Tensor, div: float = 0) -> None:
    """``param[ids] = fma(alpha, sign * (grad / div) / (std + eps), param[ids])``, row by row."""
    ids, grad, std = ids.contiguous(), grad.contiguous(), std.contiguous()
    fn, dim = _fn("adagrad_apply_rows", grad.dtype), _width(grad)
    row = dim * grad.element_size()
    _run(lambda lo, hi: fn(hi - lo, ids.data_ptr() + 8 * lo, grad.data_ptr() + row * lo,
                           std.data_ptr() + row * lo, dim, div, sign, eps, alpha,
                           param.data_ptr()), _split(len(ids), len(ids) * dim))


def axpy_rows(ids: torch.Tensor, grad: torch.Tensor, sign: float, alpha: float,
              param: torch.Tensor, div: float = 0) -> None:
    """``param[ids] = fma(alpha, sign * (grad / div), param[ids])``, row by row: torch's
    ``param.add_(sparse, alpha=alpha)`` (an axpy per row, which fuses)."""
    ids, grad = ids.contiguous(), grad.contiguous()
    fn, dim = _fn("axpy_rows", grad.dtype), _width(grad)
    row = dim * grad.element_size()
    _run(lambda lo, hi: fn(hi - lo, ids.data_ptr() + 8 * lo, grad.data_ptr() + row * lo, dim,
                           div, sign, alpha, param.data_ptr()), _split(len(ids), len(ids) * dim))


def rowwise_rows(ids: torch.Tensor | None, grad: torch.Tensor, sign: float, lr: float,
                 eps: float, total: torch.Tensor, param: torch.Tensor, div: float = 0) -> None:
    """Row-wise Adagrad on the rows ``ids`` of ``param`` (None: every row, in order) with
    gradient rows ``grad``: ``g = sign * (grad / div)``; ``total[id] += (g[0]**2 + g[1]**2 +
    ...) / width``, summed in column order; ``param[id] += g * -(lr / (sqrt(total[id]) +
    eps))`` (``mpisync.tables.rowwise`` has the same in torch). ``total`` and ``param``
    contiguous."""
    grad = grad.contiguous()
    ids = None if ids is None else ids.contiguous()
    fn, dim = _fn("rowwise_rows", grad.dtype), _width(grad)
    row, size = dim * grad.element_size(), grad.element_size()

    def part(lo: int, hi: int) -> None:
        if ids is not None:          # rows ids[lo:hi]
            fn(hi - lo, ids.data_ptr() + 8 * lo, grad.data_ptr() + row * lo, dim, div, sign,
               lr, eps, total.data_ptr(), param.data_ptr())
        else:                        # rows lo..hi-1: the kernel counts from the pointers
            fn(hi - lo, None, grad.data_ptr() + row * lo, dim, div, sign, lr, eps,
               total.data_ptr() + size * lo, param.data_ptr() + row * lo)

    _run(part, _split(len(grad), len(grad) * dim))
