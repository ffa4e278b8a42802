"""Routes: how each parameter (or buffer) travels, from the placement plan (no MPI)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import placement as placement_mod

__all__ = ["ALLREDUCE", "BUFFER", "DENSE_PS", "PARTITIONED", "REPLICATED", "SPARSE_ROWS",
           "Route", "Routes", "plan_routes"]

DENSE_PS = "dense_ps"          # whole on ps j: pushed as gradients, pulled as parameters
BUFFER = "buffer"              # a module buffer kept on ps j: pushed and pulled as values
REPLICATED = "replicated"      # not optimized: broadcast from the chief once, then left alone
PARTITIONED = "partitioned"    # row ranges on several ps ranks
SPARSE_ROWS = "sparse_rows"    # only the rows a batch touches travel
ALLREDUCE = "allreduce"        # averaged among the workers, updated there


@dataclass(frozen=True)
class Route:
    """One tensor's route: its kind and, for the ps-held kinds, the owning ps index."""

    kind: str
    ps: int | None = None


@dataclass(frozen=True)
class Routes:
    """Every tensor's route, and the placement plan of those that live on ps ranks."""

    routes: Mapping[str, Route]
    plan: placement_mod.Plan

    def names(self, kind: str) -> list[str]:
        """Names routed ``kind``, in the order they were given."""
        return [n for n, r in self.routes.items() if r.kind == kind]

    def owner(self, name: str) -> int:
        return self.plan.owner(name)


def _not_yet(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} is not available in this version of mpisync: every optimized parameter "
        f"lives whole on one ps rank (route {DENSE_PS!r})")


def plan_routes(params: Sequence[tuple[str, int]], frozen: Sequence[str],
                buffers: Sequence[tuple[str, int]], num_ps: int,
                strategy: str | Callable = "greedy_sorted", dense: str = "ps",
                partitioner=None) -> Routes:
    """Route every tensor: optimized parameters and buffers to ps ranks, frozen ones stay.

    Args:
        params: ``(name, nbytes)`` of the parameters the optimizer updates.
        frozen: names of parameters that no optimizer group holds (fine-tuning): they are
            broadcast from the chief at set-up and left alone, as torch leaves them.
        buffers: ``(name, nbytes)`` of module buffers that travel with the parameters.
        num_ps: number of ps ranks.
        strategy: placement strategy, see ``mpisync.placement.plan``.
        dense: ``"ps"``; ``"allreduce"`` has its place but is not built yet.
        partitioner: splitting parameters across ps ranks has its place but is not built.

    Raises:
        NotImplementedError: for the routes this version does not build.
    """
    if dense != "ps":
        raise _not_yet(f"dense={dense!r} ({ALLREDUCE} route)")
    if partitioner is not None:
        raise _not_yet(f"partitioner= ({PARTITIONED} route)")
    units = list(params) + list(buffers)
    plan = placement_mod.plan([n for n, _ in units], [s for _, s in units], num_ps, strategy)
    routes = {n: Route(DENSE_PS, plan.owner(n)) for n, _ in params}
    routes.update({n: Route(BUFFER, plan.owner(n)) for n, _ in buffers})
    routes.update({n: Route(REPLICATED) for n in frozen})
    return Routes(routes, plan)
