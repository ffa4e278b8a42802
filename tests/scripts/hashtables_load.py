"""A hash table's checkpoint loaded at another ps count, then a lookup over capacity.

``--load PATH``: the checkpoint hashtables.py wrote for its saved case (at 1 ps); this job
(any ps count) loads it and reports the table by id. Then worker 1 looks up more ids on
one shard than it holds: a CapacityError there, and the job ends (see
test_hashtables_jobs.py).
"""
from __future__ import annotations

import sys

import torch
from common import emit, run
from hashtables import BY_NAME, build, make_optimizer, table_by_id

import mpisync
from mpisync import hashing

CASE = BY_NAME["evict-lru-adagrad-saved"]


def worker(cluster):
    path = sys.argv[sys.argv.index("--load") + 1]
    model = build(CASE)
    opt = mpisync.SyncReplicasOptimizer(make_optimizer(CASE, model.parameters()),
                                        named_parameters=model.named_parameters())
    mpisync.load(path, model, opt)
    emit(role="worker", worker=cluster.worker_index, global_step=opt.global_step,
         table=table_by_id(opt), hash_stats=opt.stats["hash_tables"]["emb.weight"],
         num_ps=cluster.num_ps)
    candidates = torch.arange(-1000, 1000)
    on_first = candidates[hashing.shard_of(candidates, cluster.num_ps) == 0]
    opt.zero_grad()
    opt.step()          # a step of both: every worker has reported before anything changes
    opt.zero_grad()
    if cluster.worker_index == 1:
        model["emb"](on_first[:CASE.capacity + 2]).sum().backward()
    opt.step()
    opt.close()


if __name__ == "__main__":
    run(worker)
