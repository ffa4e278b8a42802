"""Routes: how each parameter (or buffer) travels, from the placement plan (no MPI)."""
from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .. import placement as placement_mod

__all__ = ["ALLREDUCE", "BUFFER", "DENSE_PS", "PARTITIONED", "REPLICATED", "SPARSE_ROWS",
           "TABLE", "Route", "Routes", "Unit", "colocated_units", "plan_routes"]

DENSE_PS = "dense_ps"          # whole on ps j: pushed as gradients, pulled as parameters
BUFFER = "buffer"              # a module buffer kept on ps j: pushed and pulled as values
REPLICATED = "replicated"      # not optimized: broadcast from the chief once, then left alone
PARTITIONED = "partitioned"    # row ranges on several ps ranks; whole on every worker
SPARSE_ROWS = "sparse_rows"    # whole on every worker, sharded on the ps: only touched rows travel
TABLE = "table"                # lives on the ps ranks only (mpisync.Embedding): rows on demand
ALLREDUCE = "allreduce"        # averaged among the workers, updated there


@dataclass(frozen=True)
class Route:
    """One tensor's route: its kind and the ps index of each of its units (one if whole)."""

    kind: str
    ps: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unit:
    """A unit of placement: a whole tensor, or one shard (a range of rows) of one."""

    name: str          # the tensor's name, or "{name}/part_{k}" for a shard
    tensor: str        # the tensor it belongs to
    nbytes: int
    rows: str = ""     # "a:b" for a shard of contiguous rows, "k of n (mod)" for a table's


@dataclass(frozen=True)
class Routes:
    """Every tensor's route, and the placement plan of those that live on ps ranks."""

    routes: Mapping[str, Route]
    plan: placement_mod.Plan

    def names(self, kind: str) -> list[str]:
        """Names routed ``kind``, in the order they were given."""
        return [n for n, r in self.routes.items() if r.kind == kind]

    def owner(self, name: str) -> int:
        """The ps index of a unit (a whole tensor or a shard's unit name)."""
        return self.plan.owner(name)


def plan_routes(units: Sequence[Unit], kinds: Mapping[str, str], frozen: Sequence[str],
                buffers: Sequence[tuple[str, int]], num_ps: int,
                strategy: str | Callable = "greedy_sorted",
                colocate: Sequence[Sequence[str]] = (),
                max_ps_bytes: int | None = None) -> Routes:
    """Place every unit, and route every tensor: to ps ranks, or left with the workers.

    Args:
        units: the units of the tensors the optimizer updates, in creation order; a
            partitioned tensor or a table has one unit per shard, each placed on its own.
        kinds: each optimized tensor's route kind (``dense_ps``, ``partitioned``,
            ``sparse_rows``, ``table``, or ``allreduce``: kept by the workers, no unit).
        frozen: names of parameters that no optimizer group holds (fine-tuning): they are
            broadcast from the chief at set-up and left alone, as torch leaves them.
        buffers: ``(name, nbytes)`` of module buffers that travel with the parameters.
        num_ps: number of ps ranks.
        strategy: placement strategy, see ``mpisync.placement.plan``.
        colocate: groups of tensor (or unit) names that share their ps, see
            ``colocated_units``.
        max_ps_bytes: the most bytes one ps may hold, see ``mpisync.placement.plan``.
    """
    every = list(units) + [Unit(n, n, size) for n, size in buffers]
    groups = colocated_units(colocate, every, kinds, frozen)
    plan = placement_mod.plan([u.name for u in every], [u.nbytes for u in every], num_ps,
                              strategy, rows=[u.rows for u in every], colocate=groups,
                              max_ps_bytes=max_ps_bytes)
    owners: dict[str, list[int]] = {}
    for u in units:
        owners.setdefault(u.tensor, []).append(plan.owner(u.name))
    routes = {n: Route(kinds[n], tuple(ps)) for n, ps in owners.items()}
    routes.update({n: Route(ALLREDUCE) for n, kind in kinds.items() if kind == ALLREDUCE})
    routes.update({n: Route(BUFFER, (plan.owner(n),)) for n, _ in buffers})
    routes.update({n: Route(REPLICATED) for n in frozen})
    return Routes(routes, plan)


def colocated_units(colocate: Sequence[Sequence[str]], units: Sequence[Unit],
                    kinds: Mapping[str, str] | None = None, frozen: Sequence[str] = ()
                    ) -> list[tuple[str, ...]]:
    """Groups of tensor names as groups of the units the plan places.

    A name is a tensor (a parameter or a buffer), one unit of one (``"w/part_2"``), or a
    glob (``fnmatch``: ``"enc.*"``) standing for every tensor it matches. A whole tensor
    is one unit; a partitioned parameter or a table has one per shard, and its members are
    colocated shard by shard: shard k of each member with shard k of the others, so every
    member of such a group must have as many shards (name single shards to colocate them
    otherwise).

    Raises:
        TypeError: ``colocate`` is not a list of lists of names.
        ValueError: a name that no ps holds (unknown, frozen, or averaged among the
            workers with ``dense="allreduce"``), a glob that matches none of them, a name
            in two groups, or members with different shard counts.
    """
    kinds = kinds or {}
    of_tensor: dict[str, list[str]] = {}
    for u in units:
        of_tensor.setdefault(u.tensor, []).append(u.name)
    unit_names = {u.name for u in units}
    groups = placement_mod.check_groups(
        [_expand(group, list(of_tensor), unit_names)
         for group in placement_mod.check_groups(colocate)])
    out: list[tuple[str, ...]] = []
    for group in groups:
        members = [(name, of_tensor.get(name) or _unit_of(name, unit_names, kinds, frozen))
                   for name in group]
        counts = {len(us) for _, us in members}
        if len(counts) > 1:
            (a, ua), (b, ub) = next((m, n) for m in members for n in members
                                    if len(m[1]) != len(n[1]))
            raise ValueError(f"colocate group {list(group)}: {a!r} is {_shards(ua)} and {b!r} "
                             f"{_shards(ub)}; partitioned members are colocated shard by "
                             f"shard, so each needs as many shards (or name single shards, "
                             f"{ua[0]!r}, ...)")
        out.extend(tuple(us[k] for _, us in members) for k in range(counts.pop()))
    return out


def _shards(unit_names: list[str]) -> str:
    return "whole" if len(unit_names) == 1 else f"in {len(unit_names)} shards"


def _expand(group: Sequence[str], tensors: list[str], unit_names: set[str]) -> list[str]:
    """A group with each glob replaced by the tensors it matches (in model order)."""
    out: list[str] = []
    for name in group:
        if name in unit_names or name in tensors or not any(c in name for c in "*?["):
            matched = [name]
        else:
            matched = [t for t in tensors if fnmatch.fnmatchcase(t, name)]
            if not matched:
                raise ValueError(f"colocate: {name!r} matches none of the parameters and "
                                 f"buffers the ps ranks hold ({', '.join(tensors[:8])}"
                                 f"{', ...' if len(tensors) > 8 else ''})")
        out += [m for m in matched if m not in out]
    return out


def _unit_of(name: str, unit_names: set[str], kinds: Mapping[str, str],
             frozen: Sequence[str]) -> list[str]:
    if name in unit_names:
        return [name]
    if kinds.get(name) == ALLREDUCE:
        raise ValueError(f"colocate: {name!r} is averaged among the workers (dense='allreduce'), "
                         f"no ps holds it")
    if name in frozen:
        raise ValueError(f"colocate: {name!r} is held by no param group of the optimizer, so "
                         f"no ps holds it")
    close = difflib.get_close_matches(name, sorted(unit_names | set(kinds)), n=3)
    hint = f"; did you mean {close}?" if close else ""
    raise ValueError(f"colocate: no parameter or buffer is named {name!r}{hint} (module "
                     f"buffers are placed only when named_buffers= is given and buffers is "
                     f"not 'local')")
