"""What a worker's optimizer refuses: changed param groups or attributes, a GradScaler, a
step inside ``averaged()``, parameters the model no longer holds, a new param group."""
from __future__ import annotations

import operator

import torch

from ..errors import ConfigError
from ..protocol.multi import JointOptimizer
from ..protocol.rebuild import changed_settings

__all__ = ["check_groups", "check_held", "check_settings", "refuse_add_param_group",
           "refuse_grad_scaler", "refuse_step_in_averaged"]


def check_groups(groups: list, held: list[tuple], names: list[str],
                 params: list[torch.Tensor], label: str) -> None:
    """The param groups hold the parameters they held at set-up (``held``: the ps ranks' set).

    Raises:
        ConfigError: a parameter was added to or removed from a group, or they moved.
    """
    if len(groups) == len(held) and all(
            len(g["params"]) == len(h) and all(map(operator.is_, g["params"], h))
            for g, h in zip(groups, held)):
        return
    name_of = dict(zip(map(id, params), names))
    before = [name_of.get(id(p), "?") for h in held for p in h]
    now = [name_of.get(id(p), "a parameter not in named_parameters")
           for g in groups for p in g["params"]]
    change = ([f"{n!r} added" for n in now if n not in before]
              + [f"{n!r} removed" for n in before if n not in now]) or ["their order"]
    raise ConfigError(
        f"{label}: the param groups changed after the SyncReplicasOptimizer "
        f"was created ({', '.join(change)}); the ps ranks hold the parameters of the "
        f"groups given at set-up: create the optimizer with every param group and "
        f"parameter (one with requires_grad=False, or without a gradient, is skipped), "
        f"and do not change param_groups[i]['params']")


def check_settings(settings: dict, wrapped: torch.optim.Optimizer, label: str) -> None:
    """The wrapped optimizer's attributes are the ps ranks' since set-up: unchanged."""
    changed = changed_settings(settings, wrapped)
    if changed:
        name = changed[0]
        owner, attribute, what = wrapped, name, type(wrapped).__name__
        if isinstance(wrapped, JointOptimizer):      # "{i}.{attribute}" of its i-th optimizer
            index, attribute = name.split(".", 1)
            owner = wrapped.optimizers[int(index)]
            what = f"{type(owner).__name__} (optimizer {index} of the list)"
        raise ConfigError(
            f"{label}: the wrapped {what}'s attribute "
            f"{attribute!r} changed from {settings[name]!r} to "
            f"{getattr(owner, attribute, '<deleted>')!r} after the SyncReplicasOptimizer was "
            f"created; the ps ranks rebuilt the optimizer with the old value. Keep values "
            f"that change during training in param_groups: they travel with every step")


def check_held(tracker, label: str) -> None:
    """No gradient at all: the model may hold other parameters than this optimizer."""
    gone = tracker.replaced()
    if gone:
        raise ConfigError(
            f"{label}: the model no longer holds parameters {gone} of this "
            f"SyncReplicasOptimizer: they were replaced by new ones (model.to('meta'), "
            f"to_empty(), or a new parameter assigned), which it does not know. Move or "
            f"convert the model before creating the optimizer")


def refuse_grad_scaler(kwargs: dict, label: str) -> None:
    """``step()`` called by ``torch.amp.GradScaler`` (or with unknown arguments): refused."""
    if set(kwargs) - {"grad_scaler"}:
        raise TypeError(f"{label}: step() got unexpected arguments {sorted(kwargs)}")
    raise ConfigError(
        f"{label}: torch.amp.GradScaler is not supported yet: each worker "
        f"would skip the steps its own gradients overflow in, and the workers would "
        f"drift apart. Train in float32, or with bfloat16 autocast (no scaler needed)",
        collective=True)


def refuse_step_in_averaged(label: str) -> None:
    """``step()`` inside ``averaged()``: the model holds the averages, not the parameters."""
    raise RuntimeError(f"{label}: step() inside averaged(): the model "
                       f"holds the moving averages there, not the parameters")


def refuse_add_param_group(label: str) -> None:
    """``add_param_group()`` once set up: the ps ranks hold a fixed set of parameters."""
    raise ConfigError(
        f"{label}: add_param_group() after the SyncReplicasOptimizer was "
        f"created; create the optimizer with every param group first (a group of "
        f"parameters with requires_grad=False, whose .grad stays None, is skipped until "
        f"they get gradients)", collective=True)
