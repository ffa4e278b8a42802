"""The job spec: one optimizer's set-up, validated once on the workers and sent to the ps ranks."""
from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .. import placement as placement_mod
from ..accumulate import REDUCTIONS, SPARSE_REDUCTIONS
from . import partition
from .hyper import HyperCodec
from .multi import JointOptimizer, JointRecipe, inners
from .rebuild import OptimizerRecipe, recipe_of
from .routes import (
    ALLREDUCE,
    DENSE_PS,
    PARTITIONED,
    SPARSE_ROWS,
    TABLE,
    Routes,
    Unit,
    plan_routes,
)
from .tables import HashTableInfo, TableSpec, sparse_modules, table_info

__all__ = [
    "BACKENDS",
    "BUFFER_MODES",
    "DEFAULT_BUCKET_BYTES",
    "DENSE_MODES",
    "PS_BUCKET_BYTES",
    "SCHEDULE_MODES",
    "SPARSE_REDUCTIONS",
    "JobSpec",
    "Model",
    "Options",
    "build_spec",
    "decode",
    "encode",
    "model_of",
    "unit_parts",
]

SPEC_VERSION = "mpisync.spec/5"
#: Gradient bytes per bucket of a push to a ps rank (``bucket_bytes`` unset, dense="ps").
PS_BUCKET_BYTES = 4 << 20
#: Gradient bytes per bucket of an allreduce among the workers (``dense="allreduce"``).
DEFAULT_BUCKET_BYTES = 4 << 20
#: What sums the workers' gradients for ``dense="allreduce"`` (``allreduce_backend``).
BACKENDS = ("mpi", "horovod", "nccl")
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
               "fp16": torch.float16, "half": torch.float16}
BUFFER_MODES = ("broadcast", "mean", "local")
SCHEDULE_MODES = ("auto", "global_step", "local")
DENSE_MODES = ("ps", "allreduce")
NONFINITE_MODES = ("raise", "skip")


@dataclass(frozen=True)
class Options:
    """What the user chose, as given to ``SyncReplicasOptimizer``."""

    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    num_tokens: int | None = None
    placement: str | Callable = "greedy_sorted"
    reduction: str = "mean"
    deterministic: bool = False
    ema_decay: float | None = None
    ema_num_updates: bool = False
    asynchronous: bool = False
    max_staleness: int | None = None
    buffers: str = "broadcast"
    schedule: str = "auto"
    partitioner: object = None
    sparse_reduction: str = "mean"
    dense: str = "ps"
    allreduce_backend: str = "mpi"
    bucket_bytes: int | None = None
    nonfinite: str = "raise"
    colocate: object = ()
    max_ps_bytes: int | None = None
    wire_dtype: object = None
    shared_memory: bool = True


@dataclass(frozen=True)
class Model:
    """The worker's model, as mpisync sees it: named parameters and named buffers."""

    params: tuple[tuple[str, torch.Tensor], ...]
    buffers: tuple[tuple[str, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class JobSpec:
    """Everything a ps rank needs to serve one optimizer; the same on every rank.

    ``names``/``shapes``/``dtypes``/``owners`` describe the dense units that live on ps
    ranks, in ``named_parameters`` order: a whole parameter (route ``dense_ps``) or one
    shard of a partitioned one, named ``"{name}/part_{k}"``; ``parts`` gives each unit's
    ``(parameter name, first row, end row)``. ``buffers`` are the module buffers that
    travel with them, as ``(name, shape, dtype, ps)``; ``tables`` the parameters whose
    rows travel instead of the whole tensor (embedding tables). With ``dense ==
    "allreduce"`` the parameters named in ``allreduce`` stay with the workers, which
    average their gradients among themselves and update them (the ps ranks hold no unit
    of them).
    """

    opt_id: int
    num_workers: int
    num_ps: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    owners: tuple[int, ...]
    buffers: tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]
    buffer_mode: str
    recipe: OptimizerRecipe | JointRecipe
    hyper: HyperCodec
    replicas_to_aggregate: int
    num_tokens: int
    reduction: str
    deterministic: bool
    global_step: int
    ema_decay: float | None
    ema_num_updates: bool
    asynchronous: bool
    max_staleness: int | None
    plan_digest: str
    parts: tuple[tuple[str, int, int], ...] = ()
    tables: tuple[TableSpec, ...] = ()
    sparse_reduction: str = "mean"
    dense: str = "ps"
    allreduce: tuple[str, ...] = ()
    allreduce_backend: str = "mpi"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    nonfinite: str = "raise"
    wire_dtype: torch.dtype | None = None
    shared_memory: bool = True

    def digest(self) -> str:
        """A short digest of the whole spec (what every rank must agree on)."""
        return hashlib.sha256(encode(self)).hexdigest()[:16]


def _named(items, what: str, found: list[str]) -> tuple[tuple[str, torch.Tensor], ...]:
    """The (name, tensor) pairs among ``items``; what is wrong with the others goes to
    ``found``."""
    pairs = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            hint = (" (model.parameters() where model.named_parameters() belongs?)"
                    if isinstance(item, torch.Tensor) else "")
            found.append(f"{what} must yield (name, tensor) pairs, as model.{what}() does; "
                         f"item #{i} is a {type(item).__name__}{hint}")
        elif not isinstance(item[0], str):
            found.append(f"{what} item #{i} has the name {item[0]!r}, not a str")
        elif not isinstance(item[1], torch.Tensor):
            found.append(f"{what} item {item[0]!r} is a {type(item[1]).__name__}, not a "
                         f"tensor")
        else:
            pairs.append(item)
    return tuple(pairs)


def model_of(named_parameters, named_buffers=None) -> tuple[Model, str | None]:
    """The model as given to ``SyncReplicasOptimizer``, and the first thing wrong with it.

    The entries that are not ``(str, tensor)`` pairs are left out of the model and
    described instead, so that every worker can agree on the failure.
    """
    found: list[str] = []
    params = _named(named_parameters, "named_parameters", found)
    buffers = _named(named_buffers or (), "named_buffers", found)
    return Model(params, buffers), (found[0] if found else None)


def encode(spec: JobSpec) -> bytes:
    """The spec as versioned bytes, for the ps ranks."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(JobSpec)}
    return pickle.dumps((SPEC_VERSION, fields), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> JobSpec:
    """The inverse of ``encode``; checks the version and the field names.

    Raises:
        ValueError: bytes from another version of mpisync, or with other fields.
    """
    version, fields = pickle.loads(data)
    if version != SPEC_VERSION:
        raise ValueError(f"job spec version {version!r}, this mpisync reads {SPEC_VERSION!r}: "
                         f"every rank must run the same mpisync")
    expected = {f.name for f in dataclasses.fields(JobSpec)}
    if set(fields) != expected:
        raise ValueError(f"job spec fields {sorted(set(fields) ^ expected)} differ from "
                         f"what this mpisync expects")
    return JobSpec(**fields)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_counts(o: Options, num_workers: int) -> tuple[int, int]:
    """(replicas_to_aggregate, num_tokens) after checking them against the workers."""
    R = o.replicas_to_aggregate
    if R is None:
        R = 1 if o.asynchronous else num_workers
    total = num_workers if o.total_num_replicas is None else o.total_num_replicas
    _check_int("replicas_to_aggregate", R, 1)
    _check_int("total_num_replicas", total, 1)
    if total != num_workers:
        raise ValueError(f"total_num_replicas={total} but the job has {num_workers} worker "
                         f"ranks; start {total} workers or leave total_num_replicas unset")
    if o.num_tokens is not None:
        _check_int("num_tokens", o.num_tokens, -(1 << 62))
        if o.num_tokens < max(0, R - total):
            raise ValueError(
                f"num_tokens={o.num_tokens} is too few: each step needs {R} gradients from "
                f"{total} workers, so num_tokens must be >= {max(0, R - total)}")
    if o.asynchronous and R != 1:
        raise ValueError(f"asynchronous mode applies each gradient alone: "
                         f"replicas_to_aggregate must be 1 (or unset), got {R}")
    if o.asynchronous and o.num_tokens:
        raise ValueError(f"asynchronous mode hands out one token per applied gradient: "
                         f"num_tokens must be unset, got {o.num_tokens}")
    if o.dense == "allreduce":
        _check_allreduce_counts(o, R, num_workers)
    return R, max(0, R - total) if o.num_tokens is None else o.num_tokens


def _check_allreduce_counts(o: Options, R: int, num_workers: int) -> None:
    """dense='allreduce' is strict sync: every worker's gradient in every step."""
    why = ("dense='allreduce' averages the dense gradients of every worker in every step "
           "(an allreduce waits for all of them), so ")
    if o.asynchronous:
        raise ValueError(why + "it cannot train asynchronously; use dense='ps' for "
                         "asynchronous training")
    if R != num_workers:
        raise ValueError(why + f"backup workers do not apply: replicas_to_aggregate must be "
                         f"the number of workers ({num_workers}) or unset, got {R}; use "
                         f"dense='ps' for backup workers")
    if o.num_tokens:
        raise ValueError(why + f"no worker may run ahead of the others: num_tokens must be "
                         f"0 or unset, got {o.num_tokens}")


def _check_options(o: Options) -> None:
    if o.max_staleness is not None:
        if not o.asynchronous:
            raise ValueError("max_staleness bounds asynchronous training: pass "
                             "asynchronous=True with it")
        _check_int("max_staleness", o.max_staleness, 0)
    if o.ema_decay is not None:
        if isinstance(o.ema_decay, bool) or not isinstance(o.ema_decay, (int, float)):
            raise TypeError(f"ema_decay must be a float, got {o.ema_decay!r}")
        if not 0.0 <= o.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {o.ema_decay}")
    if o.bucket_bytes is not None:
        _check_int("bucket_bytes", o.bucket_bytes, 1)
    if not isinstance(o.shared_memory, bool):
        raise TypeError(f"shared_memory must be True or False, got {o.shared_memory!r}")
    wire_dtype_of(o.wire_dtype)
    if o.max_ps_bytes is not None:
        _check_int("max_ps_bytes", o.max_ps_bytes, 1)
    for name, value, allowed in (("reduction", o.reduction, REDUCTIONS),
                                 ("dense", o.dense, DENSE_MODES),
                                 ("allreduce_backend", o.allreduce_backend, BACKENDS),
                                 ("sparse_reduction", o.sparse_reduction, SPARSE_REDUCTIONS),
                                 ("buffers", o.buffers, BUFFER_MODES),
                                 ("schedule", o.schedule, SCHEDULE_MODES),
                                 ("nonfinite", o.nonfinite, NONFINITE_MODES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if not (callable(o.placement) or o.placement in placement_mod.STRATEGIES):
        raise ValueError(f"placement must be one of {placement_mod.STRATEGIES} or a "
                         f"callable, got {o.placement!r}")


def wire_dtype_of(value) -> torch.dtype | None:
    """``wire_dtype`` as a torch dtype: None, torch.bfloat16 or torch.float16 (or a name).

    Raises:
        ValueError, TypeError: any other value.
    """
    if value is None or value in (torch.bfloat16, torch.float16):
        return value
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(f"wire_dtype must be a torch dtype or its name, got {value!r}")
    if isinstance(value, str) and value.lower() in WIRE_DTYPES:
        return WIRE_DTYPES[value.lower()]
    raise ValueError(f"wire_dtype must be None, torch.bfloat16 or torch.float16 (or "
                     f"'bf16', 'fp16'), got {value!r}")


def _check_model(optimizer: torch.optim.Optimizer, model: Model) -> list[str]:
    """Names of the parameters no optimizer group holds (frozen: fine-tuning)."""
    if not model.params:
        raise ValueError("named_parameters is empty")
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen, frozen = set(), []
    for name, t in model.params + model.buffers:
        if name in seen:
            raise ValueError(f"name {name!r} appears twice in named_parameters/named_buffers")
        seen.add(name)
        if t.device.type == "meta":
            raise ValueError(f"{name!r} is on the meta device (shapes only, no values); "
                             f"materialise the model on its device (cluster.device, e.g. "
                             f"model.to_empty(device=...) and an initialisation) before "
                             f"creating the SyncReplicasOptimizer")
        if t.is_sparse:
            raise TypeError(f"{name!r} is a sparse tensor; mpisync holds dense tensors")
    for name, p in model.params:
        if id(p) not in in_opt:
            frozen.append(name)
    missing = in_opt - {id(p) for _, p in model.params}
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not in "
                         f"named_parameters; pass model.named_parameters() of the whole model")
    return frozen


def _shards(partitioner, name: str, t: torch.Tensor, default=None) -> int:
    """How many shards ``partitioner`` (one, or a dict of globs) gives parameter ``name``."""
    chosen = partition.resolve(partitioner, name) or default
    if chosen is None:
        return 1
    if t.dim() == 0 and not (isinstance(partitioner, Mapping) and partitioner.get(name) is chosen):
        return 1      # a partitioner for every parameter leaves a scalar whole, as TensorFlow's
        #               variable scopes do; one given for it by name is refused below
    try:
        return chosen.num_shards(tuple(t.shape), t.element_size())
    except ValueError as exc:
        raise ValueError(f"partitioner {chosen!r} for parameter {name!r}: {exc}") from None


def _tables(live, frozen, model: Model, partitioner, num_ps: int) -> dict[str, TableSpec]:
    """The parameters whose rows travel: mpisync.Embedding tables, sparse nn.Embeddings."""
    sparse = sparse_modules([p for _, p in live])
    tables = {}
    for name, p in model.params:
        info = table_info(p)
        if info is None and id(p) not in sparse:
            continue
        if name in frozen:    # another optimizer's (or nobody's): left alone, as torch does
            continue
        if isinstance(info, HashTableInfo):
            tables[name] = _hash_table(name, info, partitioner, num_ps)
            continue
        if info is not None:
            if info.weight is not None and tuple(info.weight.shape) != (info.num_rows, info.dim):
                raise ValueError(f"mpisync.Embedding {name!r}: weight= has shape "
                                 f"{list(info.weight.shape)}, the table is "
                                 f"[{info.num_rows}, {info.dim}]")
            n = _shards(info.partitioner or partitioner, name,
                        torch.empty(info.num_rows, info.dim, dtype=info.dtype, device="meta"),
                        partition.fixed_size(num_ps))
            rows, shape, dtype = info.num_rows, (info.dim,), info.dtype
            strategy, seed, pad = info.strategy, None if info.weight is not None else info.seed, \
                info.padding_idx
        else:
            n = _shards(partitioner, name, p)
            rows, shape, dtype, strategy, seed, pad = (p.shape[0], tuple(p.shape[1:]), p.dtype,
                                                       "div", None, None)
        tables[name] = TableSpec(name, rows, shape, dtype, strategy,
                                 tuple(partition.shard_sizes(rows, n)), (), info is not None,
                                 seed, pad)
    return tables


def _hash_table(name: str, info: HashTableInfo, partitioner, num_ps: int) -> TableSpec:
    """An mpisync.HashEmbedding's table: shards of ``capacity`` slots, ids hashed to them."""
    unbounded = torch.empty(1 << 40, info.dim, dtype=info.dtype, device="meta")
    n = _shards(info.partitioner or partitioner, name, unbounded, partition.fixed_size(num_ps))
    capacity = info.hashed.capacity
    return TableSpec(name, capacity * n, (info.dim,), info.dtype, "hash", (capacity,) * n, (),
                     True, info.seed, None, info.hashed)


#: torch optimizers whose update of a tensor looks at all of it at once (factored moments,
#: orthogonalisation): a shard updated on its own would not get the same update.
WHOLE_TENSOR = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon")
                     if hasattr(torch.optim, n))


def _check_whole_tensor(optimizer, tables: dict, live, partitioner) -> None:
    if not isinstance(optimizer, WHOLE_TENSOR):
        return
    cls = type(optimizer).__name__
    split = [t.name for t in tables.values() if t.num_shards > 1 or t.resident]
    split += [n for n, p in live if n not in tables and p.dim()
              and partition.resolve(partitioner, n) is not None
              and _shards(partitioner, n, p) > 1]
    if split:
        raise ValueError(f"{cls} updates each tensor as a whole, and parameter {split[0]!r} "
                         f"would be split into shards or rows: the ps ranks would update each "
                         f"part on its own, which is not what torch computes; leave it whole "
                         f"(no partitioner, nn.Embedding instead of mpisync.Embedding) or "
                         f"use an element-wise optimizer")


def _units(live, tables: dict[str, TableSpec], partitioner, dense: str = "ps"):
    """Units of placement, each tensor's route kind, and each dense unit's rows."""
    units, kinds, parts = [], {}, {}
    for name, p in live:
        nbytes = p.numel() * p.element_size()
        if name in tables:
            t = tables[name]
            kinds[name] = TABLE if t.resident else SPARSE_ROWS
            units.extend(Unit(t.unit(k), name, rows * t.row_bytes, t.rows_of(k))
                         for k, rows in enumerate(t.shard_rows))
            continue
        n = _shards(partitioner, name, p)
        if n <= 1 and dense == "allreduce":
            kinds[name] = ALLREDUCE         # the workers keep it: no unit on any ps
            continue
        if n <= 1:
            kinds[name] = DENSE_PS
            units.append(Unit(name, name, nbytes))
            parts[name] = (name, 0, p.shape[0] if p.dim() else 0)
            continue
        kinds[name] = PARTITIONED
        row_bytes = nbytes // max(1, p.shape[0])
        start = 0
        for k, rows in enumerate(partition.shard_sizes(p.shape[0], n)):
            unit = f"{name}/part_{k}"
            units.append(Unit(unit, name, rows * row_bytes, f"{start}:{start + rows}"))
            parts[unit] = (name, start, start + rows)
            start += rows
    return units, kinds, parts


def _rows_shape(p: torch.Tensor, start: int, stop: int) -> tuple[int, ...]:
    if p.dim() == 0 or (start == 0 and stop == p.shape[0]):
        return tuple(p.shape)
    return (stop - start, *p.shape[1:])


def build_spec(optimizer: torch.optim.Optimizer, model: Model, options: Options, *,
               opt_id: int, num_workers: int, num_ps: int, global_step: int = 0,
               ) -> tuple[JobSpec, Routes]:
    """Validate everything the user gave and build the spec; raises on the first problem.

    Raises:
        TypeError, ValueError (mpisync.ConfigError for the optimizer): what is wrong, with
            the value found and the value expected.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if getattr(optimizer, "_mpisync_wrapper", False):
        raise TypeError("optimizer is already a SyncReplicasOptimizer")
    R, num_tokens = _check_counts(options, num_workers)
    _check_options(options)
    frozen = _check_model(optimizer, model)
    name_of = {id(p): n for n, p in model.params}
    recipe: OptimizerRecipe | JointRecipe
    if isinstance(optimizer, JointOptimizer):
        recipe = JointRecipe(tuple(recipe_of(o, name_of) for o in optimizer.optimizers))
    else:
        recipe = recipe_of(optimizer, name_of)
    hyper = HyperCodec.from_groups(optimizer.param_groups)
    live = [(n, p) for n, p in model.params if n not in set(frozen)]
    tables = _tables(live, frozen, model, options.partitioner, num_ps)
    for inner in inners(optimizer):
        _check_whole_tensor(inner, tables, live, options.partitioner)
        if not isinstance(inner, torch.optim.SparseAdam):
            continue
        members = {id(p) for g in inner.param_groups for p in g["params"]}
        dense = [n for n, p in live if n not in tables and p.dtype.is_floating_point
                 and id(p) in members]
        if dense:
            raise ValueError(f"torch.optim.SparseAdam takes sparse gradients only, and parameter "
                             f"{dense[0]!r} gets a dense one (torch fails at its first step); "
                             f"give the dense parameters an optimizer of their own")
    units, kinds, parts = _units(live, tables, options.partitioner, options.dense)
    buffers = model.buffers if options.buffers != "local" else ()
    routes = plan_routes(units, kinds, frozen,
                         [(n, b.numel() * b.element_size()) for n, b in buffers],
                         num_ps, options.placement, colocate=options.colocate or (),
                         max_ps_bytes=options.max_ps_bytes)
    dense = [(u, parts[u]) for u in parts]
    by_name = dict(live)
    spec = JobSpec(
        opt_id=opt_id, num_workers=num_workers, num_ps=num_ps,
        names=tuple(u for u, _ in dense),
        shapes=tuple(_rows_shape(by_name[n], a, b) for _, (n, a, b) in dense),
        dtypes=tuple(by_name[n].dtype for _, (n, _, _) in dense),
        owners=tuple(routes.owner(u) for u, _ in dense),
        buffers=tuple((n, tuple(b.shape), b.dtype, routes.owner(n)) for n, b in buffers),
        buffer_mode=options.buffers, recipe=recipe, hyper=hyper,
        replicas_to_aggregate=R, num_tokens=num_tokens, reduction=options.reduction,
        deterministic=bool(options.deterministic), global_step=global_step,
        ema_decay=None if options.ema_decay is None else float(options.ema_decay),
        ema_num_updates=bool(options.ema_num_updates),
        asynchronous=bool(options.asynchronous), max_staleness=options.max_staleness,
        plan_digest=routes.plan.digest(), parts=tuple(p for _, p in dense),
        tables=tuple(dataclasses.replace(t, owners=tuple(routes.owner(t.unit(k))
                                                          for k in range(t.num_shards)))
                     for t in tables.values()),
        sparse_reduction=options.sparse_reduction, dense=options.dense,
        allreduce=tuple(routes.names(ALLREDUCE)), allreduce_backend=options.allreduce_backend,
        bucket_bytes=options.bucket_bytes or (
            DEFAULT_BUCKET_BYTES if options.dense == "allreduce" else PS_BUCKET_BYTES),
        wire_dtype=wire_dtype_of(options.wire_dtype), shared_memory=options.shared_memory,
        nonfinite=options.nonfinite)
    if spec.nonfinite == "skip" and num_ps > 1:
        raise ValueError(f"nonfinite='skip' needs one ps rank, got {num_ps}: each ps rank "
                         f"checks its own part of a step, and skipping it on some only would "
                         f"not be the step skipped; use nonfinite='raise' or one ps rank")
    if spec.nonfinite == "skip" and options.dense == "allreduce":
        raise ValueError("nonfinite='skip' needs dense='ps': with dense='allreduce' the workers "
                         "step the dense parameters and the ps ranks the rest, each on its own, "
                         "so no one skips the step whole; use nonfinite='raise' (checked on the "
                         "workers too) or dense='ps'")
    return spec, routes


def unit_parts(spec: JobSpec) -> dict[str, tuple[str, int, int]]:
    """``unit -> (tensor name, first row, end row)`` of every unit whose values workers hold.

    Dense units, and the shards of sparse ``nn.Embedding`` weights (contiguous rows);
    ``mpisync.Embedding`` tables are not held by workers and are left out.
    """
    parts = dict(zip(spec.names, spec.parts))
    for t in spec.tables:
        if not t.resident:
            starts = partition.shard_offsets(t.num_rows, t.num_shards)
            parts.update((t.unit(k), (t.name, start, start + rows))
                         for k, (start, rows) in enumerate(zip(starts, t.shard_rows)))
    return parts
