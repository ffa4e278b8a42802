"""The set-up the ranks compare: summaries of the spec and the model, and the first failure.

The workers allgather ``(error, model_summary, setup_summary)``; ``first_failure`` reads the
same answer from the same list on every worker, so all of them raise the same error or none
does. A ps rank compares ``versions()`` with the workers' before it reads the spec.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import ConfigError, ModelMismatchError
from .routes import REPLICATED
from .wire import WIRE_VERSION

if TYPE_CHECKING:
    from .routes import Routes
    from .spec import JobSpec, Model

__all__ = [
    "first_difference",
    "first_failure",
    "model_difference",
    "model_summary",
    "setup_summary",
    "versions",
]


def first_difference(mine: dict, theirs: dict) -> str | None:
    """The first field whose value differs between two summaries, described; else None."""
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = mine.get(key, "<missing>"), theirs.get(key, "<missing>")
        if a != b:
            return f"{key} = {b} where worker 0 has {a}"
    return None


def setup_summary(spec: JobSpec | None, routes: Routes | None) -> dict[str, str]:
    """Plain text per field, compared between workers at set-up (the model aside)."""
    if spec is None or routes is None:
        return {}
    summary = {"mpisync": versions()}
    summary.update((f"optimizer {k}", v) for k, v in spec.recipe.summary().items())
    summary["colocate"] = repr([list(group) for group in routes.plan.colocate])
    for name, owner in zip(routes.plan.names, routes.plan.owners):
        summary[f"placement of {name!r}"] = f"ps {owner}"
    for t in spec.tables:
        summary[f"table {t.name!r}"] = (
            f"{t.num_rows} rows of {list(t.row_shape)} {t.dtype}, shards {list(t.shard_rows)} "
            f"({t.strategy}), " + ("on the ps ranks, " if t.resident else "sparse gradients, ")
            + ("initial values from weight=" if t.seed is None else f"seed {t.seed}")
            + f", padding_idx {t.padding_idx}" + (f", {t.hashed}" if t.hashed else ""))
    summary["frozen parameters"] = repr(routes.names(REPLICATED))
    for f in ("replicas_to_aggregate", "num_tokens", "reduction", "deterministic",
              "ema_decay", "ema_num_updates", "asynchronous", "max_staleness", "buffer_mode",
              "sparse_reduction", "dense", "allreduce_backend", "bucket_bytes", "wire_dtype",
              "shared_memory", "nonfinite"):
        summary[f] = repr(getattr(spec, f))
    summary["parameters averaged by allreduce"] = repr(spec.allreduce)
    summary["hyper-parameter layout"] = repr(spec.hyper)
    return summary


def versions() -> str:
    """This rank's mpisync and wire format, as the set-up compares them."""
    from .. import __version__  # late: defined once the package is imported
    return f"{__version__} (wire format {WIRE_VERSION})"


def model_summary(model: Model) -> tuple:
    """What must match between workers about the model: names, shapes and dtypes."""
    return tuple((n, tuple(t.shape), str(t.dtype)) for n, t in model.params + model.buffers)


def _describe(entry) -> str:
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name!r} shape {list(shape)} {dtype}"


def model_difference(ref: Sequence, mine: Sequence) -> str | None:
    """How a worker's model summary differs from worker 0's ``ref``, or None."""
    for i in range(max(len(ref), len(mine))):
        a = ref[i] if i < len(ref) else None
        b = mine[i] if i < len(mine) else None
        if a != b:
            return (f"parameter #{i} = {_describe(b)} but worker 0 has {_describe(a)}; "
                    f"every worker must build the same model")
    return None


def first_failure(gathered: list, worker_ranks: tuple[int, ...]) -> tuple[type, str] | None:
    """The first problem any worker found, or the first way a worker differs from worker 0."""
    for w, (error, _, _) in enumerate(gathered):
        if error is not None:
            return ConfigError, f"worker {w} (rank {worker_ranks[w]}): {error}"
    ref_model, ref = gathered[0][1], gathered[0][2]
    for w, (_, model, _) in enumerate(gathered[1:], start=1):
        diff = model_difference(ref_model, model)
        if diff:
            return ModelMismatchError, f"worker {w} (rank {worker_ranks[w]}) has {diff}"
    differing = [(w, first_difference(ref, summary))
                 for w, (_, _, summary) in enumerate(gathered[1:], start=1)]
    differing = [(w, d) for w, d in differing if d]
    if differing:
        w, diff = differing[0]
        names = ", ".join(f"worker {v} (rank {worker_ranks[v]})" for v, _ in differing)
        return ConfigError, (f"workers set up the optimizer differently from worker 0: "
                             f"{names}; worker {w} has {diff}. Every worker must create the "
                             f"same optimizer with the same arguments and placement")
    return None
