"""Which live torch modules hold given parameters, and under which names.

``holders`` answers from a registry that a hook on torch's parameter registration keeps
while it is watched (``watch()`` ... ``unwatch()``: each open ``SyncReplicasOptimizer``
watches, so the hook is installed while any is open and removed with the last one), and
searches all live objects (``gc.get_objects()``) for the parameters the registry does
not know: those of a model built before (the usual case). While watched, what the search
finds is kept in the registry, so that the next question about them needs no search.
Importing this module installs nothing.
"""
from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import torch

__all__ = ["holders", "unwatch", "watch", "watching"]

# id(parameter) -> (a weak reference to it, [(a weak reference to a module it was
# registered on, its name there)] in the order seen; tensors compare elementwise, so they
# cannot be keys of a WeakKeyDictionary)
_registered: dict[int, tuple[weakref.ref, list[tuple[weakref.ref, str]]]] = {}
_watchers = 0
_handle = None       # torch's handle of the registration hook, while watched


def _note(module: torch.nn.Module, name: str, param) -> None:
    """Note that ``module`` holds ``param`` as ``name`` (the last noted holder last)."""
    key = id(param)
    seen = _registered.get(key)
    if seen is None or seen[0]() is not param:
        seen = (weakref.ref(param, lambda _ref: _registered.pop(key, None)), [])
        _registered[key] = seen
    held = [h for h in seen[1] if h[1] != name or h[0]() is not module]
    seen[1][:] = [*held, (weakref.ref(module), name)]


def _on_registration(module: torch.nn.Module, name: str, param) -> None:
    if param is not None:
        _note(module, name, param)


def watch() -> None:
    """Keep the registry from now on (the hook is installed by the first watcher)."""
    global _watchers, _handle
    if _watchers == 0:
        _handle = torch.nn.modules.module.register_module_parameter_registration_hook(
            _on_registration)
    _watchers += 1


def unwatch() -> None:
    """One watcher less; the last one removes the hook and forgets the registry (no hook
    keeps it true any more)."""
    global _watchers, _handle
    if _watchers == 0:
        raise RuntimeError("unwatch() without a watch()")
    _watchers -= 1
    if _watchers == 0:
        assert _handle is not None
        _handle.remove()
        _handle = None
        _registered.clear()


def watching() -> bool:
    """Whether the registration hook is installed."""
    return _watchers > 0


def holders(params: Iterable[torch.Tensor]) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """``id(p) -> [(module, name), ...]``: the live modules that hold each of ``params``
    now (``module._parameters[name] is p``), the one registered last at the end where the
    hook saw them; a parameter no module holds has no entry."""
    params = list(params)
    found: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    unknown = set()
    for p in params:
        seen = _registered.get(id(p))
        held = [] if seen is None or seen[0]() is not p else [
            (m, name) for m, name in ((ref(), name) for ref, name in seen[1])
            if m is not None and m._parameters.get(name) is p]
        if held:
            found[id(p)] = held
        else:
            unknown.add(id(p))
    if unknown:
        for obj in gc.get_objects():
            if not issubclass(type(obj), torch.nn.Module):  # not isinstance: no __class__ read
                continue
            # a module whose __init__ raised before Module.__init__ may linger without them
            own = vars(obj).get("_parameters")
            if own is not None:
                for name, p in own.items():
                    if p is None:
                        continue
                    if id(p) in unknown:
                        found.setdefault(id(p), []).append((obj, name))
                    if _watchers and id(p) not in _registered:
                        _note(obj, name, p)
    return found
