"""Several torch optimizers stepped as one, over disjoint parameter sets.

``SyncReplicasOptimizer([opt_a, opt_b], ...)`` joins its optimizers into one
:class:`JointOptimizer`, so that a step is still one push, one token and one pull. The
joint optimizer's ``param_groups`` is the concatenation of the inner optimizers' groups
(the same dict objects: a learning-rate scheduler attached to ``opt_a`` edits a group the
joint optimizer holds), its ``state`` reads and writes the inner optimizers' state, and its
``step()`` steps each inner optimizer over its own groups. Its ``state_dict()`` has torch's
schema over the concatenated groups (parameters numbered in that order), and
``load_state_dict()`` splits such a dict back into one per inner optimizer.

On a ps rank it is rebuilt from a :class:`JointRecipe`, one recipe per inner optimizer, as
the joint optimizer of the inner optimizers rebuilt over that rank's shards (an inner
optimizer with no shard there is built over empty groups, so that every rank numbers the
groups alike). Code that picks a step by the optimizer's class (the tables' row updates)
asks :func:`inner_of` which inner optimizer holds a group. A ps rank whose dense
parameters all belong to one inner optimizer steps them with that optimizer's fused or
compiled step (:func:`sole_holder`); one that holds dense parameters of several steps them
with torch's step of each inner optimizer, which is exact too.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..native import torchstep
from .tables import table_info

__all__ = ["JointOptimizer", "JointRecipe", "inner_of", "inners", "join_state_dicts",
           "joint_problem", "sole_holder", "split_state_dict"]


def joint_problem(optimizers: Any, named_parameters: Sequence[tuple[str, torch.Tensor]]
                  ) -> str | None:
    """What is wrong with a list of optimizers to join, or None.

    Refused: an empty list, an entry that is not a ``torch.optim.Optimizer``, one parameter
    in two optimizers (or twice in one), and a trainable parameter or a table (frozen too)
    of ``named_parameters`` that no optimizer holds (each is named).
    """
    if not isinstance(optimizers, (list, tuple)):
        return f"expected a list of torch optimizers, got {type(optimizers).__name__}"
    if not optimizers:
        return "the list of optimizers is empty; give at least one torch.optim.Optimizer"
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            return (f"optimizers[{i}] is of type {type(opt).__name__}, not a "
                    f"torch.optim.Optimizer")
        if getattr(opt, "_mpisync_wrapper", False):
            return f"optimizers[{i}] is a SyncReplicasOptimizer; give the torch optimizers"
    name_of = {id(p): n for n, p in named_parameters}
    held: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) in held:
                    name = name_of.get(id(p), f"of shape {tuple(p.shape)}")
                    return (f"parameter {name!r} is in optimizers[{held[id(p)]}] and in "
                            f"optimizers[{i}]; each parameter belongs to one optimizer")
                held[id(p)] = i
    return _held_by_none(len(optimizers), named_parameters, held)


def _held_by_none(count: int, named_parameters: Sequence[tuple[str, torch.Tensor]],
                  held: dict[int, int]) -> str | None:
    """The first trainable parameter, or table (frozen too), that none of ``count``
    optimizers holds, named, or None."""
    for name, p in named_parameters:
        if id(p) in held:
            continue
        if table_info(p) is not None:       # frozen or not: its rows need an optimizer's ps
            return (f"table {name!r} of named_parameters is in no optimizer of the list "
                    f"({count} given); a table lives on the ps ranks of the optimizer that "
                    f"holds it: give it to one of them (with requires_grad=False it is looked "
                    f"up and never stepped)")
        if p.requires_grad:
            return (f"parameter {name!r} of named_parameters is in no optimizer of the list "
                    f"({count} given); give it to one of them (or set requires_grad=False to "
                    f"keep it frozen)")
    return None


class _JointState(MutableMapping):
    """The joint optimizer's ``state``: each parameter's entry in its own optimizer's."""

    def __init__(self, joint: JointOptimizer):
        self._joint = joint

    def _state_of(self, p: torch.Tensor) -> MutableMapping:
        opt = self._joint.owner_of(p)
        if opt is None:
            raise KeyError(p)
        return opt.state

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._state_of(p)[p]       # a defaultdict: an empty entry is made

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._state_of(p)[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._state_of(p)[p]

    def __contains__(self, p: object) -> bool:
        opt = self._joint.owner_of(p) if isinstance(p, torch.Tensor) else None
        return opt is not None and p in opt.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._joint.optimizers:
            yield from list(opt.state)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._joint.optimizers)

    def __repr__(self) -> str:
        return f"JointState({len(self)} entries over {len(self._joint.optimizers)} optimizers)"


class JointOptimizer(torch.optim.Optimizer):
    """Several torch optimizers over disjoint parameter sets, seen as one optimizer.

    Attributes:
        optimizers: the inner optimizers, in the order given.
        defaults: the hyper-parameters that every inner optimizer has, with the first's
            values (``add_param_group`` is refused on a joint optimizer).
        param_groups: their groups, concatenated in that order (the same dicts).
        state: their state, read and written through this one mapping.

    ``step()`` steps every inner optimizer once, in order; ``state_dict()`` is torch's
    schema over the concatenated groups, and ``load_state_dict()`` takes that schema and
    loads each inner optimizer's part into it. Every parameter must be in one group only.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        torch.optim.Optimizer.__init__(self, [torch.zeros(0)], {})
        # the hyper-parameters every inner optimizer has (the first one's values): what
        # schedulers look up (OneCycleLR's and CyclicLR's momentum or betas)
        first, *others = self.optimizers
        self.defaults = {k: v for k, v in first.defaults.items()
                         if all(k in o.defaults for o in others)}
        self.param_groups: list[dict] = []
        self.state = _JointState(self)      # type: ignore[assignment]
        self._owner: dict[int, torch.optim.Optimizer] = {}
        self.refresh()

    def refresh(self) -> None:
        """Take the inner optimizers' groups again (in place: holders of the list keep it)."""
        self.param_groups[:] = [g for opt in self.optimizers for g in opt.param_groups]
        self._owner = {id(p): opt for opt in self.optimizers
                       for g in opt.param_groups for p in g["params"]}

    def counts(self) -> list[int]:
        """The number of param groups of each inner optimizer."""
        return [len(opt.param_groups) for opt in self.optimizers]

    def owner_of(self, p: torch.Tensor) -> torch.optim.Optimizer | None:
        """The inner optimizer that holds parameter ``p`` (None: none does)."""
        return self._owner.get(id(p))

    def optimizer_of(self, group: dict) -> torch.optim.Optimizer:
        """The inner optimizer that holds ``group`` (or a copy of it with its parameters)."""
        for opt in self.optimizers:
            if any(g is group for g in opt.param_groups):
                return opt
        for p in group.get("params", ()):
            opt = self.owner_of(p)
            if opt is not None:
                return opt
        raise KeyError("no inner optimizer holds this param group")

    def add_param_group(self, param_group: dict) -> None:
        """Refused: add the group to one of the inner optimizers before joining them."""
        if not hasattr(self, "optimizers") or not hasattr(self, "_owner"):
            return                      # torch's __init__: its placeholder group is dropped
        raise TypeError("a JointOptimizer takes no param group of its own; add it to one of "
                        "the inner optimizers before joining them")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:      # type: ignore[override]
        """Step every inner optimizer over the groups ``param_groups`` holds now, in order.

        Where ``param_groups`` was replaced for a while by groups holding some of the
        parameters only (``mpisync.ps.fused.only_params``: copies of the groups, each with
        a subset of its parameters), each inner optimizer steps over its groups among
        them, and only those.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            groups = [g for g in self.param_groups if g["params"] and self.optimizer_of(g) is opt]
            if not groups:
                continue
            if len(groups) == len(opt.param_groups) and all(
                    a is b for a, b in zip(groups, opt.param_groups)):
                torchstep.step(opt)
                continue
            saved = opt.param_groups
            opt.param_groups = groups
            try:
                torchstep.step(opt)
            finally:
                opt.param_groups = saved
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every inner optimizer's ``zero_grad(set_to_none)``."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's schema over the concatenated groups into each inner optimizer."""
        for opt, part in zip(self.optimizers, split_state_dict(state_dict, self.counts())):
            opt.load_state_dict(part)
        self.refresh()


def split_state_dict(state_dict: dict, counts: Sequence[int]) -> list[dict]:
    """Torch's schema over concatenated groups split into one dict per optimizer, each
    numbering its parameters from 0 (``counts``: param groups per optimizer)."""
    groups = state_dict["param_groups"]
    if len(groups) != sum(counts):
        raise ValueError(f"the state has {len(groups)} param groups, the optimizers "
                         f"{sum(counts)} ({'+'.join(map(str, counts))})")
    state = state_dict.get("state", {})
    parts, first = [], 0
    for n in counts:
        mine = groups[first:first + n]
        ids = [i for g in mine for i in g["params"]]
        renumber = {old: new for new, old in enumerate(ids)}
        parts.append({
            "state": {renumber[i]: s for i, s in state.items() if i in renumber},
            "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]}
                             for g in mine]})
        first += n
    return parts


def join_state_dicts(state_dicts: Sequence[dict]) -> dict:
    """One dict in torch's schema over the concatenated groups, from one per optimizer
    (the inverse of :func:`split_state_dict`)."""
    state, groups, offset = {}, [], 0
    for sd in state_dicts:
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        renumber = {old: offset + new for new, old in enumerate(ids)}
        state.update({renumber[i]: s for i, s in sd.get("state", {}).items()})
        groups.extend({**g, "params": [renumber[i] for i in g["params"]]}
                      for g in sd["param_groups"])
        offset += len(ids)
    return {"state": state, "param_groups": groups}


def inners(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The inner optimizers of a joint optimizer; ``[optimizer]`` for any other."""
    if optimizer is None:
        return []
    return list(optimizer.optimizers) if isinstance(optimizer, JointOptimizer) else [optimizer]


def sole_holder(optimizer: Any, params: Sequence[torch.Tensor]) -> Any:
    """The one inner optimizer of a joint ``optimizer`` that holds every one of ``params``
    (a ps rank's dense parameters: its fused and compiled steps then take that optimizer's
    class); ``optimizer`` itself where it is not joint, or where none or several do."""
    if not isinstance(optimizer, JointOptimizer) or not params:
        return optimizer
    holders = {id(optimizer.owner_of(p)): optimizer.owner_of(p) for p in params}
    if len(holders) != 1 or None in holders.values():
        return optimizer
    return next(iter(holders.values()))


def inner_of(optimizer: Any, group: dict) -> Any:
    """The optimizer that steps ``group``: its inner optimizer where ``optimizer`` joins
    several, else ``optimizer`` itself."""
    return optimizer.optimizer_of(group) if isinstance(optimizer, JointOptimizer) else optimizer


@dataclass(frozen=True)
class JointRecipe:
    """What rebuilds a :class:`JointOptimizer` on a ps rank: one recipe per inner optimizer.

    Attributes:
        recipes: each inner optimizer's ``OptimizerRecipe``, in order.
    """

    recipes: tuple

    @property
    def groups(self) -> tuple:
        """Every inner recipe's groups, concatenated (``(hyper-parameters, names)`` each)."""
        return tuple(g for r in self.recipes for g in r.groups)

    def build(self, params_by_name: dict[str, Any]) -> JointOptimizer | None:
        """The joint optimizer over the given tensors (see ``OptimizerRecipe.build``); an
        inner optimizer none of whose names is here is built over empty groups. None when
        no name of any recipe is here."""
        per = [[[t for n in names if n in params_by_name for t in _as_list(params_by_name[n])]
                for _, names in r.groups] for r in self.recipes]
        if not any(any(groups) for groups in per):
            return None
        return JointOptimizer([r._construct(groups) for r, groups in zip(self.recipes, per)])

    def summary(self) -> dict[str, str]:
        """Each inner recipe's summary, its keys prefixed by ``optimizer {i}``."""
        out = {"optimizers": str(len(self.recipes))}
        for i, r in enumerate(self.recipes):
            out.update((f"optimizer {i} {k}", v) for k, v in r.summary().items())
        return out


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]

