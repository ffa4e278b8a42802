"""Many tensors' version counters and gradients, read in one call per step.

A worker asks every step whether any parameter was written (its version counter moved)
and whether every ``.grad`` is still its send buffer's view, in place. Read from Python,
that is a few attribute look-ups per parameter, each a chain of cache misses once the
step's copies have gone through the caches (``docs/benchmarks.md``, "Figures behind
choices in the code"). ``_bulk.cpp`` reads them in one loop over the tensors' ``TensorImpl``s: the same
values, as torch's own accessors give them. It is compiled once per machine against the
installed torch's headers (``build.load``; ``$CXX``, else ``c++``); where that cannot
be done, or with ``MPISYNC_BULK=0``, the same reads run in Python.
"""
from __future__ import annotations

import ctypes
import operator
import os
import shutil
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from .. import environ
from . import build

__all__ = ["Grads", "Versions", "available", "grads_of", "wanted"]

_SOURCE = Path(__file__).with_name("_bulk.cpp")
_lib: ctypes.CDLL | None | bool = False          # False: not tried yet
_P = ctypes.c_void_p
_I = ctypes.c_int64
_version_of = operator.attrgetter("_version")
_grad_of = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr
_no_torch_function = torch._C.DisableTorchFunctionSubclass


def grads_of(params: list[torch.Tensor], plain: bool) -> list[torch.Tensor | None]:
    """Each parameter's ``.grad`` (read past ``__torch_function__`` where ``plain``)."""
    if plain:
        with _no_torch_function():
            return list(map(_grad_of, params))
    return list(map(_grad_of, params))


def _declare(lib: ctypes.CDLL) -> None:
    lib.bulk_versions.restype = _I
    lib.bulk_versions.argtypes = [_I, _P, _P, _P]
    lib.bulk_homes.restype = None
    lib.bulk_homes.argtypes = [_I, _P, _P, _P]
    lib.bulk_grads_at.restype = _I
    lib.bulk_grads_at.argtypes = [_I, _P, _P, _P, _P, _P]
    lib.bulk_adopt.restype = _I
    lib.bulk_adopt.argtypes = [_I, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P]
    lib.bulk_clear.restype = _I
    lib.bulk_clear.argtypes = [_I, _P]


def wanted() -> bool:
    """Whether ``MPISYNC_BULK`` asks for the compiled reads (unset, empty or ``1``: yes).

    Raises:
        ConfigError: any value but 1 or 0, naming it and this rank.
    """
    return environ.switch("MPISYNC_BULK")


def _build() -> ctypes.CDLL | None:
    if not wanted():
        return None
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    root = Path(torch.__file__).parent
    if cxx is None or not (root / "include" / "ATen" / "core" / "Tensor.h").exists():
        return None
    abi = int(torch.compiled_with_cxx11_abi())
    lib, why = build.load(
        "bulk", _SOURCE,
        [cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
         f"-I{root / 'include'}"],
        [f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}"],
        _declare, key=torch.__version__, keep_gil=True)
    if lib is None:
        warnings.warn(f"mpisync: the bulk reads ({_SOURCE.name}) could not be built ({why}); "
                      f"a worker reads its parameters' versions and gradients in Python, "
                      f"the same and slower (MPISYNC_BULK=0 silences this)", RuntimeWarning,
                      stacklevel=3)
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = _build()
    return _lib


def available() -> bool:
    """Whether the compiled reads are loaded."""
    return _library() is not None


def _addresses(tensors: list[torch.Tensor | None]) -> np.ndarray:
    return np.array([0 if t is None else t._cdata for t in tensors], np.int64)


def _pin(tensors: list[torch.Tensor]) -> list[weakref.ref]:
    """Weak references that keep ``torch.utils.swap_tensors`` off these tensors (it refuses
    a tensor with one), so each keeps its ``TensorImpl``, whose address the reads use."""
    return [weakref.ref(t) for t in tensors]


class Versions:
    """The version counters of a list of tensors (``t._version``), read into one array.

    ``aliases`` (default: the tensors) share each tensor's counter and are what Python
    reads (for a parameter, ``p.detach()``: a plain tensor, read faster than the
    parameter's class); ``replace(i, t, alias)`` when one is given another.
    """

    def __init__(self, tensors: list[torch.Tensor], aliases: list[torch.Tensor] | None = None):
        self.tensors = list(tensors)
        self.aliases = list(tensors if aliases is None else aliases)
        self.pins = _pin(self.tensors)
        self.addresses = _addresses(self.tensors)
        self.where = self.addresses.ctypes.data
        self.out = [np.zeros(len(self.tensors), np.int64) for _ in range(2)]
        self.out_at = [a.ctypes.data for a in self.out]
        self.turn = 0

    def replace(self, i: int, tensor: torch.Tensor, alias: torch.Tensor | None = None) -> None:
        self.tensors[i] = tensor
        self.aliases[i] = tensor if alias is None else alias
        self.pins[i] = weakref.ref(tensor)
        self.addresses[i] = tensor._cdata

    def read(self) -> tuple[np.ndarray, int]:
        """Every counter, in one of two arrays that take turns (the one the read before
        returned stays as it is until the read after this one), and how many differ from
        that array's (as it is now: the caller may have changed it)."""
        self.turn ^= 1
        out, before = self.out[self.turn], self.out[self.turn ^ 1]
        lib = _library()
        moved = -1 if lib is None else lib.bulk_versions(len(out), self.where,
                                                          self.out_at[self.turn],
                                                          self.out_at[self.turn ^ 1])
        if moved < 0:
            out[:] = list(map(_version_of, self.aliases))
            moved = int(np.count_nonzero(out != before))
        return out, moved


class Grads:
    """The ``.grad`` of each of ``params``, against ``views[i]``, the buffer it belongs in.

    ``in_place()``: whether every ``.grad`` is its view and the view still is the memory it
    was here (``p.grad.data = x`` moves it, ``p.grad.t_()`` changes its strides): backward
    wrote every gradient in place. ``adopt()``: gradients backward made (after
    ``zero_grad(set_to_none=True)``) copied into their views in one call, ``clear()``:
    every ``.grad`` None in one (both where compiled). With ``plain`` (the parameters' classes override no
    ``__torch_function__``) ``.grad`` is read past torch's look-up.

    Args:
        has: a writable byte array, ``has[index[i]]`` whether parameter ``i`` has a
            gradient (``adopt`` sets it).
        guards: ``(start, end)`` addresses of the memory that ``views`` lie in (and any
            other gradient memory of the caller's): a ``.grad`` there is left to the
            caller (it may be another parameter's buffer, which copies would overwrite).
    """

    def __init__(self, params: list[torch.Tensor], views: list[torch.Tensor | None],
                 plain: bool, index: list[int] | None = None, has: np.ndarray | None = None,
                 guards: list[tuple[int, int]] = ()):
        self.params, self.views, self.plain = list(params), list(views), plain
        self.pins = _pin(self.params) + _pin([v for v in self.views if v is not None])
        self.ptrs = [0 if v is None else v.data_ptr() for v in self.views]
        self.n = n = len(self.params)
        self.index = np.arange(n, dtype=np.int64) if index is None else np.array(index,
                                                                               np.int64)
        self.has = has
        self.guards = np.array(list(guards) or [(0, 0)], np.int64).reshape(-1, 2).T.copy()
        self.adopt_where = (self.guards[0].ctypes.data, self.guards[1].ctypes.data,
                            0 if has is None else has.ctypes.data, self.index.ctypes.data)
        self.arrays = [_addresses(self.params), _addresses(self.views),
                       *(np.zeros(n, np.int64) for _ in range(3))]   # storages, offsets, scratch
        self.where = [a.ctypes.data for a in self.arrays]
        self.compiled = plain and all(v is not None for v in self.views)
        lib = self._lib()
        if lib is not None:
            present = np.flatnonzero(self.arrays[1])
            views, homes = self.arrays[1][present], [np.zeros(len(present), np.int64)
                                                     for _ in range(2)]
            lib.bulk_homes(len(present), views.ctypes.data, *(h.ctypes.data for h in homes))
            self.arrays[2][present], self.arrays[3][present] = homes

    def _lib(self) -> ctypes.CDLL | None:
        return _library() if self.compiled else None

    def in_place(self) -> bool:
        lib = self._lib()
        if lib is not None:
            return lib.bulk_grads_at(self.n, *self.where) == self.n
        return all(map(operator.is_, grads_of(self.params, self.plain), self.views)) and \
            [0 if v is None else _data_ptr(v) for v in self.views] == self.ptrs and \
            all(v is None or (v.is_contiguous() and v.shape == p.shape)
                for p, v in zip(self.params, self.views))

    def adopt(self) -> bool:
        """Every ``.grad`` in its view (see ``_bulk.cpp``'s ``bulk_adopt``), ``has`` set;
        False, having changed nothing, where that takes the caller's own path."""
        lib = self._lib()
        if lib is None or self.has is None:
            return False
        a = self.where
        return lib.bulk_adopt(self.n, a[0], a[1], a[2], a[3], self.guards.shape[1],
                              *self.adopt_where, a[4]) == self.n

    def clear(self) -> bool:
        """Every ``.grad`` None (``zero_grad(set_to_none=True)``); False where that takes
        the caller's own path."""
        lib = self._lib()
        return lib is not None and lib.bulk_clear(self.n, self.where[0]) == self.n
