"""One DLRM step: mpisync (tables on the ps ranks) against TorchRec's DLRM and one process.

The model is ``examples/dlrm.py``'s: 13 dense features through a bottom MLP (64, then
``--dim``), ``--tables`` (26) tables of ``--rows`` (10^5) x ``--dim`` (64) float32 rows
pooled by sum over bags of 1 to 3 ids, the pairwise dot products of the 1 + ``--tables``
vectors, a top MLP (64, 32, 1), ``BCEWithLogitsLoss``, ``--batch`` samples per worker.
The batches are the example's click logs (its true model, fixed by ``--seed``), drawn
before the timed loop from ``numpy.random.default_rng([seed, worker_index])``:
TorchRec's rank ``r`` and the one process train on what mpisync's worker ``r`` does.

The tables' size: 26 x 10^5 x 64 float32 is 666 MB (2.6 million rows), and the row-wise
optimizers add one float per row (10 MB). The jobs run one after another, so one copy of
the tables is in memory at a time: on the ps ranks of an mpisync job (halved over 2 ps
ranks), split in two over TorchRec's ranks, or whole in the one process (with a step's
sparse gradients). That is well within the 24 GiB of the machine the benchmark is run
on, so the defaults are the sizes DLRM is benchmarked with (26 tables of 10^5 x 64), not
smaller ones. ``--optimizer adagrad`` doubles the tables' memory (an accumulator per
element).

Optimizers, ``--optimizer``: ``adam+rowwise`` (the default, the example's recipe and
DLRM's and TorchRec's): Adam (``--dense-lr``, 0.003) for the MLPs and a row-wise Adagrad
(``--lr``, 0.05, eps 1e-10) for the tables; ``adagrad``: one Adagrad (``--lr``, eps
1e-10) for every parameter. ``--kind`` picks who trains it:

- ``mpisync`` (under ``python -m mpisync.launch``): the example's ``DLRM`` over one
  ``mpisync.EmbeddingBagCollection`` of ``mpisync.EmbeddingBag(rows, dim, mode="sum")``
  tables (rows on the ps ranks, drawn there from the seed); the example's optimizers
  (``dlrm.optimizers``: ``torch.optim.Adam`` and ``mpisync.RowWiseAdagrad``, or one
  ``torch.optim.Adagrad``) in one ``SyncReplicasOptimizer``. The chief's JSON holds the
  bytes it moved per step (the median of the last warm-up step and the last timed step),
  as ``opt.stats`` counts them: the push to every ps rank and the tables' lookups out
  and back; between the ranks of one node the MLPs' gradients and parameters pass
  through shared memory, outside these figures (``dense_params``: their size)::

      .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- \\
          .venv/bin/python benchmarks/dlrm_bench.py --kind mpisync

- ``torchrec`` (in the peers' virtualenv, ``make venv-peers``, under
  ``torch.distributed.run`` on 2 ranks over gloo, as ``torchrec_bench.py``):
  ``torchrec.models.dlrm.DLRM`` over a ``torchrec.EmbeddingBagCollection`` of the same
  tables, ``DistributedModelParallel`` with every table row-wise sharded over the ranks
  (compute kernel ``fused``, the tables' optimizer fused into backward:
  ``EXACT_ROWWISE_ADAGRAD``, or ``EXACT_ADAGRAD`` with ``--optimizer adagrad``, same lr
  and eps), the MLPs replicated (DDP) and stepped by ``torch.optim.Adam`` (``--dense-lr``;
  ``torch.optim.Adagrad``, ``--lr``, with ``--optimizer adagrad``)::

      .venv-peers/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
          benchmarks/dlrm_bench.py --kind torchrec

- ``local``: the example's ``DLRM`` in one plain process over ``nn.EmbeddingBag(...,
  sparse=True)`` tables, on the combined batch of ``--workers`` workers, the same
  optimizers stepped one after the other (the example's ``--local``:
  ``mpisync.RowWiseAdagrad`` steps the tables' sparse gradients as any torch optimizer)::

      .venv/bin/python benchmarks/dlrm_bench.py --kind local

Each prints one JSON object as the last line of stdout: the median step time (and its
10th and 90th percentiles) over ``--steps`` timed steps after ``--warmup`` untimed ones,
and every rank's peak RSS. ``--all`` (a plain process) runs, one job after another,
mpisync on 2 workers + 1 ps and on 2 workers + 2 ps, TorchRec (only where
``.venv-peers`` exists) and the one process, and prints one JSON line: each job's step
median, p10 and p90, bytes per step (mpisync's), every rank's peak RSS, and each mpisync
job's step time as ratios to TorchRec's and to the one process's::

    .venv/bin/python benchmarks/dlrm_bench.py --all
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

# the script's folder is on sys.path: the helpers of the table benchmark (numpy only)
from embedding_bench import machine, ms, peak_rss_mb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# examples/dlrm.py: the model and its data (it imports numpy and torch only)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import dlrm

PEERS_PYTHON = os.path.join(ROOT, ".venv-peers", "bin", "python")
BOTTOM = (64,)
TOP = (64, 32, 1)
OPTIMIZERS = ("adam+rowwise", "adagrad")
# TorchRec's names of the optimizers: (tables, fused in backward; MLPs)
TORCHREC_OPTIMIZERS = {"adam+rowwise": ("EXACT_ROWWISE_ADAGRAD", "Adam"),
                       "adagrad": ("EXACT_ADAGRAD", "Adagrad")}
EPS = 1e-10          # the tables' Adagrad (mpisync.RowWiseAdagrad's, torch's Adagrad's)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("mpisync", "torchrec", "local"), default="mpisync")
    parser.add_argument("--tables", type=int, default=26, help="sparse features, a table each")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of each table")
    parser.add_argument("--dim", type=int, default=64, help="width of the tables' rows")
    parser.add_argument("--batch", type=int, default=2048, help="samples per worker")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam+rowwise",
                        help="adam+rowwise: Adam for the MLPs, a row-wise Adagrad for the "
                             "tables (examples/dlrm.py's); adagrad: one Adagrad for all")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of the tables' Adagrad (of every parameter's "
                             "with --optimizer adagrad)")
    parser.add_argument("--dense-lr", type=float, default=0.003,
                        help="Adam's learning rate, for the MLPs (--optimizer adam+rowwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2,
                        help="local: workers whose batches are combined; driver: ranks")
    parser.add_argument("--all", action="store_true",
                        help="driver: every kind as its own job, one JSON line")
    parser.add_argument("--timeout", type=float, default=600, help="driver: seconds per job")
    args = parser.parse_args(argv)
    for name in ("tables", "rows", "dim", "batch", "steps", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def batches(args, worker_index: int) -> list[dlrm.Batch]:
    """Every batch of one worker (warm-up and timed), drawn before the loop."""
    teacher = dlrm.Teacher(args.seed, args.tables, args.rows)
    rng = np.random.default_rng([args.seed, worker_index])
    return [teacher.draw(rng, args.batch) for _ in range(args.warmup + args.steps)]


def combined(parts: list[dlrm.Batch]) -> dlrm.Batch:
    """One batch of the samples of ``parts``, in order (each table's offsets shifted)."""
    ids, offsets = [], []
    for t in range(len(parts[0].ids)):
        shift = np.cumsum([0] + [len(p.ids[t]) for p in parts[:-1]])
        ids.append(np.concatenate([p.ids[t] for p in parts]))
        offsets.append(np.concatenate([p.offsets[t] + s for p, s in zip(parts, shift)]))
    return dlrm.Batch(np.concatenate([p.dense for p in parts]), ids, offsets,
                      np.concatenate([p.clicks for p in parts]),
                      np.concatenate([p.true_prob for p in parts]))


def time_steps(step, data: list, warmup: int, before=None) -> list[float]:
    """Seconds of each step after the warm-up; ``before(i)`` runs untimed before step
    ``i`` (0-based, warm-up included)."""
    seconds = []
    for i, item in enumerate(data):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        step(item)
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
    return seconds


def figures(args, kind: str, seconds: list[float], **more) -> dict:
    import torch
    return {"kind": kind, "optimizer": args.optimizer, "lr": args.lr,
            "dense_lr": args.dense_lr, "tables": args.tables, "rows": args.rows,
            "dim": args.dim, "batch_per_worker": args.batch, "steps": args.steps,
            "warmup": args.warmup, "step_ms": ms(seconds), "step_ms_p10": ms(seconds, 10),
            "step_ms_p90": ms(seconds, 90), **more, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def dlrm_step(model, opt, loss_fn):
    """One step of the example's ``DLRM`` on a ``dlrm.Batch``."""
    import torch

    def step(batch):
        dense, sparse = dlrm.inputs(batch, model.features)
        opt.zero_grad()
        loss_fn(model(dense, sparse), torch.from_numpy(batch.clicks)).backward()
        opt.step()
    return step


def counted_bytes(stats: dict) -> dict:
    """The bytes of a worker's last step as ``opt.stats`` counts them, every ps rank
    together: the push (the tables' rows or bags, and the dense gradients unless they
    pass through shared memory), the tables' lookups out and their answers back."""
    return {"pushed": sum(stats["bytes_per_ps"]),
            "lookup_sent": sum(stats["lookup_sent_per_ps"]),
            "lookup_received": sum(stats["lookup_received_per_ps"])}


def step_bytes(counted: list[dict], dense_bytes: int) -> dict:
    """A worker's messages per step (the median of the steps ``counted``): sent (push and
    lookups) and received (the lookups' answers).

    ``dense_params`` is the size of the MLPs, whose gradients go out and parameters come
    back every step: in the push and the pull between nodes, through shared memory
    between the ranks of one node (mpisync's default on x86-64), where ``opt.stats``
    counts only the push's header and the pull is not in these figures either way.
    """
    med = {k: int(np.median([c[k] for c in counted])) for k in counted[0]}
    return {**med, "worker_sent": med["pushed"] + med["lookup_sent"],
            "worker_received": med["lookup_received"], "dense_params": dense_bytes,
            "steps_counted": len(counted)}


# ---------------------------------------------------------------- the three kinds

def run_mpisync(args) -> None:
    import torch

    import mpisync

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cluster = mpisync.init()
    if cluster.is_ps:
        cluster.serve()
        result = None
    else:
        data = batches(args, cluster.worker_index)
        torch.manual_seed(args.seed)
        names = dlrm.feature_names(args.tables)
        tables = mpisync.EmbeddingBagCollection({
            name: mpisync.EmbeddingBag(args.rows, args.dim, mode="sum", seed=args.seed + i)
            for i, name in enumerate(names)})
        model = dlrm.DLRM(tables, names, args.dim, bottom=BOTTOM, top=TOP)
        in_tables = {id(p) for p in tables.parameters()}
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                          if id(p) not in in_tables)
        # the example's optimizers, stepped together on the ps ranks
        opts = dlrm.optimizers(args, model, tables)
        opt = mpisync.SyncReplicasOptimizer(opts, named_parameters=model.named_parameters(),
                                            cluster=cluster)
        counted = []

        def before(i: int) -> None:
            # untimed, a request to ps 0: the bytes of the last warm-up step
            if i == args.warmup and i > 0:
                counted.append(counted_bytes(opt.stats))

        seconds = time_steps(dlrm_step(model, opt, torch.nn.BCEWithLogitsLoss()), data,
                             args.warmup, before=before)
        counted.append(counted_bytes(opt.stats))      # the last timed step's
        opt.close()
        result = figures(args, "mpisync", seconds, workers=cluster.num_workers,
                         ps=cluster.num_ps, optimizers=[type(o).__name__ for o in opts],
                         bytes_per_step=step_bytes(counted, dense_bytes))
    world, is_chief, is_ps = cluster.comm, cluster.is_chief, cluster.is_ps
    cluster.close()
    ranks = world.gather((is_ps, peak_rss_mb()), root=0)
    if is_chief:
        result["worker_peak_rss_mb"] = [rss for ps, rss in ranks if not ps]
        result["ps_peak_rss_mb"] = [rss for ps, rss in ranks if ps]
        result["peak_rss_mb"] = [rss for _, rss in ranks]
        print(json.dumps(result), flush=True)


def run_local(args) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    per_worker = [batches(args, w) for w in range(args.workers)]
    data = [combined(list(parts)) for parts in zip(*per_worker)]
    torch.manual_seed(args.seed)
    names = dlrm.feature_names(args.tables)
    tables = dlrm.LocalTables({name: torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum",
                                                           sparse=True) for name in names})
    model = dlrm.DLRM(tables, names, args.dim, bottom=BOTTOM, top=TOP)
    # the example's --local: its optimizers stepped one after the other
    opts = dlrm.optimizers(args, model, tables)
    seconds = time_steps(dlrm_step(model, dlrm.Stepped(opts), torch.nn.BCEWithLogitsLoss()),
                         data, args.warmup)
    print(json.dumps(figures(args, "local", seconds, workers=args.workers,
                             optimizers=[type(o).__name__ for o in opts],
                             peak_rss_mb=[peak_rss_mb()])), flush=True)


def build_torchrec(args, world_size: int):
    """TorchRec's DLRM, every table row-wise sharded (its optimizer fused in backward),
    and the dense optimizer."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(args.seed)
    names = dlrm.feature_names(args.tables)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=name, embedding_dim=args.dim,
                                   num_embeddings=args.rows, feature_names=[name],
                                   pooling=PoolingType.SUM) for name in names],
        device=torch.device("meta"))       # each rank materialises only its own rows
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=dlrm.NUM_DENSE,
                 dense_arch_layer_sizes=[*BOTTOM, args.dim], over_arch_layer_sizes=list(TOP))
    sparse_optim, _ = TORCHREC_OPTIMIZERS[args.optimizer]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": getattr(EmbOptimType, sparse_optim),
                      "learning_rate": args.lr, "eps": EPS})
    module_plan = construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        {name: row_wise(compute_kernel="fused") for name in names}, sharder=sharder,
        local_size=world_size, world_size=world_size, device_type="cpu")
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan})
    env = ShardingEnv.from_process_group(torch.distributed.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, env=env, plan=plan, sharders=[sharder],
                                   device=torch.device("cpu"))
    dense = list(dict(in_backward_optimizer_filter(dmp.named_parameters())).values())
    if args.optimizer == "adagrad":
        dense_opt = torch.optim.Adagrad(dense, lr=args.lr, eps=EPS)
    else:
        dense_opt = torch.optim.Adam(dense, lr=args.dense_lr)
    return dmp, dense_opt, names


def run_torchrec(args) -> None:
    import torch
    import torch.distributed as dist
    import torchrec
    from torchrec import KeyedJaggedTensor

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, dense_opt, names = build_torchrec(args, world)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def as_torchrec(batch: dlrm.Batch):
        lengths = [np.diff(np.append(off, len(ids))) for ids, off in zip(batch.ids,
                                                                          batch.offsets)]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=names, values=torch.from_numpy(np.concatenate(batch.ids)),
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)))
        return torch.from_numpy(batch.dense), kjt, torch.from_numpy(batch.clicks)

    def step(item):
        dense, kjt, clicks = item
        dense_opt.zero_grad()
        loss_fn(model(dense, kjt).squeeze(1), clicks).backward()   # the rows update here
        dense_opt.step()

    data = [as_torchrec(b) for b in batches(args, rank)]
    seconds = time_steps(step, data, args.warmup, before=lambda i: dist.barrier())
    rss = [None] * world
    dist.all_gather_object(rss, peak_rss_mb())
    # the fused optimizer's state of the first table: a row-wise Adagrad holds one
    # accumulator per row ([rows]), an exact one one per element ([rows, dim])
    state = model.fused_optimizer.state_dict()["state"]
    first = next(v for k, v in state.items() if k.endswith(f".{names[0]}.weight"))
    state_shapes = {k: list(v.size()) for k, v in first.items()}
    if rank == 0:
        sparse_optim, dense_optim = TORCHREC_OPTIMIZERS[args.optimizer]
        print(json.dumps(figures(args, "torchrec", seconds, ranks=world, peak_rss_mb=rss,
                                 table_optimizer_state=state_shapes,
                                 torchrec_optimizers=f"{sparse_optim} (tables, fused), "
                                                     f"{dense_optim} (MLPs)",
                                 sharding="row_wise, fused", torchrec=torchrec.__version__)),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # as torchrec_bench.py: leave without the interpreter's teardown, which has been seen
    # to abort after the result with torch 2.13, torchrec and fbgemm 1.8
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the driver

def configurations(args, peers: bool | None = None) -> list[tuple[str, list[str]]]:
    """``(name, command line)`` of every job the driver runs, in order: mpisync on
    ``--workers`` workers and 1 ps rank, then 2; TorchRec (``peers``: by default, where
    ``.venv-peers`` exists); the one process."""
    if peers is None:
        peers = os.path.exists(PEERS_PYTHON)
    me, py, W = os.path.abspath(__file__), sys.executable, str(args.workers)
    flags = ["--tables", str(args.tables), "--rows", str(args.rows), "--dim", str(args.dim),
             "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
             str(args.warmup), "--optimizer", args.optimizer, "--lr", str(args.lr),
             "--dense-lr", str(args.dense_lr), "--seed", str(args.seed)]
    jobs = [(f"mpisync_{W}w{ps}p",
             [py, "-m", "mpisync.launch", "--workers", W, "--ps", str(ps), "--timeout",
              str(args.timeout), "--", py, me, "--kind", "mpisync", *flags])
            for ps in (1, 2)]
    if peers:
        jobs.append(("torchrec", [PEERS_PYTHON, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node", W, me, "--kind", "torchrec", *flags]))
    jobs.append(("local", [py, me, "--kind", "local", "--workers", W, *flags]))
    return jobs


def run_one(command: list[str], timeout: float) -> dict:
    """One job: the JSON object on the last line of its stdout, or why there is none."""
    start = time.perf_counter()
    try:
        # check=False: a failed job is reported with its error, not raised
        proc = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT,
                              capture_output=True, text=True, check=False,
                              timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout + 30} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines and lines[-1].startswith("{"):
        return {**json.loads(lines[-1]), "job_s": round(time.perf_counter() - start, 1)}
    return {"error": f"exit {proc.returncode}",
            "output_tail": (proc.stdout + proc.stderr).strip().splitlines()[-15:]}


def summary(runs: dict[str, dict]) -> dict:
    """Each job's step median, p10 and p90, bytes per step (mpisync's), every rank's
    peak RSS; and each mpisync job's step time over the others' (TorchRec's, the one
    process's)."""
    rows = {}
    for name, run in runs.items():
        if "error" in run:
            rows[name] = {"error": run["error"]}
            continue
        rows[name] = {"step_ms": run["step_ms"], "step_ms_p10": run["step_ms_p10"],
                      "step_ms_p90": run["step_ms_p90"], "peak_rss_mb": run["peak_rss_mb"]}
        if run["kind"] == "mpisync":
            moved = run["bytes_per_step"]
            rows[name].update(bytes_sent_per_worker=moved["worker_sent"],
                              bytes_received_per_worker=moved["worker_received"],
                              worker_peak_rss_mb=run["worker_peak_rss_mb"],
                              ps_peak_rss_mb=run["ps_peak_rss_mb"])
    ratios = {name: {f"over_{other}": round(row["step_ms"] / rows[other]["step_ms"], 2)
                     for other in rows
                     if not other.startswith("mpisync") and "error" not in rows[other]}
              for name, row in rows.items() if name.startswith("mpisync") and "error" not in row}
    return {"jobs": rows, "mpisync_step_ratios": ratios}


def drive(args) -> None:
    runs = {}
    for name, command in configurations(args):
        print(f"{name} ...", file=sys.stderr, flush=True)
        runs[name] = run_one(command, args.timeout)
    skipped = [] if "torchrec" in runs else [
        f"TorchRec: no {os.path.relpath(PEERS_PYTHON, ROOT)} (make venv-peers)"]
    print(json.dumps({"machine": machine(), "optimizer": args.optimizer,
                      "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                      **summary(runs), "skipped": skipped, "runs": runs}),
          flush=True)


def main() -> None:
    args = parse_args()
    if args.all:
        drive(args)
    else:
        {"mpisync": run_mpisync, "torchrec": run_torchrec, "local": run_local}[args.kind](args)


if __name__ == "__main__":
    main()
