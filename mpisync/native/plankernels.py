"""A table step's row update from its taken pieces in one pass (``_plan.c``).

A step's gradient for a shard is its taken pieces: rows of ids (``(ids, None, None,
rows)``) and pooled bags (``(ids, bag, weights, grads)``: position ``i`` adds
``weights[i] * grads[bag[i]]``, weights None: 1). Each distinct id's gradient row is its
first row copied and the later ones added, in the pieces' order. ``plan`` notes, for each
distinct id, which rows of the pieces make it; ``axpy``, ``adagrad`` and ``rowwise`` then
sum a few ids' rows in a buffer that stays in cache and update them at once, instead of
writing every summed row into a buffer as large as the rows updated and passing over it
again (for Adagrad twice more: its new sums and torch's square root of them). The results
are bitwise ``rowkernels``' ``axpy_rows``, ``adagrad_sum_rows`` + torch's ``sqrt_`` +
``adagrad_apply_rows``, and ``rowwise_rows`` on the summed rows (``Plan.summed``), on
any number of the ps's threads (``tests/unit/test_ps_threads.py``, ``test_rowopt.py``).

Adagrad's square root must be torch's own, which on CPU is not always the correctly
rounded one: ``torch_sqrt`` finds the function torch calls (MKL's ``v?Sqrt`` in torch's
mode, where torch's library has it) or C's, and keeps the first that gives torch's results
bitwise on a sample of every exponent; where neither does, ``adagrad`` returns False and
the caller takes the unfused kernels.
"""
from __future__ import annotations

import ctypes
import glob
import math
import os

import torch

from .rowkernels import table_zeros as _table_zeros
from .rowslib import function as _fn
from .rowslib import library as _kernels
from .rowthreads import run as _run
from .rowthreads import split as _split

__all__ = ["Plan", "PlanMarks", "adagrad", "axpy", "plan", "rowwise", "torch_sqrt"]

# torch's mode for MKL's vector functions (ATen/cpu/vml.h: VML_HA | VML_FTZDAZ_OFF |
# VML_ERRMODE_IGNORE)
MKL_MODE = 0x2 | 0x140000 | 0x100
_MKL_SQRT = {torch.float32: "vmsSqrt", torch.float64: "vmdSqrt"}
_found: dict[torch.dtype, tuple[int | None, int] | None] = {}


class Plan:
    """A step's taken pieces, planned: ``ids`` (distinct, in first-seen order) and, for
    output row ``u``, the rows ``grads[src[e]] * wt[e]`` for ``e`` in ``start[u] ..
    start[u + 1] - 1``, summed in that order, as its gradient."""

    __slots__ = ("dim", "grads", "ids", "row_shape", "src", "start", "wt")

    def __init__(self, ids, start, src, wt, grads, row_shape):
        self.ids, self.start, self.src, self.wt, self.grads = ids, start, src, wt, grads
        self.row_shape = tuple(row_shape)
        self.dim = grads.shape[1]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.grads.dtype

    def _args(self) -> tuple:
        return (self.start.data_ptr(), self.src.data_ptr(), self.wt.data_ptr(),
                self.grads.data_ptr(), self.dim)

    def _each(self, call) -> None:
        """``call(lo, hi)`` over the output rows, split over the ps's threads."""
        count = len(self.ids)
        if count:
            _run(call, _split(count, len(self.src) * self.dim))

    def rows(self, out: torch.Tensor) -> torch.Tensor:
        """The summed gradient rows into ``out`` (at least ``len(self)`` rows)."""
        fn, args = _fn("plan_rows", self.dtype), self._args()
        out = out[:len(self.ids)]
        self._each(lambda lo, hi: fn(lo, hi, *args, out.data_ptr()))
        return out

    def summed(self, scratch=None) -> torch.Tensor:
        """``rows`` into ``scratch``'s buffer ``"planned"`` (``get(name, shape, dtype)``),
        or a new tensor."""
        shape = (len(self.ids), *self.row_shape)
        return self.rows(scratch.get("planned", shape, self.dtype) if scratch is not None
                         else torch.empty(shape, dtype=self.dtype))


class PlanMarks:
    """A shard's marks for its plans: one int64 per row, ``gen << 32 | row`` for an id the
    plan of generation ``gen`` has seen, anything else for none. Each plan takes the next
    generation, so that no plan passes over its ids again to clear them."""

    __slots__ = ("array", "gen")

    def __init__(self, num_rows: int):
        self.array = _table_zeros((num_rows,), torch.int64)
        self.gen = 0

    def __len__(self) -> int:
        return len(self.array)

    def next(self) -> int:
        """The next plan's generation (after 2^31 of them, the marks cleared once)."""
        self.gen += 1
        if self.gen >= 1 << 31:
            self.array.zero_()
            self.gen = 1
        return self.gen


def plan(pieces: list[tuple], marks: PlanMarks, scratch, row_shape) -> Plan:
    """``pieces`` (``(ids, None, None, rows)`` or ``(ids, bag, weights, grads)``, ids
    checked to lie in ``marks``, the shard's ``PlanMarks``) planned for rows of
    ``row_shape``. ``scratch`` (``get(name, shape, dtype)``) holds the plan's arrays until
    the next call."""
    lib = _kernels()
    dtype = pieces[0][3].dtype
    total = sum(len(p[0]) for p in pieces)
    if total >= 1 << 31:
        raise ValueError(f"a step of {total} ids for one shard: at most 2**31 - 1")
    gen = marks.next()
    pos = scratch.get("plan_pos", (total,), torch.int64)
    uniq = scratch.get("plan_ids", (total,), torch.int64)
    grow = scratch.get("plan_grow", (total,), torch.int64)
    wt = scratch.get("plan_wt", (total,), dtype)
    dim = math.prod(row_shape)
    blocks = [p[3].reshape(len(p[3]), dim) for p in pieces]
    grads = blocks[0].contiguous() if len(blocks) == 1 else torch.cat(
        blocks, out=scratch.get("plan_grads", (sum(len(b) for b in blocks), dim), dtype))
    count = at = base = 0
    for ids, bag, weights, rows in pieces:
        n = len(ids)
        ids = ids.contiguous()
        count = lib.scatter_marks(n, ids.data_ptr(), marks.array.data_ptr(), gen,
                                  uniq.data_ptr(), count, pos[at:].data_ptr())
        if bag is None:
            torch.arange(base, base + n, out=grow[at:at + n])
        else:
            torch.add(bag, base, out=grow[at:at + n])
        if weights is None:
            wt[at:at + n].fill_(1)
        else:
            wt[at:at + n].copy_(weights)
        at, base = at + n, base + len(rows)
    start = scratch.get("plan_start", (count + 1,), torch.int64)
    src = scratch.get("plan_src", (total,), torch.int64)
    swt = scratch.get("plan_swt", (total,), dtype)
    lib.plan_order(total, pos.data_ptr(), grow.data_ptr(), wt.data_ptr(), wt.element_size(),
                   count, start.data_ptr(), src.data_ptr(), swt.data_ptr())
    return Plan(uniq[:count], start, src, swt, grads, row_shape)


def axpy(p: Plan, sign: float, alpha: float, param: torch.Tensor, div: float = 0) -> None:
    """``rowkernels.axpy_rows`` with the plan's rows (``param`` contiguous)."""
    fn, args, ids = _fn("plan_axpy", p.dtype), p._args(), p.ids.data_ptr()
    p._each(lambda lo, hi: _ok(fn(lo, hi, ids, *args, div, sign, alpha, param.data_ptr())))


def adagrad(p: Plan, sign: float, eps: float, alpha: float, state_sum: torch.Tensor,
            param: torch.Tensor, div: float = 0) -> bool:
    """``adagrad_sum_rows``, torch's ``sqrt_`` of the new sums and ``adagrad_apply_rows``
    with the plan's rows, in one pass; False (nothing done) where torch's square root is
    not one this kernel can call (``torch_sqrt``)."""
    root = torch_sqrt(p.dtype)
    if root is None:
        return False
    _adagrad(p, sign, eps, alpha, state_sum, param, div, root)
    return True


def _adagrad(p: Plan, sign, eps, alpha, state_sum, param, div, root) -> None:
    fn, args, ids = _fn("plan_adagrad", p.dtype), p._args(), p.ids.data_ptr()
    ptr, mode = root
    p._each(lambda lo, hi: _ok(fn(lo, hi, ids, *args, div, sign, eps, alpha,
                                  state_sum.data_ptr(), param.data_ptr(), ptr, mode)))


def rowwise(p: Plan, sign: float, lr: float, eps: float, total: torch.Tensor,
            param: torch.Tensor, div: float = 0) -> None:
    """``rowkernels.rowwise_rows`` with the plan's rows (``total`` and ``param``
    contiguous)."""
    fn, args, ids = _fn("plan_rowwise", p.dtype), p._args(), p.ids.data_ptr()
    p._each(lambda lo, hi: _ok(fn(lo, hi, ids, *args, div, sign, lr, eps, total.data_ptr(),
                                  param.data_ptr())))


def _ok(status: int) -> None:
    if status != 0:
        raise MemoryError("mpisync: a row kernel could not allocate its row buffer")


def torch_sqrt(dtype: torch.dtype) -> tuple[int | None, int] | None:
    """(the address of the square root torch's CPU kernel calls, or None for C's; its mode)
    for ``dtype``, checked once per process; None where neither gives torch's results."""
    if dtype not in _found:
        _found[dtype] = next((c for c in _candidates(dtype) if _agrees(dtype, c)), None)
    return _found[dtype]


def _candidates(dtype: torch.dtype) -> list[tuple[int | None, int]]:
    """MKL's square root where torch's library exports it, then C's."""
    found: list[tuple[int | None, int]] = []
    name = _MKL_SQRT.get(dtype)
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib",
                                       "libtorch_cpu.*")):
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError, TypeError):
            continue
        found.append((ctypes.cast(fn, ctypes.c_void_p).value, MKL_MODE))
        break
    return [*found, (None, 0)]


def _agrees(dtype: torch.dtype, root: tuple[int | None, int]) -> bool:
    """Whether ``root`` gives torch's ``sqrt_``, bitwise, on a sample of every exponent: a
    uniform draw of the bit patterns of positive finite numbers, and their edges."""
    bits, mantissa = (32, 23) if dtype == torch.float32 else (64, 52)
    as_int = torch.int32 if bits == 32 else torch.int64
    top = ((1 << (bits - 1 - mantissa)) - 1) << mantissa            # +inf's pattern
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, top, (1 << 17,), generator=gen, dtype=torch.int64)
    raw = torch.cat([raw, torch.tensor([0, 1, (1 << mantissa) - 1, 1 << mantissa,
                                        top - 1])])
    x = raw.to(as_int).view(dtype)
    want = torch.sqrt(x)
    got = x.clone()
    ptr, mode = root
    _fn("plan_sqrt", dtype)(len(got), got.data_ptr(), ptr, mode)
    return torch.equal(got.view(as_int), want.view(as_int))
