"""A table's rows and optimizer state saved and loaded (see test_tables_jobs.py).

Trains 3 steps, saves ``opt.state_dict()`` (the table shard by shard), trains 3 more
steps, loads the saved state back and trains the same 3 steps again: the table and the
dense parameters must end bitwise equal both times. Also reports the saved Adagrad state
of the table, assembled, for comparison with plain torch. tests/scripts/tables.py runs
``train_state`` as its case ``state``; run alone, each worker reports one record.
"""
from __future__ import annotations

import torch
from common import emit, run

import mpisync

ROWS, DIM, STEPS = 40, 3, 3


def batches(w: int):
    g = torch.Generator().manual_seed(5 + w)
    return [(torch.randint(0, ROWS, (6,), generator=g), torch.randn(6, 1, generator=g))
            for _ in range(2 * STEPS)]


def table_of(opt) -> tuple[torch.Tensor, torch.Tensor]:
    weight, acc = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    for shard in opt.table_shards("emb.weight"):
        weight[shard["ids"]] = shard["weight"]
        acc[shard["ids"]] = shard["state"]["sum"]
    return weight, acc


def train_state(cluster) -> dict:
    """Train, save, train, load, train again: the record of one worker."""
    w = cluster.worker_index
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "emb": mpisync.Embedding(ROWS, DIM, partitioner=mpisync.fixed_size(3), seed=4),
        "head": torch.nn.Linear(DIM, 1)})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.2),
                                        named_parameters=model.named_parameters())
    data = batches(w)

    def train(steps):
        for ids, y in steps:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model["head"](model["emb"](ids)), y).backward()
            opt.step()

    train(data[:STEPS])
    saved_opt = opt.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_table = table_of(opt)
    train(data[STEPS:])
    first = table_of(opt), [p.detach().clone() for p in model["head"].parameters()]
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    reloaded = all(torch.equal(a, b) for a, b in zip(table_of(opt), saved_table))
    train(data[STEPS:])
    second = table_of(opt), [p.detach().clone() for p in model["head"].parameters()]
    same = all(torch.equal(a, b) for a, b in zip(first[0], second[0])) and \
        all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    shards = saved_opt["mpisync"]["tables"]["emb.weight"]["shards"]
    out = {"same": same, "reloaded": reloaded, "global_step": opt.global_step,
           "shards": [len(s["ids"]) for s in shards], "saved_sum": saved_table[1].tolist(),
           "saved_weight": saved_table[0].tolist()}
    opt.close()
    return out


def worker(cluster):
    emit(role="worker", worker=cluster.worker_index, **train_state(cluster))


if __name__ == "__main__":
    run(worker)
