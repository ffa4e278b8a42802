"""TorchRec as a peer of ``recsys_bench.py``: the same model, the table row-wise sharded.

Run in the peers' virtualenv (``make venv-peers``: TorchRec and fbgemm-gpu-cpu, never in
``.venv``), on 2 ranks of one machine over gloo::

    .venv-peers/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/torchrec_bench.py --optimizer exact

The model is ``recsys_bench.py``'s: one table of ``--rows`` x 64 float32 rows (an
``EmbeddingBagCollection`` of one table, sum pooling), bags of 20 ids drawn uniformly
(``numpy.random.default_rng([seed, rank])``, the ids ``recsys_bench.py``'s worker of the
same index draws), ``Linear(64, 1)``, ``BCEWithLogitsLoss`` on random labels, 4,096
samples per rank. ``DistributedModelParallel`` shards the table row-wise over the ranks
(``ShardingType.ROW_WISE``, compute kernel ``fused``: fbgemm's table-batched embedding on
the CPU, the optimizer fused into backward) with ``--optimizer exact``
(``EmbOptimType.EXACT_ADAGRAD``) or ``rowwise`` (``EXACT_ROWWISE_ADAGRAD``: one
accumulator per row), lr 0.01, eps 1e-10 (torch's Adagrad default); the ``Linear`` is
replicated (DDP over gloo) and stepped by ``torch.optim.Adagrad`` (lr 0.01).

A step: forward (ids all-to-all, lookup and pooling on each shard, the pooled sums
reduce-scattered back to their samples), loss, backward (the pooled gradients sent back
to the shards, each table update applied there; the ``Linear``'s gradient allreduced),
the dense optimizer's step. Rank 0 prints one JSON object as the last line of stdout:
the median step time over ``--steps`` timed steps after ``--warmup``, its phases, every
rank's peak RSS and an estimate of the bytes a rank sends per step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# the script's folder is on sys.path: the helpers of the table benchmark (numpy only)
from embedding_bench import machine, ms, peak_rss_mb

DIM = 64
BAG = 20
OPTIMIZERS = ("exact", "rowwise")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="exact",
                        help="exact: EXACT_ADAGRAD; rowwise: EXACT_ROWWISE_ADAGRAD")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the table")
    parser.add_argument("--batch", type=int, default=4096, help="samples per rank")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rows < 1 or args.batch < 1:
        parser.error("--steps, --rows and --batch must be at least 1, --warmup at least 0")
    return args


def build(args, world_size: int):
    """The sharded model, its dense optimizer and the ``ShardingPlan`` (printed by rank 0)."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            table = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=args.rows,
                                       feature_names=["f"], pooling=PoolingType.SUM)
            # on "meta": each rank materialises only its own rows when sharded
            self.sparse = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
            self.linear = torch.nn.Linear(DIM, 1)

        def forward(self, kjt):
            return self.linear(self.sparse(kjt)["f"]).squeeze(1)

    torch.manual_seed(args.seed)
    model = Model()
    optim = {"exact": EmbOptimType.EXACT_ADAGRAD,
             "rowwise": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[args.optimizer]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optim, "learning_rate": args.lr, "eps": 1e-10})
    module_plan: EmbeddingModuleShardingPlan = construct_module_sharding_plan(
        model.sparse, {"t": row_wise(compute_kernel="fused")}, sharder=sharder,
        local_size=world_size, world_size=world_size, device_type="cpu")
    plan = ShardingPlan({"sparse": module_plan})
    env = ShardingEnv.from_process_group(torch.distributed.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, env=env, plan=plan, sharders=[sharder],
                                   device=torch.device("cpu"))
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = torch.optim.Adagrad(list(dense.values()), lr=args.lr)
    return dmp, dense_opt, plan, sorted(dense)


def batch(rng: np.random.Generator, args):
    """One rank's batch: a ``KeyedJaggedTensor`` of ``batch`` bags of 20 ids, and labels."""
    import torch
    from torchrec import KeyedJaggedTensor

    ids = torch.from_numpy(rng.integers(0, args.rows, size=args.batch * BAG, dtype=np.int64))
    labels = torch.from_numpy(rng.random(args.batch) < 0.2).float()
    lengths = torch.full((args.batch,), BAG, dtype=torch.int32)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=lengths), labels


def estimated_bytes(args, world_size: int) -> dict:
    """What one rank sends per step, from the row-wise sharding's collectives (not measured).

    Forward: the ids and lengths all-to-all (a rank keeps its own shard's ids, sends the
    rest: about ``(W - 1) / W`` of its ``batch * 20`` int64 ids and ``batch`` int32
    lengths per other rank) and the reduce-scatter of the pooled sums (each rank pools
    all ``W * batch`` bags over its own rows and sends the other ranks their
    ``batch x 64`` float32 partial sums). Backward: the pooled gradients all-gathered
    (``batch x 64`` float32 to each other rank) and the ids' all-to-all is not repeated;
    the ``Linear``'s 65 float32 gradients are allreduced.
    """
    other = world_size - 1
    ids = args.batch * BAG * 8 * other // world_size + args.batch * 4 * other
    pooled = args.batch * DIM * 4 * other
    return {"ids_all_to_all": ids, "pooled_reduce_scatter": pooled,
            "pooled_grad_all_gather": pooled, "dense_allreduce": (DIM + 1) * 4 * other,
            "total": ids + 2 * pooled + (DIM + 1) * 4 * other}


def main() -> None:
    args = parse_args()
    import torch
    import torch.distributed as dist
    import torchrec

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    model, dense_opt, plan, dense_names = build(args, world)
    setup_s = time.perf_counter() - start
    loss_fn = torch.nn.BCEWithLogitsLoss()
    rng = np.random.default_rng([args.seed, rank])
    step_s, fwd_s, bwd_s, opt_s = [], [], [], []
    for i in range(args.warmup + args.steps):
        kjt, labels = batch(rng, args)
        dist.barrier()                      # untimed: every rank starts the step together
        t0 = time.perf_counter()
        dense_opt.zero_grad()
        loss = loss_fn(model(kjt), labels)
        t1 = time.perf_counter()
        loss.backward()                     # the table's rows are updated in here
        t2 = time.perf_counter()
        dense_opt.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            step_s.append(t3 - t0)
            fwd_s.append(t1 - t0)
            bwd_s.append(t2 - t1)
            opt_s.append(t3 - t2)
    mine = {"step_ms": ms(step_s), "step_ms_p10": ms(step_s, 10),
            "step_ms_p90": ms(step_s, 90), "forward_ms": ms(fwd_s),
            "backward_ms": ms(bwd_s), "dense_opt_ms": ms(opt_s)}
    rss = [None] * world
    dist.all_gather_object(rss, peak_rss_mb())
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        sharding = plan.plan["sparse"]["t"]
        result = {
            "kind": "torchrec", "optimizer": {"exact": "EXACT_ADAGRAD",
                                              "rowwise": "EXACT_ROWWISE_ADAGRAD"}[args.optimizer],
            "rows": args.rows, "dim": DIM, "bag": BAG, "batch_per_rank": args.batch,
            "ranks": world, "steps": args.steps, "warmup": args.warmup,
            **mine, "step_ms_per_rank": [r["step_ms"] for r in per_rank],
            "sharding_type": sharding.sharding_type, "compute_kernel": sharding.compute_kernel,
            "shard_rows": [s.shard_sizes[0] for s in sharding.sharding_spec.shards],
            "dense_params": dense_names,
            "bytes_per_step_estimated": estimated_bytes(args, world),
            "peak_rss_mb": rss, "setup_s": round(setup_s, 2),
            "torch": torch.__version__, "torchrec": torchrec.__version__,
            "fbgemm_gpu": _version("fbgemm_gpu"), "threads": torch.get_num_threads(),
            "machine": machine(),
        }
        line = json.dumps(result)
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(line + "\n")
        print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # about one run in four (torch 2.13, torchrec and fbgemm 1.8) aborted in the
    # interpreter's teardown after the result ("terminate called without an active
    # exception": a native thread still joinable); everything is written and flushed here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


if __name__ == "__main__":
    main()
