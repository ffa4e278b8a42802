"""``optimizer.step()`` without importing ``torch._dynamo`` for it: what a ps rank steps, and
the reference the compiled kernels are checked against.

Torch wraps each optimizer's ``step`` twice: ``Optimizer.profile_hook_step`` (step hooks and
a profiler label) around ``_use_grad_for_differentiable``, which turns autograd off unless
the optimizer is ``differentiable`` and marks two graph breaks for ``torch.compile``, and
imports ``torch._dynamo`` on every call to do so. Nothing compiles on a ps rank: while
``torch._dynamo`` is not imported, ``step()`` here runs what those wrappers run but the
import. Step hooks, ``differentiable``, a step set on the instance (an LR scheduler's
counter) or a class's own ``step`` go through ``optimizer.step()`` itself (an own step that
calls ``super().step()`` then imports ``torch._dynamo``, as it would anyway). Bitwise the
same step: the same function on the same tensors, autograd off as torch turns it off.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["hooked", "step"]


def hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` would run step hooks (its own or torch's global ones)."""
    from torch.optim import optimizer as module
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or getattr(module, "_global_optimizer_pre_hooks", None)
                or getattr(module, "_global_optimizer_post_hooks", None))


def _unwrapped(cls: type) -> Callable[..., Any] | None:
    """The step function under torch's two wrappers, or None where ``cls.step`` is not
    wrapped as this module knows it (a class's own step: it is called as it is)."""
    outer = getattr(cls, "step", None)
    if not getattr(outer, "hooked", False):
        return None
    grad = getattr(outer, "__wrapped__", None)
    if getattr(getattr(grad, "__code__", None), "co_name", None) != "_use_grad":
        return None
    return getattr(grad, "__wrapped__", None)


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``: the same step, without the import of ``torch._dynamo``."""
    raw = None
    if "torch._dynamo" not in sys.modules and not hooked(optimizer) and \
            not optimizer.defaults.get("differentiable", False) and \
            "step" not in vars(optimizer):         # no step of its own (a scheduler's counter)
        raw = _unwrapped(type(optimizer))
    if raw is None:
        optimizer.step()
        return
    name = f"Optimizer.step#{type(optimizer).__name__}.step"
    with torch.autograd.profiler.record_function(name):
        with torch.no_grad():
            raw(optimizer)
        optimizer._optimizer_step_code()
