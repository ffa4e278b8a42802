"""Compiled row kernels for the ps (``_rows.c``), with the torch code as the fallback.

The ps's work on a table step is a few linear passes over the taken rows: turning pooled
bag gradients into row gradients, merging the workers' rows, and the optimizer's update.
In torch each pass is a sort, a gather and an ``index_add_`` (or several small kernels
per block); ``_rows.c`` does each in one loop, with the same operations in the same
order, so the results are bitwise the torch path's (``tests/test_rowopt.py`` checks
both). It is compiled once per machine with the C compiler (``cc``, or ``$CC``) into
``$MPISYNC_CACHE`` (default ``~/.cache/mpisync``) and loaded with ``ctypes``; where there
is no compiler, or ``MPISYNC_ROW_KERNELS=0``, ``available()`` is False and the callers
use torch. Every function here expects ids already checked to lie in the shard.

``dense_mean`` is the dense step's reduce on the ps (``ps/parameters.py``): the taken
gradients' sum and, for a power-of-two count, mean in one pass, which also tells whether
they are finite (the ``nonfinite="raise"`` check), bitwise torch's add and multiply.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from .. import environ
from . import build

__all__ = [
    "adagrad_apply_rows",
    "adagrad_exact",
    "adagrad_settings",
    "adagrad_sum_rows",
    "adam_exact",
    "adam_settings",
    "available",
    "axpy_rows",
    "bag_rows",
    "bag_sums",
    "dense_adagrad",
    "dense_adam",
    "dense_mean",
    "dense_rmsprop",
    "dense_sgd",
    "gather",
    "merge_pieces",
    "rmsprop_exact",
    "rmsprop_keys",
    "rmsprop_settings",
    "rowwise_rows",
    "scatter",
    "sgd_exact",
    "sgd_settings",
    "shard_order",
    "slots_for",
    "split_ids",
    "table_copy",
    "table_zeros",
]

_SOURCE = Path(__file__).with_name("_rows.c")
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-march=native", "-fPIC", "-shared"]
_lib: ctypes.CDLL | None | bool = False          # False: not tried yet
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _build() -> ctypes.CDLL | None:
    """The library (``build.load``); None without a compiler."""
    if not environ.switch("MPISYNC_ROW_KERNELS"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib, why = build.load("rows", _SOURCE, [cc, *_FLAGS], ["-lm"], _declare)
    if lib is None:
        warnings.warn(f"mpisync: the row kernels ({_SOURCE.name}) could not be built "
                      f"({why}); the ps's row updates and dense reduce run on torch, bitwise "
                      f"the same and slower (MPISYNC_ROW_KERNELS=0 silences this)",
                      RuntimeWarning, stacklevel=3)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The argument types of every function (AttributeError: one is missing)."""
    lib.mark_ids.restype = _I
    lib.mark_ids.argtypes = [_I, _P, _P, _P]
    lib.unmark.argtypes = [_I, _P, _P]
    lib.place.argtypes = [_I, _P, _P]
    lib.shard_order.argtypes = [_I, _P, _I, _P, _P, _P]
    lib.split_ids.argtypes = [_I, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P]
    lib.split_ids.restype = _I
    for s in _SUFFIX.values():
        real = ctypes.c_float if s == "f32" else ctypes.c_double
        getattr(lib, f"bag_rows_{s}").argtypes = [_I, _P, _P, _P, _P, _I, _P, _P]
        scatter = getattr(lib, f"scatter_{s}")
        scatter.argtypes = [_I, _P, _P, _P, _P, _I, _P, _P, _I, _P]
        scatter.restype = _I
        getattr(lib, f"bag_sums_{s}").argtypes = [_I, _P, _P, _P, _P, _I, _P]
        getattr(lib, f"gather_{s}").argtypes = [_I, _P, _P, _I, _P]
        merge = getattr(lib, f"merge2_rows_{s}")
        merge.argtypes = [_I, _P, _P, _I, _P, _P, _I, real, _P, _P]
        merge.restype = _I
        getattr(lib, f"adagrad_sum_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, _P, _P]
        getattr(lib, f"adagrad_apply_rows_{s}").argtypes = [_I, _P, _P, _P, _I, real, real,
                                                           real, real, _P]
        getattr(lib, f"axpy_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, real, _P]
        getattr(lib, f"rowwise_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, real, real,
                                                     _P, _P]
        dense = getattr(lib, f"dense_mean_{s}")
        dense.argtypes = [_I, _P, _I, ctypes.c_int, real, _P]
        dense.restype = _I
        sgd = getattr(lib, f"dense_sgd_{s}")
        sgd.argtypes = [_I, _P, _I, real, _P, ctypes.c_int, _P, _P, real, ctypes.c_int, real,
                        real, real]
        sgd.restype = _I
        moments = getattr(lib, f"adam_moments_{s}")
        moments.argtypes = [_I, _P, _I, real, _P, _P, _P, _P, ctypes.c_int, real, ctypes.c_int,
                            real, ctypes.c_int, real, real, real]
        moments.restype = _I
        getattr(lib, f"adam_update_{s}").argtypes = [_I, _P, _P, _P, real, real, real]
        sums = getattr(lib, f"adagrad_sums_{s}")
        sums.argtypes = [_I, _P, _I, real, _P, _P, _P, ctypes.c_int, real]
        sums.restype = _I
        getattr(lib, f"adagrad_update_{s}").argtypes = [_I, _P, _P, _P, ctypes.c_int, real,
                                                        real, real]
        squares = getattr(lib, f"rmsprop_sums_{s}")
        squares.argtypes = [_I, _P, _I, real, _P, _P, _P, _P, _P, ctypes.c_int, real, real, real,
                            ctypes.c_int]
        squares.restype = _I
        getattr(lib, f"rmsprop_update_{s}").argtypes = [_I, _P, _P, _P, _P, ctypes.c_int, real,
                                                        real, real, real]


def _kernels() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = _build()
    return _lib


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels are loaded and take these tensors (float32/float64, on CPU)."""
    if _kernels() is None:
        return False
    return all(t.device.type == "cpu" and t.dtype in _SUFFIX for t in tensors)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _width(rows: torch.Tensor) -> int:
    """Elements per row (the product of every dimension but the first)."""
    return math.prod(rows.shape[1:])


def _fn(name: str, dtype: torch.dtype):
    return getattr(_kernels(), f"{name}_{_SUFFIX[dtype]}")


HUGE_BYTES = 4 << 20          # tensors from this size on get huge pages (where there are)


def table_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeros for a table the row kernels reach at random (a shard, its optimizer state, its
    slot array): on Linux, from this size on, in private anonymous memory advised to use
    2 MiB pages (transparent huge pages, ``madvise``), so that random rows miss the TLB
    far less often (the row-wise update of 75,000 random rows of a 500,000 x 64 shard:
    4.2 -> 2.6 ms); elsewhere, or smaller, ``torch.zeros``. The memory is the kernel's
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
        _fn("bag_rows", grads.dtype)(len(ids), ids.data_ptr(), bag.data_ptr(), _ptr(weights),
                                     grads.data_ptr(), _width(grads), slot.data_ptr(),
                                     out.data_ptr())
    finally:
        lib.unmark(count, uniq.data_ptr(), slot.data_ptr())
    return found, out


def scatter(pieces: list[tuple], slot: torch.Tensor, uniq: torch.Tensor,
            out: torch.Tensor) -> int:
    """A step's taken rows summed per id in one pass: the number of distinct ids.

    ``pieces``, in the order their rows are added: ``(ids, None, None, rows)`` (row ``i``
    of id ``ids[i]``) or ``(ids, bag, weights, grads)`` (``weights[i] * grads[bag[i]]``,
    weights None: 1). Each id's first row is copied into ``out``, the later ones added
    one after another; the ids go to ``uniq`` in first-seen order (``uniq`` and ``out``
    hold at least as many rows as all the pieces). ``slot`` (``slots_for``, ids checked
    to lie in it) is clean again after the call.
    """
    lib = _kernels()
    count = 0
    try:
        for ids, bag, weights, rows in pieces:
            ids, rows = ids.contiguous(), rows.contiguous()
            bag = None if bag is None else bag.contiguous()
            weights = None if weights is None else weights.to(rows.dtype).contiguous()
            count = _fn("scatter", rows.dtype)(
                len(ids), ids.data_ptr(), _ptr(bag), _ptr(weights), rows.data_ptr(),
                _width(rows), slot.data_ptr(), uniq.data_ptr(), count, out.data_ptr())
    finally:
        lib.unmark(count, uniq.data_ptr(), slot.data_ptr())
    return count


def bag_sums(ids: torch.Tensor, bag: torch.Tensor, weights: torch.Tensor | None,
             rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[bag[i]] += weights[i] * rows[ids[i]]`` in order of ``i`` (``out`` contiguous,
    ``rows`` contiguous: a shard)."""
    ids, bag = ids.contiguous(), bag.contiguous()
    weights = None if weights is None else weights.to(rows.dtype).contiguous()
    _fn("bag_sums", rows.dtype)(len(ids), ids.data_ptr(), bag.data_ptr(), _ptr(weights),
                                rows.data_ptr(), _width(rows), out.data_ptr())


def gather(ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = rows[ids[i]]`` (``out`` and ``rows`` contiguous)."""
    ids = ids.contiguous()
    _fn("gather", rows.dtype)(len(ids), ids.data_ptr(), rows.data_ptr(), _width(rows),
                              out.data_ptr())


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
        k = merge(len(ids), ids.data_ptr(), rows.data_ptr(), len(more_ids), more_ids.data_ptr(),
                  more.data_ptr(), dim, div if last else 0, out_ids.data_ptr(), out.data_ptr())
        ids, rows = out_ids[:k], out[:k]
    return ids, rows


def adagrad_sum_rows(ids: torch.Tensor, grad: torch.Tensor, sign: float,
                     state_sum: torch.Tensor, out: torch.Tensor, div: float = 0) -> torch.Tensor:
    """``x = sign * (grad / div)`` (div 0: grad); ``state_sum[ids] += x * x``;
    ``out = state_sum[ids]``, row by row (``state_sum`` contiguous, ``ids`` distinct)."""
    ids, grad = ids.contiguous(), grad.contiguous()
    _fn("adagrad_sum_rows", grad.dtype)(len(ids), ids.data_ptr(), grad.data_ptr(), _width(grad),
                                        div, sign, state_sum.data_ptr(), out.data_ptr())
    return out


def adagrad_apply_rows(ids: torch.Tensor, grad: torch.Tensor, std: torch.Tensor, sign: float,
                       eps: float, alpha: float, param: torch.Tensor, div: float = 0) -> None:
    """``param[ids] = fma(alpha, sign * (grad / div) / (std + eps), param[ids])``, row by row."""
    ids, grad, std = ids.contiguous(), grad.contiguous(), std.contiguous()
    _fn("adagrad_apply_rows", grad.dtype)(len(ids), ids.data_ptr(), grad.data_ptr(),
                                          std.data_ptr(), _width(grad), div, sign, eps, alpha,
                                          param.data_ptr())


def axpy_rows(ids: torch.Tensor, grad: torch.Tensor, sign: float, alpha: float,
              param: torch.Tensor, div: float = 0) -> None:
    """``param[ids] = fma(alpha, sign * (grad / div), param[ids])``, row by row: torch's
    ``param.add_(sparse, alpha=alpha)`` (an axpy per row, which fuses)."""
    ids, grad = ids.contiguous(), grad.contiguous()
    _fn("axpy_rows", grad.dtype)(len(ids), ids.data_ptr(), grad.data_ptr(), _width(grad), div,
                                 sign, alpha, param.data_ptr())


def rowwise_rows(ids: torch.Tensor | None, grad: torch.Tensor, sign: float, lr: float,
                 eps: float, total: torch.Tensor, param: torch.Tensor, div: float = 0) -> None:
    """Row-wise Adagrad on the rows ``ids`` of ``param`` (None: every row, in order) with
    gradient rows ``grad``: ``g = sign * (grad / div)``; ``total[id] += (g[0]**2 + g[1]**2 +
    ...) / width``, summed in column order; ``param[id] += g * -(lr / (sqrt(total[id]) +
    eps))`` (``mpisync.tables.rowwise`` has the same in torch). ``total`` and ``param``
    contiguous."""
    grad = grad.contiguous()
    ids = None if ids is None else ids.contiguous()
    _fn("rowwise_rows", grad.dtype)(len(grad), _ptr(ids), grad.data_ptr(), _width(grad), div,
                                    sign, lr, eps, total.data_ptr(), param.data_ptr())


def _ptrs(grads: list[torch.Tensor], at: int):
    """The gradients' addresses, each ``at`` bytes in, as a C array of pointers."""
    return (ctypes.c_void_p * len(grads))(*[g.data_ptr() + at for g in grads])


def _small_weight(w: float, dtype: torch.dtype) -> bool:
    """torch's ``lerp`` test on its weight ``w`` as the kernel holds it (in ``dtype``):
    ``|w| < 0.5``, the branch that adds to the start rather than to the end."""
    held = ctypes.c_float(w).value if dtype == torch.float32 else float(w)
    return abs(held) < 0.5


def dense_mean(out: torch.Tensor, grads: list[torch.Tensor], scale: bool) -> bool:
    """``out`` = the sum of ``grads`` in order (contiguous, of ``out``'s dtype and size),
    times ``1 / len(grads)`` where ``scale`` (a power of two only: bitwise the mean);
    in one pass for two gradients. Returns whether every element of ``out`` is finite."""
    ptrs = _ptrs(grads, 0)
    return bool(_fn("dense_mean", out.dtype)(out.numel(), ptrs, len(grads), int(scale),
                                             1.0 / len(grads), out.data_ptr()))


def dense_sgd(out: torch.Tensor, grads: list[torch.Tensor], runs, store: bool = True) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.SGD's step of the parameters with it. ``runs``: ``(offset,
    param, momentum buffer or None, settings)`` covering ``out``, each ``param`` (and
    buffer) contiguous, of ``out``'s dtype, for ``out[offset:offset + param.numel()]``;
    settings as ``sgd_settings`` gives them for that dtype. Without ``store`` the means
    are not written (``out`` is scratch then, its values undefined). Returns whether every
    mean is finite (the parameters are stepped either way)."""
    fn = _fn("dense_sgd", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, buf, settings in runs:
        at = offset * size
        ptrs = _ptrs(grads, at)
        finite &= bool(fn(param.numel(), ptrs, len(grads), 1.0 / len(grads),
                          out.data_ptr() + at, int(store), param.data_ptr(), _ptr(buf),
                          *settings))
    return finite


def sgd_settings(group: dict, dtype: torch.dtype = torch.float32) -> tuple | None:
    """A torch.optim.SGD param group's settings as ``dense_sgd`` takes them for parameters
    of ``dtype``: (-lr, whether weight decay, weight decay, momentum, 1 - dampening). None
    where the kernel does not do what the group asks (``nesterov``, ``maximize``,
    ``fused``, ``differentiable``, ``capturable``), where a hyper-parameter is not a plain
    number (a tensor learning rate), where torch would convert one differently (an int
    beyond 2**53, which ctypes rounds twice) or refuse it (a learning rate, weight decay or
    ``1 - dampening`` beyond the dtype's range: torch raises, the ps keeps to torch)."""
    values = [group.get(k) for k in ("lr", "momentum", "dampening", "weight_decay")]
    if any(type(v) not in (float, int) for v in values) or any(group.get(k) for k in (
            "nesterov", "maximize", "fused", "differentiable", "capturable")):
        return None
    lr, mom, damp, wd = values
    alphas = (-lr, wd, 1 - damp)           # what torch converts with a range check
    top = torch.finfo(dtype).max
    if any(type(v) is int and abs(v) > 2 ** 53 for v in (*alphas, mom)) or \
            any(math.isfinite(v) and abs(v) > top for v in alphas):
        return None
    return -lr, int(wd != 0), wd, mom, 1 - damp


#: the compiled steps' checks against torch: (kernel, dtype, kind of group) -> bitwise
_EXACT: dict[tuple, bool] = {}


def _checked(kind: tuple, probe: Callable[[], bool]) -> bool:
    """``probe()``, once per ``kind`` (its kernel, dtype and kind of group)."""
    known = _EXACT.get(kind)
    if known is None:
        known = _EXACT[kind] = probe()
    return known


def sgd_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_sgd`` steps bitwise as torch.optim.SGD does on this machine, for a
    group with these options (False where ``sgd_settings`` refuses it; checked once per
    dtype and kind of group, on a probe of odd length: the vectorized body and the tail
    alike). Torch rounds ``add_(x, alpha=a)`` as one fused multiply-add; a build that does
    not would fail here, and the ps keeps to torch's step."""
    if sgd_settings(group, dtype) is None:
        return False
    kind = ("sgd", dtype, group["momentum"] != 0, group["dampening"] != 0,
            group["weight_decay"] != 0, group.get("foreach"))
    return _checked(kind, lambda: _sgd_probe(*kind[1:]))


def _sgd_probe(dtype: torch.dtype, momentum: bool, dampening: bool, decay: bool,
               foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(7)
    n = 4099
    # every product about the size of what it is added to, so that rounding it apart from
    # the sum (two roundings instead of one) changes hundreds of elements
    opts = {"lr": 0.7, "momentum": 0.9 if momentum else 0.0,
            "dampening": 0.3 if dampening else 0.0, "weight_decay": 0.3 if decay else 0.0,
            "foreach": foreach}
    start = torch.randn(n, generator=gen, dtype=dtype)
    first = torch.randn(n, generator=gen, dtype=dtype)
    grads = [torch.randn(n, generator=gen, dtype=dtype) for _ in range(2)]
    param = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([param], **opts)
    param.grad = first
    opt.step()                              # the momentum buffer made
    buf = opt.state[param].get("momentum_buffer")
    mine_p = param.detach().clone()
    mine_buf = None if buf is None else buf.clone()
    param.grad = (grads[0] + grads[1]) * 0.5
    opt.step()
    out = torch.empty(n, dtype=dtype)
    dense_sgd(out, grads, [(0, mine_p, mine_buf, sgd_settings(opt.param_groups[0], dtype))])
    return torch.equal(out, param.grad) and torch.equal(mine_p, param.detach()) and (
        buf is None or torch.equal(mine_buf, opt.state[param]["momentum_buffer"]))


def dense_adam(out: torch.Tensor, grads: list[torch.Tensor], runs, scratch: torch.Tensor) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.Adam's (or AdamW's) step of the moments with it; then
    torch's square root of the second moments into ``scratch`` (as long as the longest
    run, of ``out``'s dtype) and a second pass that steps the parameters. ``runs``:
    ``(offset, param, exp_avg, exp_avg_sq, settings)`` covering ``out``, each tensor
    contiguous, of ``out``'s dtype, for ``out[offset:offset + param.numel()]``; settings
    as ``adam_settings`` gives them for the step. The ``step`` counts are the caller's.
    Returns whether every element of ``out`` is finite (the parameters are stepped either
    way)."""
    moments, update = _fn("adam_moments", out.dtype), _fn("adam_update", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, exp_avg, exp_avg_sq, settings in runs:
        at, n = offset * size, param.numel()
        ptrs = _ptrs(grads, at)
        finite &= bool(moments(n, ptrs, len(grads), 1.0 / len(grads), out.data_ptr() + at,
                               param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                               *settings[:8]))
        root = scratch[:n]
        torch.sqrt(exp_avg_sq.view(-1), out=root)
        update(n, param.data_ptr(), exp_avg.data_ptr(), root.data_ptr(), *settings[8:])
    return finite


_ADAM_OFF = ("amsgrad", "maximize", "fused", "differentiable", "capturable")


def adam_settings(group: dict, dtype: torch.dtype, step: float) -> tuple | None:
    """A torch.optim.Adam or AdamW param group's settings as ``dense_adam`` takes them for
    parameters of ``dtype`` at ``step`` (the count after this step's increment), computed
    as torch computes them (the bias corrections in Python's floats): (whether weight
    decay, weight decay, whether decoupled, 1 - lr * weight decay, whether ``|1 - beta1|``
    < 0.5 in ``dtype``, 1 - beta1, beta2, 1 - beta2, sqrt of the second bias correction,
    eps, -step size). None where the kernel does not do what the group asks (``amsgrad``,
    ``maximize``, ``fused``, ``differentiable``, ``capturable``), where a hyper-parameter
    is not a plain number (a tensor learning rate or beta), where torch would convert one
    differently (an int beyond 2**53) or refuse it (a value beyond the dtype's range, a
    bias correction of zero), or where Python's arithmetic leaves the reals. The first
    eight are ``adam_moments``'s, the last three ``adam_update``'s."""
    betas = group.get("betas")
    if type(betas) not in (tuple, list) or len(betas) != 2 or any(group.get(k) for k in _ADAM_OFF):
        return None
    lr, eps, wd = group.get("lr"), group.get("eps"), group.get("weight_decay")
    beta1, beta2 = betas
    if any(type(v) not in (float, int) for v in (lr, eps, wd, beta1, beta2)):
        return None
    decoupled = bool(group.get("decoupled_weight_decay", False))
    try:                                      # torch's own arithmetic, in its order
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        keep = 1 - lr * wd
    except (ZeroDivisionError, OverflowError):
        return None
    w1 = 1 - beta1
    values = (wd, keep, w1, beta2, 1 - beta2, bias_correction2_sqrt, eps, -step_size)
    top = torch.finfo(dtype).max
    if any(type(v) not in (float, int) for v in values) or \
            any(type(v) is int and abs(v) > 2 ** 53 for v in values) or \
            any(math.isfinite(v) and abs(v) > top for v in values):
        return None
    small = _small_weight(w1, dtype)
    return (int(wd != 0 and not decoupled), wd, int(wd != 0 and decoupled), keep, int(small),
            *values[2:])


def adam_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_adam`` steps bitwise as torch.optim.Adam (AdamW) does on this
    machine for a group with these options (False where ``adam_settings`` refuses it at
    step 1; checked once per dtype and kind of group on a probe of odd length, the
    vectorized body and the tail alike, with hyper-parameters that make every rounding
    show: each product about the size of what it is added to)."""
    if adam_settings(group, dtype, 1.0) is None:
        return False
    decoupled = bool(group.get("decoupled_weight_decay", False))
    small = _small_weight(1 - group["betas"][0], dtype)
    kind = ("adam", dtype, decoupled, group["weight_decay"] != 0, small, group.get("foreach"))
    return _checked(kind, lambda: _adam_probe(*kind[1:]))


def _adam_probe(dtype: torch.dtype, decoupled: bool, decay: bool, small: bool,
                foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(11)
    n = 4099
    opts = {"lr": 0.7, "betas": (0.6 if small else 0.2, 0.3), "eps": 0.3,
            "weight_decay": 0.3 if decay else 0.0, "foreach": foreach,
            "decoupled_weight_decay": decoupled}
    param = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = torch.optim.Adam([param], **opts)
    for _ in range(2):                      # the moments made, the bias corrections not 0
        param.grad = torch.randn(n, generator=gen, dtype=dtype)
        opt.step()
    return _probe_step(opt, param, ("exp_avg", "exp_avg_sq"), adam_settings, dense_adam, gen)


def dense_adagrad(out: torch.Tensor, grads: list[torch.Tensor], runs, scratch: torch.Tensor
                  ) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.Adagrad's update of the squared sums with it; then torch's
    square root of the sums into ``scratch`` (as long as the longest run, of ``out``'s
    dtype) and a second pass that steps the parameters. ``runs``: ``(offset, param, sum,
    settings)`` covering ``out`` (each tensor contiguous, of ``out``'s dtype, for
    ``out[offset:offset + param.numel()]``), settings as ``adagrad_settings`` gives them.
    The ``step`` counts are the caller's. Returns whether every element of ``out`` is
    finite (the parameters are stepped either way)."""
    sums, update = _fn("adagrad_sums", out.dtype), _fn("adagrad_update", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, state_sum, (decay, wd, eps, neg_clr) in runs:
        at, n = offset * size, param.numel()
        ptrs = _ptrs(grads, at)
        finite &= bool(sums(n, ptrs, len(grads), 1.0 / len(grads), out.data_ptr() + at,
                            param.data_ptr(), state_sum.data_ptr(), decay, wd))
        root = scratch[:n]
        torch.sqrt(state_sum.view(-1), out=root)
        update(n, param.data_ptr(), out.data_ptr() + at, root.data_ptr(), decay, wd, eps,
               neg_clr)
    return finite


def adagrad_settings(group: dict, dtype: torch.dtype, step: float) -> tuple | None:
    """A torch.optim.Adagrad param group's settings as ``dense_adagrad`` takes them for
    parameters of ``dtype`` at ``step`` (the count after this step's increment), computed
    as torch computes them: (whether weight decay, weight decay, eps, -lr / (1 + (step - 1)
    * lr_decay)). None where the kernel does not do what the group asks (``maximize``,
    ``fused``, ``differentiable``), where a hyper-parameter is not a plain number, where
    torch would convert one differently (an int beyond 2**53) or refuse it (beyond the
    dtype's range, a learning rate divided by zero)."""
    if any(group.get(k) for k in ("maximize", "fused", "differentiable")):
        return None
    lr, decay, wd, eps = (group.get(k) for k in ("lr", "lr_decay", "weight_decay", "eps"))
    if any(type(v) not in (float, int) for v in (lr, decay, wd, eps)):
        return None
    try:                                      # torch's own arithmetic, in its order
        clr = lr / (1 + (step - 1) * decay)
    except (ZeroDivisionError, OverflowError):
        return None
    values = (wd, eps, -clr)
    top = torch.finfo(dtype).max
    if any(type(v) is int and abs(v) > 2 ** 53 for v in values) or \
            any(math.isfinite(v) and abs(v) > top for v in values):
        return None
    return int(wd != 0), *values


def adagrad_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_adagrad`` steps bitwise as torch.optim.Adagrad does on this machine
    for a group with these options (False where ``adagrad_settings`` refuses it at step 1;
    checked once per dtype and kind of group, as ``adam_exact``)."""
    if adagrad_settings(group, dtype, 1.0) is None:
        return False
    kind = ("adagrad", dtype, group["weight_decay"] != 0, group.get("foreach"))
    return _checked(kind, lambda: _adagrad_probe(*kind[1:]))


def _adagrad_probe(dtype: torch.dtype, decay: bool, foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(13)
    n = 4099
    param = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = torch.optim.Adagrad([param], lr=0.7, lr_decay=0.1, eps=0.3,
                              weight_decay=0.3 if decay else 0.0,
                              initial_accumulator_value=0.5, foreach=foreach)
    param.grad = torch.randn(n, generator=gen, dtype=dtype)
    opt.step()
    return _probe_step(opt, param, ("sum",), adagrad_settings, dense_adagrad, gen)


def dense_rmsprop(out: torch.Tensor, grads: list[torch.Tensor], runs, scratch: torch.Tensor
                  ) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.RMSprop's update of the square averages (and, centered, of
    the gradient averages and the centered values, into ``scratch``) with it; then torch's
    square root into ``scratch`` (as long as the longest run, of ``out``'s dtype) and a
    second pass that steps the momentum buffers and the parameters. ``runs``: ``(offset,
    param, square_avg, grad_avg if centered, momentum_buffer if momentum, settings)`` (the
    state ``rmsprop_keys`` names, in its order) covering ``out``, each tensor contiguous,
    of ``out``'s dtype, for ``out[offset:offset + param.numel()]``; settings as
    ``rmsprop_settings`` gives them. The ``step`` counts are the caller's. Returns whether
    every element of ``out`` is finite (the parameters are stepped either way)."""
    squares, update = _fn("rmsprop_sums", out.dtype), _fn("rmsprop_update", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, square_avg, *more, settings in runs:
        centered, momentum, decay, wd, alpha, s, small, eps, mom, neg_lr = settings
        grad_avg = more[0] if centered else None
        buf = more[-1] if momentum else None
        at, n = offset * size, param.numel()
        root = scratch[:n]
        finite &= bool(squares(n, _ptrs(grads, at), len(grads), 1.0 / len(grads),
                               out.data_ptr() + at, param.data_ptr(), square_avg.data_ptr(),
                               _ptr(grad_avg), root.data_ptr(), decay, wd, alpha, s, small))
        torch.sqrt(root if centered else square_avg.view(-1), out=root)
        update(n, param.data_ptr(), out.data_ptr() + at, root.data_ptr(), _ptr(buf), decay,
               wd, eps, mom, neg_lr)
    return finite


def rmsprop_keys(group: dict) -> tuple[str, ...]:
    """The state torch.optim.RMSprop steps for a param group, in ``dense_rmsprop``'s
    order: ``square_avg``, ``grad_avg`` where centered, ``momentum_buffer`` where the
    momentum is above zero (torch's step tests the group so)."""
    mom = group.get("momentum")
    return ("square_avg", *(("grad_avg",) if group.get("centered") else ()),
            *(("momentum_buffer",) if type(mom) in (float, int) and mom > 0 else ()))


def rmsprop_settings(group: dict, dtype: torch.dtype, step: float = 1.0) -> tuple | None:
    """A torch.optim.RMSprop param group's settings as ``dense_rmsprop`` takes them for
    parameters of ``dtype`` (RMSprop's update does not read its ``step``): (whether
    centered, whether momentum, whether weight decay, weight decay, alpha, 1 - alpha,
    whether ``|1 - alpha|`` < 0.5 in ``dtype`` (``lerp``'s branch), eps, momentum, -lr).
    None where the kernel does not do what the group asks (``maximize``, ``fused``,
    ``differentiable``, ``capturable``), where a hyper-parameter is not a plain number (a
    tensor learning rate, a NumPy float), where torch would convert one differently (an
    int beyond 2**53, which ctypes rounds twice) or refuse it (beyond the dtype's
    range)."""
    if any(group.get(k) for k in ("maximize", "fused", "differentiable", "capturable")):
        return None
    lr, alpha, eps, wd, mom = (group.get(k) for k in ("lr", "alpha", "eps", "weight_decay",
                                                      "momentum"))
    if any(type(v) not in (float, int) for v in (lr, alpha, eps, wd, mom)):
        return None
    s = 1 - alpha                              # torch's own arithmetic
    values = (wd, alpha, s, eps, mom, -lr)
    top = torch.finfo(dtype).max
    if any(type(v) is int and abs(v) > 2 ** 53 for v in values) or \
            any(math.isfinite(v) and abs(v) > top for v in values):
        return None
    centered = bool(group.get("centered"))
    return (centered, mom > 0, int(wd != 0), wd, alpha, s,
            int(centered and _small_weight(s, dtype)), eps, mom, -lr)


def rmsprop_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_rmsprop`` steps bitwise as torch.optim.RMSprop does on this machine
    for a group with these options (False where ``rmsprop_settings`` refuses it; checked
    once per dtype and kind of group, as ``adam_exact``: centered or not, with ``lerp``'s
    branch, momentum or not, weight decay or not, ``foreach``)."""
    settings = rmsprop_settings(group, dtype)
    if settings is None:
        return False
    centered, momentum, decay, small = settings[0], settings[1], settings[2], settings[6]
    kind = ("rmsprop", dtype, centered, small, momentum, decay, group.get("foreach"))
    return _checked(kind, lambda: _rmsprop_probe(*kind[1:]))


def _rmsprop_probe(dtype: torch.dtype, centered: bool, small: bool, momentum: bool,
                   decay: bool, foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(17)
    n = 4099
    param = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = torch.optim.RMSprop([param], lr=0.7, alpha=0.6 if small or not centered else 0.2,
                              eps=0.3, weight_decay=0.3 if decay else 0.0,
                              momentum=0.9 if momentum else 0.0, centered=centered,
                              foreach=foreach)
    for _ in range(2):                      # the state made, the momentum buffer not zero
        param.grad = torch.randn(n, generator=gen, dtype=dtype)
        opt.step()
    return _probe_step(opt, param, rmsprop_keys(opt.param_groups[0]), rmsprop_settings,
                       dense_rmsprop, gen)


def _probe_step(opt: torch.optim.Optimizer, param: torch.nn.Parameter, keys: tuple[str, ...],
                settings_of, kernel, gen: torch.Generator) -> bool:
    """One more step of ``opt`` (over ``param`` alone, its state made) with the mean of two
    random gradients, against ``kernel`` from the same state: whether the reduced
    gradients, the parameter and the state ``keys`` come out bitwise the same."""
    n, dtype, state = param.numel(), param.dtype, opt.state[param]
    mine = [t.detach().clone() for t in (param, *(state[k] for k in keys))]
    step = float(state["step"]) + 1
    grads = [torch.randn(n, generator=gen, dtype=dtype) for _ in range(2)]
    param.grad = (grads[0] + grads[1]) * 0.5
    opt.step()
    settings = settings_of(opt.param_groups[0], dtype, step)
    if settings is None:
        return False
    out = torch.empty(n, dtype=dtype)
    kernel(out, grads, [(0, *mine, settings)], torch.empty(n, dtype=dtype))
    return torch.equal(out, param.grad) and all(
        torch.equal(a, b) for a, b in zip(mine, (param.detach(), *(state[k] for k in keys))))
