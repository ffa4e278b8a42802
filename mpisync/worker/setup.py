"""A worker's set-up: its cluster checked, the spec built on every worker, agreed among them,
sent to the ps ranks."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..protocol.compare import first_failure, model_summary, setup_summary, versions
from ..protocol.spec import Model, Options, build_spec, encode, model_of, unit_parts
from ..protocol.state import split_state, split_units
from ..protocol.wire import Tag
from ..runtime import lazydynamo
from ..runtime.agreement import agree
from .allreduce import backend_problem
from .devices import default_backend, gpu_identity

__all__ = ["agree_spec", "agreed_setup", "initial_pieces", "setup_problem", "worker_cluster"]


def worker_cluster(cluster):
    """``cluster``, refused when it is None (no ``mpisync.init()``) or a ps rank's."""
    if cluster is None:
        raise RuntimeError("call mpisync.init() on every rank before creating a "
                           "SyncReplicasOptimizer")
    if cluster.is_ps:
        raise RuntimeError(f"{cluster.label}: SyncReplicasOptimizer is for workers; "
                           f"ps ranks call cluster.serve()")
    return cluster


def agreed_setup(optimizer: torch.optim.Optimizer, named_parameters, named_buffers,
                 options: Options, cluster, opt_id: int, stats_log,
                 problem: str | None = None):
    """Read the model, agree on the spec with every worker (``agree_spec``) and send it to
    the ps ranks; with ``deterministic``, make torch's kernels deterministic here too.

    Call on every worker. Returns ``(model, spec, routes)``. ``problem``: what the caller
    found wrong already (every worker raises it, or another worker's).
    """
    model, found = model_of(named_parameters, named_buffers)
    problem = problem or found
    names = [n for n, _ in model.params]
    params = [p for _, p in model.params]
    # every worker's GPU, on every worker: "auto" picks NCCL only where none is shared
    gpus = cluster.workers_only.allgather(gpu_identity(params))
    options = replace(options, allreduce_backend=default_backend(options.allreduce_backend,
                                                                 gpus))
    spec, routes = agree_spec(optimizer, model, options, opt_id, cluster, stats_log,
                              problem or setup_problem(optimizer, options, cluster, names,
                                                       params, gpus))
    if options.deterministic:
        lazydynamo.deterministic()
    return model, spec, routes


def setup_problem(optimizer: torch.optim.Optimizer, options: Options, cluster,
                  names: list[str], params: list[torch.Tensor],
                  gpus: list | None = None) -> str | None:
    """What the spec cannot see: another open optimizer's parameters, the backend."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    name_of = dict(zip(map(id, params), names))
    for k, other in enumerate(cluster.optimizers):
        if other.closed or (options.dense != "ps" and other.spec.dense != "ps"):
            continue
        shared = [name_of.get(id(p), "?") for g in other.param_groups for p in g["params"]
                  if id(p) in mine]
        if shared:
            return (f"parameter {shared[0]!r} is held by SyncReplicasOptimizer #{k} too, "
                    f"which is open: the ps ranks would update it for each of them on its "
                    f"own; give each parameter to one optimizer (or close the other first)")
    if options.dense == "allreduce" and cluster.losses is not None:
        return ("dense='allreduce' averages gradients in collectives among the workers, "
                "which cannot complete once a worker is lost: a job that survives lost "
                "workers keeps its dense parameters on the ps ranks (dense='ps')")
    if options.dense == "allreduce":
        return backend_problem(options.allreduce_backend, cluster.workers_only,
                               cluster.num_workers, gpus)
    return None


def agree_spec(optimizer: torch.optim.Optimizer, model: Model, options: Options, opt_id: int,
               cluster, stats_log, problem: str | None = None):
    """Build the spec on every worker, agree on it, and send it to the ps ranks.

    Call on every worker. Every worker raises the same error when any of them found a
    problem, or when they disagree on the model, the optimizer, the placement or an
    option.

    Returns:
        ``(spec, routes)``.
    """
    spec = routes = None
    error = problem
    try:
        if error is None:          # (a problem found may leave no optimizer to build over)
            spec, routes = build_spec(optimizer, model, options, opt_id=opt_id,
                                      num_workers=cluster.num_workers, num_ps=cluster.num_ps)
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = str(exc)
    found: list = []           # what the judge found: (exception type, text) or None

    def judge(gathered: list) -> Exception | None:
        found.append(first_failure(gathered, cluster.layout.worker_ranks))
        return found[0] and found[0][0](f"{cluster.label}: {found[0][1]}", collective=True)

    try:
        agree(cluster.workers_only, (error, model_summary(model), setup_summary(spec, routes)),
              judge)
    finally:                   # the ps ranks hear the verdict: the spec, or what failed
        if cluster.is_chief:
            message = ("error", found[0]) if found[0] or spec is None else (
                "spec", encode(spec), initial_pieces(optimizer, spec, routes, model),
                {"stats_log": stats_log, "mpisync": versions()})
            for j in range(cluster.num_ps):
                cluster.p2p_comm.send(message, dest=cluster.ps_rank(j), tag=Tag.SETUP)
    return spec, routes


def initial_pieces(optimizer: torch.optim.Optimizer, spec, routes, model: Model) -> list:
    """The wrapped optimizer's state, if it already had one, for each ps rank."""
    if not optimizer.state:
        return [None] * spec.num_ps
    name_of = {id(p): n for n, p in model.params}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    resident = {t.name for t in spec.tables if t.resident}
    by_name = {name_of[id(p)]: st for p, st in optimizer.state.items()
               if name_of[id(p)] not in resident     # a table's stand-in: nothing held
               and name_of[id(p)] not in spec.allreduce}     # the workers keep these
    by_unit = split_units(by_name, unit_parts(spec))
    return split_state(by_unit, {}, groups, 0, routes.owner, spec.num_ps)
