"""Embedding tables given bad input on purpose, one per --case (see test_tables.py)."""
from __future__ import annotations

import sys

import torch
from common import run

import mpisync

CASE = sys.argv[sys.argv.index("--case") + 1]
ROWS, DIM = 50, 4


def worker(cluster):
    w = cluster.worker_index
    strategy = "hash" if CASE == "bad_strategy" else "mod"
    weight = None
    if CASE == "weight_differs":
        weight = torch.zeros(ROWS + (w == 1), DIM)
    emb = mpisync.Embedding(ROWS, DIM, partition_strategy=strategy, weight=weight)
    model = torch.nn.Module()
    model.emb = emb
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    partitioner = {"scale": mpisync.fixed_size(2)} if CASE in ("zero_dim", "retry") else None
    try:
        opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(),
                                            partitioner=partitioner)
    except mpisync.ConfigError:
        if CASE != "retry":
            raise
        print(f"worker {w}: set up again without the partitioner", flush=True)
        opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
    for t in range(4):
        ids = torch.arange(5)
        if w == 1 and t == 2:
            ids = {"out_of_range": torch.tensor([3, ROWS]), "negative": torch.tensor([-1, 2]),
                   "float_ids": torch.tensor([1.0, 2.0]),
                   "int16_ids": torch.tensor([1, 2], dtype=torch.int16)}.get(CASE, ids)
        opt.zero_grad()
        (emb(ids).sum() * model.scale).backward()
        opt.step()
    opt.close()
    if CASE == "retry":
        print(f"worker {w}: trained to step {opt.global_step}", flush=True)


if __name__ == "__main__":
    run(worker)
