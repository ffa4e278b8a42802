"""Embedding tables under backup workers, K-batch and async (see test_tables.py).

``--mode backup``: 3 workers, 2 gradients per step, worker 2 slow; ``kbatch``: 4
gradients per step from 3 workers; ``async``: asynchronous training. Each worker reports
the statistics; ``--rows N --ids K`` instead measures the bytes a step moves and the
worker's peak memory with a table of N rows and K ids per worker per step.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
from common import run

import mpisync

DIM = 8


def train(cluster, args) -> dict:
    w = cluster.worker_index
    emb = mpisync.Embedding(args.rows, DIM, partitioner=mpisync.fixed_size(3), seed=1)
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, 1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sync = {"backup": {"replicas_to_aggregate": 2}, "kbatch": {"replicas_to_aggregate": 4},
            "async": {"asynchronous": True}, "scale": {}}[args.mode]
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **sync)
    g = torch.Generator().manual_seed(w)
    before = opt.stats["gradients_applied"] if args.mode == "scale" else 0
    for t in range(args.steps):
        if opt.stopped:
            break
        ids = torch.randint(0, args.rows, (args.ids,), generator=g)
        opt.zero_grad()
        loss = head(emb(ids)).pow(2).mean()
        loss.backward()
        if args.mode == "backup" and w == 2:
            time.sleep(0.3)                      # the slow one
        opt.step()
        del t
    stats = opt.stats
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"global_step": opt.global_step, "dropped": stats["gradients_dropped"],
           "dropped_per_worker": stats["dropped_per_worker"],
           "taken_per_worker": stats["taken_per_worker"], "bytes_per_step": sum(stats["bytes_per_ps"]),
           "table_bytes": args.rows * DIM * 4, "peak_rss_mb": rss_mb, "applied_before": before}
    opt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="scale")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--ids", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    run(lambda cluster: train(cluster, args))


if __name__ == "__main__":
    main()
