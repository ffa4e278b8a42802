"""Gradient adoption: the parameters' ``.grad`` as views into the dense channel's buffers."""
from __future__ import annotations

import operator

import numpy as np
import torch

from ..native.bulk import Grads, grads_of
from .devices import Staging

__all__ = ["GradAdopter", "grads_read_plainly"]


_layout_of, _dtype_of, _shape_of, _requires_grad_of = (
    operator.attrgetter(a) for a in ("layout", "dtype", "shape", "requires_grad"))


def grads_read_plainly(params: list[torch.Tensor]) -> bool:
    """Whether reading these parameters' ``.grad`` calls no ``__torch_function__`` anyway
    (tensors and parameters, ``TrackedParameter`` too): then it may skip torch's look-up."""
    return all(type(p) is torch.Tensor
               or type(p).__torch_function__ is torch._C._disabled_torch_function_impl
               for p in params)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Address ranges ``(start, end)``, sorted and merged where they overlap or touch."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


class GradAdopter:
    """Keeps each parameter's ``.grad`` the view of its gradient buffer that backward
    writes in place, and notes which parameters have a gradient this step.

    ``gviews[i]`` is parameter ``i``'s gradient view: into a fused gradient buffer (a
    shard's ``gmem``), or a tensor of its own (a partitioned parameter, or the host copy
    of a staged one). A gradient made outside it (backward's own tensor after
    ``zero_grad(set_to_none=True)``, or one given by hand) is copied in and the view
    becomes the parameter's ``.grad`` again: adopted. A view given another tensor
    (``p.grad.data = x``) or other strides (``p.grad.t_()``) is pointed back into its
    buffer (``rehome``); a gradient given by hand that shares memory with a gradient
    buffer is read before any buffer is written (``unalias``). A staged parameter's
    gradient stays on its device and is copied to its host view (``Staging``).

    ``has[i]`` (``has_grad`` sees the same bytes as an array) is set when parameter ``i``
    has a gradient this step.
    """

    def __init__(self, label: str, names: list[str], params: list[torch.Tensor],
                 gviews: list[torch.Tensor], buffers: list[np.ndarray], staging: Staging):
        self.label = label
        self.names = names
        self.params = params
        self.gviews = gviews
        self.staging = staging
        self.has = bytearray(len(names))                    # fast to set one by one ...
        self.has_grad = np.frombuffer(self.has, np.uint8)   # ... and seen here as an array
        self.plain = grads_read_plainly(params)
        # aliases of the gradient views that no ``p.grad.data = x`` can move, and where
        # they start: a view whose memory moved holds the user's tensor (``rehome``)
        self.ghomes = [None if g is None else g.detach() for g in gviews]
        self.gptrs = [0 if g is None else g.data_ptr() for g in gviews]
        # the address ranges of every gradient buffer (the shards' and the partitioned
        # parameters' own), merged
        self.guards = _merged([(b.ctypes.data, b.ctypes.data + b.nbytes) for b in buffers] +
                              [(g.data_ptr(), g.data_ptr() + g.numel() * g.element_size())
                               for g in gviews if g is not None])

    def grads(self, ids: list[int] | None = None) -> Grads:
        """A ``bulk.Grads`` over parameters ``ids`` (every parameter where None): whether
        backward wrote their gradients in place, and backward's own adopted in one call."""
        if ids is None:
            return Grads(self.params, self.gviews, self.plain, has=self.has_grad,
                         guards=self.guards)
        params = [self.params[i] for i in ids]
        return Grads(params, [self.gviews[i] for i in ids], grads_read_plainly(params), ids,
                     self.has_grad, self.guards)

    def point_home(self) -> None:
        """``zero_grad(set_to_none=False)`` where some ``.grad`` is not its view in place:
        each becomes its view (zeroed by the caller), a staged one is zeroed on its
        device."""
        staging, staged = self.staging, bool(self.staging)
        for i, (p, view) in enumerate(zip(self.params, self.gviews)):
            g = p.grad
            if g is None:
                continue
            if g is view:
                if self.moved(i, view):      # p.grad.data = x, or t_(), since
                    self.adopt(i, p, self.rehome(i, view), view, copy=False)
                continue
            if staged and i in staging:
                g.zero_()                   # on its device, as torch does
            else:
                p.grad = view               # the fused buffer, zeroed by the caller: no copy later

    def take(self, params: list[torch.Tensor], ids: list[int],
             grads: list[torch.Tensor | None], views: list[torch.Tensor]) -> None:
        """A bucket's gradients into its buffer where some are not their views already
        (``params[n]`` is parameter ``ids[n]``, ``grads[n]`` its ``.grad``)."""
        staging = self.staging
        has, fresh, staged = self.has, [], bool(staging)
        for p, i, g, view in zip(params, ids, grads, views):
            if g is view and self.moved(i, view):     # p.grad.data = x, or t_()
                fresh.append((i, p, self.rehome(i, view), view))
            elif g is view:
                has[i] = 1
            elif g is None:
                if has[i]:
                    view.zero_()   # absent: zeros, so the other workers' sum is exact
                    has[i] = 0
            elif staged and i in staging:
                if g.layout is not torch.strided:
                    self.adopt(i, p, g, view)     # refused: a sparse gradient
                staging.grad_to_host(i, g, view)
                has[i] = 1
            else:
                fresh.append((i, p, g, view))
        if fresh:
            self.adopt_all(fresh)

    def adopt_all(self, fresh: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]
                  ) -> None:
        """``adopt`` for each ``(i, p, g, view)``; the copies in one call where every
        gradient is dense and of its parameter's shape and dtype (after ``zero_grad()``'s
        ``set_to_none=True``, torch's default, every gradient of a step comes here)."""
        has = self.has
        ids, params, grads, views = zip(*fresh)
        if any(lay is not torch.strided for lay in map(_layout_of, grads)) or \
                list(map(_dtype_of, grads)) != list(map(_dtype_of, views)) or \
                list(map(_shape_of, grads)) != list(map(_shape_of, views)) or \
                any(map(_requires_grad_of, grads)):
            for i, p, g, view in fresh:     # one by one: the first not taken raises, and
                self.adopt(i, p, g, view)     # create_graph's gradients keep copy_'s graph
                has[i] = 1
            return
        torch._foreach_copy_(views, grads)    # (one already over its view: torch skips it)
        for i, p, view in zip(ids, params, views):
            p.grad = view
            has[i] = 1

    def moved(self, i: int, view: torch.Tensor) -> bool:
        """Whether parameter ``i``'s gradient view no longer is the memory it was made as:
        given another tensor (``p.grad.data = x``) or other strides (``p.grad.t_()``)."""
        home = self.ghomes[i]
        return view.data_ptr() != self.gptrs[i] or view.stride() != home.stride() or \
            view.shape != home.shape

    def in_grad_memory(self, g: torch.Tensor) -> bool:
        """Whether ``g`` shares memory with a gradient buffer (another parameter's buffer,
        or its own seen through other strides): taking it must read it before any buffer
        is written."""
        if g.layout is not torch.strided or g.device.type != "cpu":
            return False
        storage = g.untyped_storage()
        lo = storage.data_ptr()
        hi = lo + storage.nbytes()
        return any(lo < end and start < hi for start, end in self.guards)

    def rehome(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s gradient view was given another tensor (``p.grad.data = x``)
        or other strides: point it back into the send buffer; returns the tensor it held
        (a copy where that lies in a gradient buffer, which the taking overwrites)."""
        held = view.detach()
        if self.in_grad_memory(held):
            held = held.clone()     # deliberate: read before the buffer is written
        torch._C.TensorBase.data.__set__(view, self.ghomes[i])
        return held

    def adopt(self, i: int, p: torch.Tensor, g: torch.Tensor, view: torch.Tensor,
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

    def unalias(self) -> None:
        """Before the buckets' gradients are taken one bucket after another: a gradient
        given by hand that shares memory with a gradient buffer (another parameter's
        buffer or a view of it, ``a.grad, b.grad = b.grad.data, a.grad.data``) becomes a
        copy of it first."""
        grads = grads_of(self.params, self.plain)
        if all(map(operator.is_, grads, self.gviews)):
            return                      # a view's memory moved: take() points it back
        for p, g, view in zip(self.params, grads, self.gviews):
            if g is not None and g is not view and self.in_grad_memory(g):
                p.grad = g.clone()     # deliberate: read before the buffer is written
