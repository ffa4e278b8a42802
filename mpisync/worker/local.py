"""The parameters the workers update themselves (``dense="allreduce"``): their step and state."""
from __future__ import annotations

import torch

from ..errors import NonFiniteError
from ..protocol.updates import apply_fn
from .allreduce import AllreduceChannel, LocalAverages

__all__ = ["LocalUpdate", "cast_state"]


def cast_state(p: torch.Tensor, key: str, value):
    """A loaded state value as torch's load_state_dict casts it (CPU), in a tensor of its own."""
    if not torch.is_tensor(value):
        return value
    if key != "step" and p.is_floating_point():
        return value.to(dtype=p.dtype, copy=True)
    return value.clone()


class LocalUpdate:
    """The wrapped optimizer applied on every worker to the parameters averaged among them.

    Their gradients are averaged in buckets started from gradient hooks while backward
    runs (``AllreduceChannel``); each worker then applies the wrapped optimizer to them
    alone, with the chief's hyper-parameters, as a ps rank applies a step, and keeps their
    moving averages (``LocalAverages``). Every other parameter stays on the ps ranks.
    Construction is collective over the workers: the chief's optimizer state for these
    parameters, if it had one, is broadcast to every worker.
    """

    def __init__(self, spec, cluster, wrapped: torch.optim.Optimizer, param_groups: list,
                 named: list[tuple[str, torch.Tensor]], rows):
        self.spec, self.label, self.wrapped = spec, cluster.label, wrapped
        self.names = list(spec.allreduce)
        self.by_name = dict(named)
        local = [self.by_name[n] for n in self.names]
        self.channel = AllreduceChannel(
            local, self.names, cluster.workers_only, num_workers=spec.num_workers,
            reduction=spec.reduction, bucket_bytes=spec.bucket_bytes,
            backend=spec.allreduce_backend, opt_id=spec.opt_id, label=cluster.label,
            cuda_aware=cluster.cuda_aware)
        ids = {id(p) for p in local}
        self.ps_held = [p for g in param_groups for p in g["params"] if id(p) not in ids]
        self.averages = LocalAverages(spec.ema_decay, spec.ema_num_updates,
                                      list(zip(spec.allreduce, local)))
        self.updates: list = []      # opt.update()'s functions for these parameters
        # a backward that gives only table rows a gradient still takes part in the round
        rows.on_grad = self.channel.touch
        self.channel.hooks += [self.by_name[t.name].register_post_accumulate_grad_hook(
            self.channel.touch) for t in spec.tables if not t.resident]
        # the chief's optimizer state for them, if it had one, as for the ps-held ones
        state = cluster.workers_only.bcast(self.state() if cluster.is_chief else None, root=0)
        self.load(state)

    def state(self) -> dict[str, dict]:
        """The wrapped optimizer's state of the parameters the workers update, by name."""
        name_of = {id(p): n for n, p in self.by_name.items()}
        local = set(self.names)
        return {name_of[id(p)]: {k: v.clone() if torch.is_tensor(v) else v
                                 for k, v in st.items()}
                for p, st in self.wrapped.state.items() if name_of.get(id(p)) in local}

    def load(self, by_name: dict[str, dict]) -> None:
        """Replace the state of the parameters the workers update (torch's dtype rules)."""
        for n in self.names:
            p = self.by_name[n]
            self.wrapped.state.pop(p, None)
            if n in by_name:
                self.wrapped.state[p] = {k: cast_state(p, k, v) for k, v in by_name[n].items()}

    def check_finite(self, global_step: int) -> None:
        """``nonfinite="raise"`` for the gradients the workers averaged (``dense="allreduce"``):
        the same on every worker, so every worker raises, before the step changes anything."""
        local = self.channel
        if all(p.grad is None or torch.isfinite(p.grad.sum()) for p in local.params):
            return
        name = next(local.name_of[id(p)] for p in local.params
                    if p.grad is not None and not torch.isfinite(p.grad).all())
        raise NonFiniteError(
            f"{self.label}: the gradient of parameter {name!r} for global step "
            f"{global_step}, averaged over the workers (dense='allreduce'), holds NaN or "
            f"Inf; the step is not applied (nonfinite='raise')")

    def step(self, own_hyper, param_groups: list, global_step: int) -> None:
        """The wrapped optimizer's step over the parameters the workers update, alone,
        with the chief's hyper-parameters (as a ps rank applies a step).

        ``own_hyper``: this worker's hyper-parameters, encoded for the push.
        """
        chief = self.channel.chief_hyper(*own_hyper)
        held = [(p, p.grad) for p in self.ps_held if p.grad is not None]
        for p, _ in held:
            p.grad = None              # torch skips them: the ps ranks update those
        try:
            if chief is not None:
                self.spec.hyper.decode(*chief, param_groups)
            self.wrapped.step()
        finally:
            if chief is not None:
                self.spec.hyper.decode(*own_hyper, param_groups)
            for p, g in held:
                p.grad = g
        for fn, name, p in self.updates:      # opt.update()'s, where these live
            apply_fn(fn, p.detach(), name)
        self.averages.update(global_step + 1)
