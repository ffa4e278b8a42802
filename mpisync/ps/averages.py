"""Exponential moving averages of one shard's parameters, kept beside them on the ps."""
from __future__ import annotations

import torch

from ..protocol.wire import ShardLayout, entry_views, region_views

__all__ = ["MovingAverages"]


class MovingAverages:
    """Exponential moving averages of one shard's floating-point parameters.

    ``average = decay * average + (1 - decay) * parameter`` after every applied step, over
    each fused region of the shard at once. With ``num_updates`` the decay is
    ``min(decay, (1 + t) / (10 + t))`` after the t-th update, as TensorFlow's
    ``ExponentialMovingAverage(decay, num_updates=global_step)`` does. The averages start
    equal to the parameters. Without a decay every method does nothing.
    """

    def __init__(self, decay: float | None, num_updates: bool, params: torch.Tensor,
                 layout: ShardLayout) -> None:
        self.decay = decay
        self.num_updates = bool(num_updates)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.views: dict[str, torch.Tensor] = {}
        if decay is None or not layout.entries:
            return
        buf = params.clone()
        floating = [r for r in layout.regions if r[0].is_floating_point]
        self.pairs = list(zip(region_views(buf, 0, floating), region_views(params, 0, floating)))
        entries = [e for e in layout.entries if e.dtype.is_floating_point]
        self.views = {e.name: v for e, v in zip(entries, entry_views(buf, 0, entries))}

    def update(self, t: int) -> None:
        if not self.pairs:
            return
        decay = min(self.decay, (1 + t) / (10 + t)) if self.num_updates else self.decay
        for average, param in self.pairs:
            average.lerp_(param, 1.0 - decay)

    def values(self) -> dict[str, torch.Tensor]:
        """``{name: average}``, copies."""
        return {name: v.clone() for name, v in self.views.items()}

    def load(self, saved: dict | None) -> None:
        """Restore saved averages; parameters without a saved one restart from the parameter."""
        if not self.pairs:
            return
        for average, param in self.pairs:
            average.copy_(param)
        for name, value in (saved or {}).items():
            self.views[name].copy_(value)
