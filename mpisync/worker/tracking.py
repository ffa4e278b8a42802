"""Writes to parameters between steps: seen through version counters, never lost."""
from __future__ import annotations

import weakref

import numpy as np
import torch

from ..native.bulk import Versions
from ..protocol.holders import holders

__all__ = ["TrackedParameter", "WriteTracker", "rebound", "was_rebound"]

_set_data = torch._C.TensorBase.data.__set__
_rebound: set[int] = set()      # ids of tracked parameters given a new tensor by `p.data = x`


def rebound(p: torch.Tensor) -> bool:
    """Whether ``p`` was given a new tensor with ``p.data = x`` since last asked."""
    if id(p) in _rebound:
        _rebound.discard(id(p))
        return True
    return False


def was_rebound(p: torch.Tensor) -> bool:
    """Whether ``p`` was given a new tensor and ``rebound`` was not asked since."""
    return id(p) in _rebound


class TrackedParameter(torch.nn.Parameter):
    """A parameter held by mpisync: every write to it, ``p.data`` ones included, is seen.

    ``p.data`` is an alias that shares the parameter's version counter (torch's own
    ``.data`` does not), so ``p.data.clamp_(-c, c)`` counts as a write like
    ``with torch.no_grad(): p.clamp_(-c, c)`` does. ``p.data = x`` is noted and
    copied into mpisync's buffer at the next step. Everything else is torch's Parameter.
    """

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _set_data(self, value)
        _rebound.add(id(self))

    def __repr__(self) -> str:
        return "Parameter containing:\n" + repr(self.as_subclass(torch.Tensor))


class WriteTracker:
    """The parameters of one optimizer, bound to mpisync's buffers, and their writes.

    Each parameter must stay a view of ``views[i]``. ``written()`` lists the parameters
    changed since ``snapshot()``: an in-place operation on the parameter or on any alias
    of it (``p.data``, ``p.detach()``, ``load_state_dict``), or a new tensor given with
    ``p.data = x`` (its values are copied into the buffer). Writes through a NumPy view or
    raw memory are not seen. A parameter ``staging`` holds (``mpisync.worker.devices``) stays on
    its device instead, its buffer a host copy; one that moved to another device since is
    refused.
    """

    def __init__(self, names: list[str], params: list[torch.Tensor],
                 views: list[torch.Tensor], label: str,
                 grads: list[torch.Tensor] | None = None, staging=None):
        self.names = names
        self.params = params
        self.views = views
        self.label = label
        self.staging = staging
        self.devices = [p.device for p in params]
        # the gradient buffers, and aliases of them that no `.data = x` can move
        self.grads = grads
        self.grad_homes = None if grads is None else [g.detach() for g in grads]
        self.classes = [type(p) for p in params]
        for p in params:
            if type(p) is torch.nn.Parameter:
                p.__class__ = TrackedParameter
        # the module that holds each parameter (the one it was registered on last)
        held = holders(params)
        self.holders = [(weakref.ref(h[-1][0]), h[-1][1]) if (h := held.get(id(p))) else None
                        for p in params]
        # plain aliases share each parameter's version counter: read together, in one call
        self.aliases = [p.detach() for p in params]
        self.counters = Versions(params, self.aliases)
        self.snapshot()

    def snapshot(self) -> None:
        """What the parameters hold now is what the ps ranks hold."""
        self.versions = self.counters.read()[0]
        if _rebound:
            _rebound.difference_update(id(p) for p in self.params)

    def mark(self, indices: list[int]) -> None:
        """Count these parameters as written, whatever happens until the next snapshot."""
        for i in indices:
            self.versions[i] = -1

    def written(self) -> list[int]:
        """Indices of the parameters written since the last snapshot (then a snapshot).

        Receiving parameters writes raw memory and changes no version, so what this
        returns stays the snapshot through the next pull.
        """
        now, moved = self.counters.read()      # (against self.versions, marks included)
        changed = np.flatnonzero(now != self.versions).tolist() if moved else []
        self.versions = now
        if _rebound:
            for i, p in enumerate(self.params):
                if id(p) in _rebound and self._rebind(i) and i not in changed:
                    changed.append(i)
            changed.sort()
        return changed

    def _rebind(self, i: int) -> bool:
        """Bring a parameter given a new tensor back onto its buffer; True if it changed."""
        p, view = self.params[i], self.views[i]
        _rebound.discard(id(p))
        if p.device != self.devices[i]:       # model.to(device) sets .data: it comes here
            raise TypeError(
                f"{self.label}: parameter {self.names[i]!r} moved from {self.devices[i]} to "
                f"{p.device} after the SyncReplicasOptimizer was created; move the model to "
                f"its device (cluster.device) before creating the optimizer")
        if self.staging is not None and i in self.staging:
            self.staging.rebind(i)
            self._alias(i)
            return True
        if p.data_ptr() == view.data_ptr() and p.shape == view.shape:
            return False
        if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
            raise TypeError(
                f"{self.label}: parameter {self.names[i]!r} became a {p.dtype} tensor of shape "
                f"{list(p.shape)} on {p.device} after the optimizer was created; mpisync holds "
                f"it as {view.dtype} {list(view.shape)} on {view.device}. Convert or move the "
                f"model before creating the SyncReplicasOptimizer")
        with torch.no_grad():
            view.copy_(p)           # deliberate: the new values must reach the ps
        _set_data(p, view)
        self._alias(i)
        self._home_grad(i)
        return True

    def _alias(self, i: int) -> None:
        """Parameter ``i`` holds another tensor: a new alias of it (the same counter)."""
        p = self.params[i]
        self.aliases[i] = alias = p.detach()
        self.counters.replace(i, p, alias)

    def _home_grad(self, i: int) -> None:
        """Converting a model (``model.half()``, then ``model.float()``) converts each
        ``.grad`` too, and one that was mpisync's gradient buffer then holds another tensor:
        point it back into the buffer, with the values written there since."""
        if self.grads is None:
            return
        g, home = self.grads[i], self.grad_homes[i]
        if g.data_ptr() == home.data_ptr():
            return
        if g.shape == home.shape and g.dtype == home.dtype and g.device == home.device:
            with torch.no_grad():
                home.copy_(g)       # deliberate: a backward may have written there since
        _set_data(g, home)

    def replaced(self) -> list[str]:
        """Names of the parameters their module no longer holds: it was given new ones
        (``model.to("meta")``, ``to_empty()``), which no optimizer built before knows."""
        gone = []
        for name, p, holder in zip(self.names, self.params, self.holders):
            module = holder[0]() if holder is not None else None
            if module is not None and module._parameters.get(holder[1]) is not p:
                gone.append(name)
        return gone

    def release(self) -> None:
        """Give the parameters back their own class (after close)."""
        for p, cls in zip(self.params, self.classes):
            if type(p) is TrackedParameter:
                p.__class__ = cls
        _rebound.difference_update(id(p) for p in self.params)
