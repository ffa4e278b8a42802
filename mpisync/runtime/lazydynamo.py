"""Torch's optimizers without ``torch._dynamo`` until something compiles.

``torch.optim.Optimizer.add_param_group`` (run by every optimizer's constructor),
``zero_grad``, ``state_dict`` and ``load_state_dict`` are wrapped in torch's
``_disable_dynamo``: on its first call the wrapper imports ``torch._dynamo`` (seconds of CPU, more
than all of mpisync's own set-up) only to build ``torch._dynamo.disable(fn)``, which
keeps ``torch.compile`` out of the method. Until ``torch._dynamo`` is imported nothing can
compile, and that switch does nothing: a worker, which never steps a torch optimizer itself
(its ps ranks do), paid for the import at start-up and never used it.

``spare()`` gives each of those methods the switch torch caches on the function
(``fn.__dynamo_disable``, read by torch's wrapper on every call), but a lazy one: while
``torch._dynamo`` is not imported it calls the method as it is. The import of
``torch._dynamo`` (``torch.compile`` makes it) puts torch's own switches in their place as
soon as it is done, before anything can compile (an import hook that removes itself), so a
compiled function meets torch's switches only, with torch's graph breaks; should a lazy
switch be called with ``torch._dynamo`` imported anyway, it builds torch's switch there.
Nothing else changes: the same methods run with the same arguments.

A method whose switch torch built already (``torch._dynamo`` was imported first) keeps it.

``deterministic()`` is ``torch.use_deterministic_algorithms(True)`` without the import of
``torch._inductor`` (and with it ``torch._dynamo``) that torch's function makes only to set
``torch._inductor.config.deterministic``: the config takes the setting when it is imported.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from typing import Any, Callable

__all__ = ["METHODS", "deterministic", "spare", "spared"]

#: The ``torch.optim.Optimizer`` methods torch wraps in ``torch._disable_dynamo``.
METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")

# The attribute torch's `_disable_dynamo` wrapper caches its switch in (torch/_compile.py).
_CACHE = "__dynamo_disable"


def _torchs(fn: Callable[..., Any], dynamo) -> Callable[..., Any]:
    """Torch's own switch for ``fn``, built and cached where torch's wrapper builds it."""
    disabled = dynamo.disable(fn, True, wrapping=False)
    setattr(fn, _CACHE, disabled)
    return disabled


def _lazy(fn: Callable[..., Any]) -> Callable[..., Any]:
    def switch(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None or not hasattr(dynamo, "disable"):    # absent, or importing now
            return fn(*args, **kwargs)
        return _torchs(fn, dynamo)(*args, **kwargs)

    switch._torchdynamo_disable = True    # type: ignore[attr-defined]  # dynamo: skip me
    switch.__wrapped__ = fn               # type: ignore[attr-defined]
    switch._mpisync_lazy = True           # type: ignore[attr-defined]
    return switch


def _original(name: str) -> Callable[..., Any] | None:
    """The method torch's wrapper wraps, or None where torch does not wrap it (any more)."""
    from torch.optim import Optimizer

    wrapper = Optimizer.__dict__.get(name)
    fn = getattr(wrapper, "__wrapped__", None)
    if fn is None or getattr(wrapper, "__code__", None) is None:
        return None
    if "disable_fn" not in wrapper.__code__.co_varnames:      # not torch's _disable_dynamo
        return None
    return fn


def _restore(dynamo) -> None:
    """Torch's own switch in place of every lazy one (``torch._dynamo`` is imported)."""
    for name in METHODS:
        fn = _original(name)
        if fn is not None and spared(name):
            _torchs(fn, dynamo)


class _AfterImport:
    """Runs ``then(module)`` the moment the module ``name`` has been imported (an import
    hook that removes itself): for ``torch._dynamo``, torch's switches back before anything
    can compile, so that the lazy switch is never on a frame Dynamo sees."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, name: str, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)                  # once; and not for the lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_then(module) -> None:
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = exec_and_then  # type: ignore[method-assign]
        return spec


def _after_import(name: str, then: Callable[[Any], None]) -> None:
    """``then(module)`` once ``name`` is imported (one hook per module name)."""
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def spare() -> list[str]:
    """Give torch's optimizer methods the lazy switch; the names of those that took it."""
    if "torch._dynamo" in sys.modules:      # imported already: torch's switches cost nothing
        return []
    taken = []
    for name in METHODS:
        fn = _original(name)
        if fn is not None and getattr(fn, _CACHE, None) is None:
            setattr(fn, _CACHE, _lazy(fn))
            taken.append(name)
    if taken:
        _after_import("torch._dynamo", _restore)
    return taken


def spared(name: str) -> bool:
    """Whether the method ``name`` holds the lazy switch now (not torch's own)."""
    fn = _original(name)
    switch = getattr(fn, _CACHE, None) if fn is not None else None
    return getattr(switch, "_mpisync_lazy", False) is True


_INDUCTOR_CONFIG = "torch._inductor.config"


def deterministic() -> None:
    """``torch.use_deterministic_algorithms(True)``, importing nothing: where
    ``torch._inductor.config`` is not imported yet, it is set as torch's function sets it
    the moment it is (an import hook that removes itself)."""
    import torch

    config = sys.modules.get(_INDUCTOR_CONFIG)
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None or (config is not None and hasattr(config, "deterministic")):
        torch.use_deterministic_algorithms(True)        # torch's own: nothing to spare
        return
    setter(True, warn_only=False)
    _after_import(_INDUCTOR_CONFIG, functools.partial(_set_config, threading.get_ident()))


def _set_config(caller: int, config) -> None:
    """``torch._inductor.config.deterministic`` as torch's switch stands (just imported):
    set as torch sets it, for this thread (a config setting is per thread); imported by
    another thread than the one that asked (``caller``), the setting's default as well,
    so that the asking thread sees it too."""
    import torch

    if not torch.are_deterministic_algorithms_enabled():
        return
    config.deterministic = True
    entry = getattr(config, "_config", {}).get("deterministic")
    if threading.get_ident() != caller and hasattr(entry, "default"):
        entry.default = True
