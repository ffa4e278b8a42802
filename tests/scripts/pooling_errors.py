"""Bags given bad input on purpose by worker 1 at its third step, one per --case (see
test_pooling.py): the job must end on every rank, the table and the rank named."""
from __future__ import annotations

import sys

import torch
from common import run

import mpisync

CASE = sys.argv[sys.argv.index("--case") + 1]
ROWS, DIM = 50, 4


def collection(cluster):
    """A collection of two tables; worker 1 leaves feature "b" out at its third step."""
    w = cluster.worker_index
    model = torch.nn.Module()
    model.ebc = mpisync.EmbeddingBagCollection(
        {k: mpisync.EmbeddingBag(ROWS, DIM, mode="sum", pool_on_ps=True) for k in "ab"})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    for t in range(4):
        features = {"a": torch.arange(6).view(3, 2), "b": torch.arange(6).view(3, 2)}
        if w == 1 and t == 2:
            del features["b"]
        opt.zero_grad()
        sum(out.sum() for out in model.ebc(features).values()).backward()
        opt.step()
    opt.close()


def worker(cluster):
    if CASE == "missing_feature":
        return collection(cluster)
    w = cluster.worker_index
    mode = "mean" if CASE == "psw_mean" else "sum"
    model = torch.nn.Module()
    model.emb = mpisync.EmbeddingBag(ROWS, DIM, mode=mode, pool_on_ps=True)
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    for t in range(4):
        ids, offsets, psw = torch.arange(6), torch.tensor([0, 2, 4]), None
        if w == 1 and t == 2:
            if CASE == "psw_mean":
                psw = torch.ones(6)
            elif CASE == "offsets_decrease":
                offsets = torch.tensor([0, 4, 2])
        opt.zero_grad()
        model.emb(ids, offsets, psw).sum().backward()
        opt.step()
    opt.close()


if __name__ == "__main__":
    run(worker)
