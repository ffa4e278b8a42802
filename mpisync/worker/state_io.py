"""The optimizer state between a worker and the ps ranks: read at one global step, loaded
on every rank (split by ps on the way out, merged on the way in); the moving averages read
and swapped into the model."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..errors import ConfigError
from ..protocol.spec import unit_parts
from ..protocol.state import check_state, merge_units, split_state, split_units
from ..protocol.wire import Kind
from .tracking import was_rebound

__all__ = ["StateTransfer"]


class StateTransfer:
    """Reads the consolidated state (torch's schema plus an ``"mpisync"`` entry) from the ps
    ranks and the workers, and loads one into them.

    Args:
        link: the worker's ``PsLink`` to ps 0.
        tables: the ``TableShards`` of the resident tables.
        local: the ``LocalUpdate`` of ``dense="allreduce"``, or None.
    """

    def __init__(self, spec, plan, cluster, link, tables, wrapped: torch.optim.Optimizer,
                 named: list[tuple[str, torch.Tensor]], local, dense, rows, tracker):
        self.spec, self.plan, self.cluster = spec, plan, cluster
        self.link, self.tables, self.wrapped, self.local = link, tables, wrapped, local
        self.dense, self.rows, self.tracker = dense, rows, tracker
        self.named = named
        self.names = [n for n, _ in named]
        self.parts = unit_parts(spec)
        self.swapped = False            # within swapped_in(): the model holds the averages

    def read(self, order: list[str], global_step: int,
             tables: bool) -> tuple[dict, dict[str, torch.Tensor]]:
        """``state_dict()``, and the values of the parameters the ps ranks hold, read at
        the same global step as their state (the chief's own may be a step behind them
        when a step went on without it). ``order``: the names in param-group order."""
        by_name, averages, values, step = {}, {}, {}, global_step
        for state, avg, _, held, step in self.link.from_every_ps(Kind.STATE,
                                                                 "optimizer state"):
            by_name.update(state)
            averages.update(avg)
            values.update(held)
        by_name, averages = merge_units(by_name, self.parts), merge_units(averages, self.parts)
        if self.local is not None:
            by_name.update(self.local.state())
            averages.update(self.local.averages.values())
        local = torch.optim.Optimizer.state_dict(self.wrapped)
        local["state"] = {i: by_name[n] for i, n in enumerate(order) if n in by_name}
        local["mpisync"] = {"global_step": step, "plan": self.plan.digest()}
        if tables:
            local["mpisync"]["tables"] = {
                t.name: {"num_rows": t.num_rows, "strategy": t.strategy,
                         "shards": list(self.tables.read(t.name))}
                for t in self.spec.tables if t.resident}
        if self.spec.ema_decay is not None:
            local["mpisync"]["averages"] = {n: averages[n] for n in self.names if n in averages}
        return local, merge_units(values, self.parts)

    def averages(self) -> dict[str, torch.Tensor]:
        """The moving averages of the newest global step, in ``named_parameters`` order."""
        got = {}
        for part in self.link.from_every_ps(Kind.AVERAGES, "parameter averages"):
            got.update(part)
        got = merge_units(got, self.parts)
        if self.local is not None:
            got.update(self.local.averages.values())
        return {n: got[n] for n in self.names if n in got}

    def check(self, state_dict: dict, param_groups: list, order: list[str]) -> None:
        """Refuse a state that does not fit this model, before anything is changed or sent.

        Every worker checks the same state, so every worker raises the same ConfigError.
        """
        shapes = {n: tuple(p.shape) for n, p in self.named}
        problem = check_state(state_dict, param_groups, order, shapes,
                              {t.name: t for t in self.spec.tables if t.resident})
        if problem:
            raise ConfigError(f"{self.cluster.label}: load_state_dict(): {problem}",
                              collective=True)

    def load(self, state_dict: dict, param_groups: list, order: list[str], global_step: int,
             receive: Callable[[], object]) -> None:
        """Load ``state_dict`` into the ps ranks, the tables and this worker (collective:
        every worker, at the same point). ``receive`` waits for ps 0's grant and the
        parameters that go with it."""
        self.check(state_dict, param_groups, order)
        groups = state_dict["param_groups"]
        for group, saved in zip(param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        extra = state_dict.get("mpisync", {})
        step = extra.get("global_step", global_step)
        payload = None
        by_name = {order[int(i)]: st for i, st in state_dict["state"].items()}
        local = set(self.spec.allreduce)
        if self.cluster.is_chief:
            parts = self.parts
            held = {n: st for n, st in by_name.items() if n not in local}
            averages = {n: v for n, v in extra.get("averages", {}).items() if n not in local}
            payload = (split_state(split_units(held, parts), split_units(averages, parts),
                                   groups, step, self.plan.owner, self.cluster.num_ps), step)
        if self.local is not None:
            self.local.load({n: st for n, st in by_name.items() if n in local})
            self.local.averages.load(extra.get("averages", {}))
        tracker, dense = self.tracker, self.dense
        written = tracker.written()    # model.load_state_dict() just before: kept
        kept = [dense.params[i].detach().clone() for i in written]
        kept_rows = [(t.param, t.param.detach().clone()) for t in self.rows.tables
                     if t.info is None and (t.param._version != t.version or was_rebound(t.param))]
        self.link.request(Kind.LOAD, payload)
        self.link.load_answer("load_state_dict()")   # every worker is in this call now
        self.tables.write_saved(extra.get("tables", {}))
        receive()
        with torch.no_grad():
            for i, value in zip(written, kept):
                dense.params[i].copy_(value)
            for p, value in kept_rows:       # a write again: sent whole with the next step
                p.copy_(value)
        tracker.mark(written)          # they travel with the next step

    @contextlib.contextmanager
    def swapped_in(self, averages: dict[str, torch.Tensor]) -> Iterator[None]:
        """Within the block the parameters hold ``averages`` (where they have one); after
        it, their own values again. The swaps are not writes; what was written before the
        block still travels with the next step."""
        pending = self.tracker.written()    # writes made before the block still travel
        pairs = [(p, averages[n]) for n, p in self.named if n in averages]
        with torch.no_grad():
            saved = [p.detach().clone() for p, _ in pairs]
            for p, avg in pairs:
                p.copy_(avg)
        self.swapped = True
        try:
            yield
        finally:
            self.swapped = False
            with torch.no_grad():
                for (p, _), old in zip(pairs, saved):
                    p.copy_(old)
            self.tracker.snapshot()       # the swaps are not writes ...
            self.tracker.mark(pending)    # ... but what was written before the block is
