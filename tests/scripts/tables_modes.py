"""Embedding tables under backup workers, K-batch and async (see test_tables_jobs.py).

``mode="backup"``: 3 workers, 2 gradients per step, worker 2 slow; ``"kbatch"``: 4
gradients per step from 3 workers; ``"async"``: asynchronous training; ``"scale"``:
synchronous, for the bytes a step moves and the worker's peak memory with a table of
``rows`` rows and ``ids`` ids per worker per step. tests/scripts/tables.py runs these as
cases of its job; run alone (``--mode``, ``--rows``, ``--ids``, ``--steps``), each worker
reports one record; ``--sizes N,M,...`` runs the scale mode once per table size, in that
order, in one job (one record per size, ``case="rows-N"``: the worker's peak memory so far).
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
from common import emit, run

import mpisync

DIM = 8


def train(cluster, mode: str = "scale", rows: int = 1000, ids: int = 20,
          steps: int = 10) -> dict:
    """One optimizer over a table of ``rows`` rows and a head, trained ``steps`` steps."""
    w = cluster.worker_index
    emb = mpisync.Embedding(rows, DIM, partitioner=mpisync.fixed_size(3), seed=1)
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, 1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sync = {"backup": {"replicas_to_aggregate": 2}, "kbatch": {"replicas_to_aggregate": 4},
            "async": {"asynchronous": True}, "scale": {}}[mode]
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **sync)
    g = torch.Generator().manual_seed(w)
    before = opt.stats["gradients_applied"] if mode == "scale" else 0
    for _ in range(steps):
        if opt.stopped:
            break
        batch = torch.randint(0, rows, (ids,), generator=g)
        opt.zero_grad()
        loss = head(emb(batch)).pow(2).mean()
        loss.backward()
        if mode == "backup" and w == 2:
            time.sleep(0.3)                      # the slow one
        opt.step()
    stats = opt.stats
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"global_step": opt.global_step, "dropped": stats["gradients_dropped"],
           "dropped_per_worker": stats["dropped_per_worker"],
           "taken_per_worker": stats["taken_per_worker"],
           "bytes_per_step": sum(stats["bytes_per_ps"]),
           "table_bytes": rows * DIM * 4, "peak_rss_mb": rss_mb, "applied_before": before}
    opt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="scale")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--ids", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", default=None)
    args = parser.parse_args()

    def worker(cluster):
        if args.sizes is None:
            return train(cluster, args.mode, args.rows, args.ids, args.steps)
        for rows in map(int, args.sizes.split(",")):
            emit(role="worker", worker=cluster.worker_index, case=f"rows-{rows}",
                 **train(cluster, args.mode, rows, args.ids, args.steps))
        return None

    run(worker)


if __name__ == "__main__":
    main()
