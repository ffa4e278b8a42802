"""Routes: how each parameter (or buffer) travels, from the placement plan (no MPI)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import placement as placement_mod

__all__ = ["ALLREDUCE", "BUFFER", "DENSE_PS", "PARTITIONED", "REPLICATED", "SPARSE_ROWS",
           "TABLE", "Route", "Routes", "Unit", "plan_routes"]

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
                strategy: str | Callable = "greedy_sorted") -> Routes:
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
    """
    every = list(units) + [Unit(n, n, size) for n, size in buffers]
    plan = placement_mod.plan([u.name for u in every], [u.nbytes for u in every], num_ps,
                              strategy, rows=[u.rows for u in every])
    owners: dict[str, list[int]] = {}
    for u in units:
        owners.setdefault(u.tensor, []).append(plan.owner(u.name))
    routes = {n: Route(kinds[n], tuple(ps)) for n, ps in owners.items()}
    routes.update({n: Route(ALLREDUCE) for n, kind in kinds.items() if kind == ALLREDUCE})
    routes.update({n: Route(BUFFER, (plan.owner(n),)) for n, _ in buffers})
    routes.update({n: Route(REPLICATED) for n in frozen})
    return Routes(routes, plan)
