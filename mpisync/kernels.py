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
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import environ

__all__ = ["adagrad_apply_rows", "adagrad_sum_rows", "available", "axpy_rows", "bag_rows",
           "merge_pieces", "rowwise_apply_rows", "slots_for"]

_SOURCE = Path(__file__).with_name("_rows.c")
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-march=native", "-fPIC", "-shared"]
_lib: ctypes.CDLL | None | bool = False          # False: not tried yet
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cpu() -> str:
    """This machine's processor (``-march=native``: a shared cache dir may see others)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return platform.machine()


def _build() -> ctypes.CDLL | None:
    if not environ.switch("MPISYNC_ROW_KERNELS", True):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *_FLAGS, _cpu()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MPISYNC_CACHE") or Path.home() / ".cache" / "mpisync")
    target = cache / f"rows-{key}.so"
    if not target.exists():
        tmp = None
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, target)          # atomic: ranks building at once all agree
        except (OSError, subprocess.SubprocessError):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    lib.mark_ids.restype = _I
    lib.mark_ids.argtypes = [_I, _P, _P, _P]
    lib.unmark.argtypes = [_I, _P, _P]
    lib.place.argtypes = [_I, _P, _P]
    for s in _SUFFIX.values():
        getattr(lib, f"bag_rows_{s}").argtypes = [_I, _P, _P, _P, _P, _I, _P, _P]
        real = ctypes.c_float if s == "f32" else ctypes.c_double
        merge = getattr(lib, f"merge2_rows_{s}")
        merge.argtypes = [_I, _P, _P, _I, _P, _P, _I, real, _P, _P]
        merge.restype = _I
        getattr(lib, f"adagrad_sum_rows_{s}").argtypes = [_I, _P, _P, _I, real, _P, _P]
        getattr(lib, f"adagrad_apply_rows_{s}").argtypes = [_I, _P, _P, _P, _I, real, real,
                                                           real, _P]
        getattr(lib, f"axpy_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, _P]
        getattr(lib, f"rowwise_apply_rows_{s}").argtypes = [_I, _P, _P, _P, _I, real, _P]
    return lib


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


def slots_for(holder: dict, num_rows: int) -> torch.Tensor:
    """A shard's slot array (-1 everywhere), kept in ``holder`` from call to call."""
    slot = holder.get("slots")
    if slot is None or len(slot) != num_rows:
        slot = holder["slots"] = torch.full((num_rows,), -1, dtype=torch.int64)
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
        dim = grads[0].numel() if len(grads) else 0
        out = torch.zeros(len(found), *grads.shape[1:], dtype=grads.dtype)
        getattr(lib, f"bag_rows_{_SUFFIX[grads.dtype]}")(
            len(ids), ids.data_ptr(), bag.data_ptr(), _ptr(weights), grads.data_ptr(), dim,
            slot.data_ptr(), out.data_ptr())
    finally:
        lib.unmark(count, uniq.data_ptr(), slot.data_ptr())
    return found, out


def merge_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], div: int,
                 out_for) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces of sorted distinct ids (and their rows) merged: (sorted distinct ids, rows);
    each id's first row copied, the later ones added in the pieces' order, the sums
    divided by ``div`` unless it is 0. ``out_for(n)`` gives the last output's n rows."""
    lib = _kernels()
    ids, rows = pieces[0]
    ids, rows = ids.contiguous(), rows.contiguous()
    merge = getattr(lib, f"merge2_rows_{_SUFFIX[rows.dtype]}")
    dim = rows[0].numel() if len(rows) else 0
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
                     state_sum: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x = sign * grad``; ``state_sum[ids] += x * x``; ``out = state_sum[ids]``, row by
    row (``state_sum`` contiguous, ``ids`` distinct)."""
    lib = _kernels()
    grad = grad.contiguous()
    dim = grad[0].numel() if len(grad) else 0
    getattr(lib, f"adagrad_sum_rows_{_SUFFIX[grad.dtype]}")(
        len(ids), ids.data_ptr(), grad.data_ptr(), dim, sign, state_sum.data_ptr(),
        out.data_ptr())
    return out


def adagrad_apply_rows(ids: torch.Tensor, grad: torch.Tensor, std: torch.Tensor, sign: float,
                       eps: float, alpha: float, param: torch.Tensor) -> None:
    """``param[ids] = fma(alpha, sign * grad / (std + eps), param[ids])``, row by row."""
    lib = _kernels()
    grad, std = grad.contiguous(), std.contiguous()
    dim = grad[0].numel() if len(grad) else 0
    getattr(lib, f"adagrad_apply_rows_{_SUFFIX[grad.dtype]}")(
        len(ids), ids.data_ptr(), grad.data_ptr(), std.data_ptr(), dim, sign, eps, alpha,
        param.data_ptr())


def axpy_rows(ids: torch.Tensor, grad: torch.Tensor, sign: float, alpha: float,
              param: torch.Tensor) -> None:
    """``param[ids] = fma(alpha, sign * grad, param[ids])``, row by row: torch's
    ``param.add_(sparse, alpha=alpha)`` (an axpy per row, which fuses)."""
    lib = _kernels()
    grad = grad.contiguous()
    dim = grad[0].numel() if len(grad) else 0
    getattr(lib, f"axpy_rows_{_SUFFIX[grad.dtype]}")(
        len(ids), ids.data_ptr(), grad.data_ptr(), dim, sign, alpha, param.data_ptr())


def rowwise_apply_rows(ids: torch.Tensor, grad: torch.Tensor, mult: torch.Tensor, sign: float,
                       param: torch.Tensor) -> None:
    """``param[ids[i]] += (sign * grad[i]) * mult[i]``, row by row (one ``mult`` a row)."""
    lib = _kernels()
    grad, mult = grad.contiguous(), mult.contiguous()
    dim = grad[0].numel() if len(grad) else 0
    getattr(lib, f"rowwise_apply_rows_{_SUFFIX[grad.dtype]}")(
        len(ids), ids.data_ptr(), grad.data_ptr(), mult.data_ptr(), dim, sign,
        param.data_ptr())
