"""The row and dense kernels' library (``_rows.c``, ``_plan.c``, ``_dense.c``; the first two
include ``_rowmath.h``): compiled, loaded, declared.

It is compiled once per machine with the C compiler (``cc``, or ``$CC``) into
``$MPISYNC_CACHE`` (default ``~/.cache/mpisync``) and loaded with ``ctypes``; where there
is no compiler, or ``MPISYNC_ROW_KERNELS=0``, ``available()`` is False and the callers
use torch.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import warnings
from pathlib import Path

import torch

from .. import environ
from . import build

__all__ = ["address", "available", "function", "library"]

#: the row kernels, the planned updates, then the dense ones: one library
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("_rows.c", "_plan.c", "_dense.c"))
_HEADER = Path(__file__).with_name("_rowmath.h")     # what the build also depends on
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
    lib, why = build.load("rows", _SOURCES, [cc, *_FLAGS], ["-lm"], _declare,
                          key=_HEADER.read_text())
    if lib is None:
        warnings.warn(f"mpisync: the row kernels ({_SOURCES[0].name}) could not be built "
                      f"({why}); the ps's row updates and dense reduce run on torch, bitwise "
                      f"the same and slower (MPISYNC_ROW_KERNELS=0 silences this)",
                      RuntimeWarning, stacklevel=3)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The argument types of every function (AttributeError: one is missing)."""
    lib.mark_ids.restype = _I
    lib.mark_ids.argtypes = [_I, _P, _P, _P]
    lib.unmark.argtypes = [_I, _P, _P]
    lib.set_flags.argtypes = [_I, _P, _P]
    lib.all_below.argtypes = [_I, _P, _I]
    lib.all_below.restype = ctypes.c_int
    lib.nondecreasing.argtypes = [_I, _P]
    lib.nondecreasing.restype = ctypes.c_int
    lib.bag_offsets.argtypes = [_I, _P, _I, _P]
    lib.bag_offsets.restype = _I
    lib.expand_offsets.argtypes = [_I, _P, _I, _P]
    lib.expand_offsets.restype = _I
    lib.distinct_upto.argtypes = [_I, _P, _I]
    lib.distinct_upto.restype = _I
    lib.unique_inverse.argtypes = [_I, _P, _P, _P]
    lib.unique_inverse.restype = _I
    lib.place.argtypes = [_I, _P, _P]
    lib.shard_order.argtypes = [_I, _P, _I, _P, _P, _P]
    lib.split_ids.argtypes = [_I, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P]
    lib.split_ids.restype = _I
    lib.scatter_marks.argtypes = [_I, _P, _P, _I, _P, _I, _P]
    lib.scatter_marks.restype = _I
    lib.merge2_plan.argtypes = [_I, _P, _I, _P, _P, _P, _P]
    lib.merge2_plan.restype = _I
    lib.plan_order.argtypes = [_I, _P, _P, _P, _I, _I, _P, _P, _P]
    for s in _SUFFIX.values():
        real = ctypes.c_float if s == "f32" else ctypes.c_double
        getattr(lib, f"bag_rows_{s}").argtypes = [_I, _P, _P, _P, _P, _I, _P, _I, _I, _P]
        getattr(lib, f"bag_sums_{s}").argtypes = [_I, _P, _P, _P, _P, _I, _I, _I, _P]
        getattr(lib, f"bag_sums_sorted_{s}").argtypes = [_I, _P, _P, _P, _P, _I, _I, _I, _P]
        getattr(lib, f"gather_{s}").argtypes = [_I, _P, _P, _I, _P]
        merge = getattr(lib, f"merge2_rows_{s}")
        merge.argtypes = [_I, _P, _P, _I, _P, _P, _I, real, _P, _P]
        merge.restype = _I
        getattr(lib, f"merge2_fill_{s}").argtypes = [_I, _I, _P, _P, _P, _P, _I, real, _P]
        getattr(lib, f"adagrad_sum_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, _P, _P]
        getattr(lib, f"adagrad_apply_rows_{s}").argtypes = [_I, _P, _P, _P, _I, real, real,
                                                           real, real, _P]
        getattr(lib, f"axpy_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, real, _P]
        getattr(lib, f"rowwise_rows_{s}").argtypes = [_I, _P, _P, _I, real, real, real, real,
                                                     _P, _P]
        getattr(lib, f"plan_sqrt_{s}").argtypes = [_I, _P, _P, ctypes.c_longlong]
        getattr(lib, f"plan_rows_{s}").argtypes = [_I, _I, _P, _P, _P, _P, _I, _P]
        for name, more in (("plan_axpy", [real, real, real, _P]),
                           ("plan_adagrad", [real, real, real, real, _P, _P, _P,
                                             ctypes.c_longlong]),
                           ("plan_rowwise", [real, real, real, real, _P, _P])):
            fn = getattr(lib, f"{name}_{s}")
            fn.argtypes = [_I, _I, _P, _P, _P, _P, _P, _I, *more]
            fn.restype = ctypes.c_int
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


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None where it cannot be."""
    global _lib
    if _lib is False:
        _lib = _build()
    return _lib


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels are loaded and take these tensors (float32/float64, on CPU)."""
    if library() is None:
        return False
    return all(t.device.type == "cpu" and t.dtype in _SUFFIX for t in tensors)


def address(t: torch.Tensor | None):
    """``t``'s data pointer, or None (a NULL for the kernel) for None."""
    return None if t is None else t.data_ptr()


def function(name: str, dtype: torch.dtype):
    """The kernel ``name`` for tensors of ``dtype`` (``name_f32`` or ``name_f64``)."""
    return getattr(library(), f"{name}_{_SUFFIX[dtype]}")
