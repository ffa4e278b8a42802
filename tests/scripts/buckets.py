"""Pushes in many small buckets under every mode, each push recorded for a replay.

Every case trains the same small model on 2 workers and 2 ps ranks with buckets of a few
hundred bytes (several per ps, the first sent from gradient hooks while backward runs):
strict sync plain, with clipping after backward (the buckets go again), with two backward
passes per step and with a parameter that has no gradient every other step; backup
workers, extra tokens (several batches on the same parameters) and asynchronous
training; gradients and parameters on a bfloat16 and a float16 wire. Each worker records
its pushes (the step each was computed at) and what it holds at the end; the test replays
the steps in one process from ps 0's record of which pushes each step took.

A case named ``messages:CASE`` runs CASE with ``MPISYNC_SHARED_MEMORY=0`` on every worker
(so that every pair exchanges MPI messages); any other ``TRANSPORT:CASE`` runs CASE as the
job's environment says. Each record names its case as given.
"""
from __future__ import annotations

import os
import sys

import torch
from common import emit, run
from training_cases import environment

import mpisync
from mpisync.protocol.wire import Kind

BATCH, STEPS, BUCKET_BYTES = 8, 10, 64
CASES = {
    "strict": {},
    "strict-clip": {},
    "strict-accumulate": {},
    "strict-unused": {},
    "backup": {"replicas_to_aggregate": 1},
    "kbatch": {"replicas_to_aggregate": 4, "num_tokens": 2},
    "async": {"asynchronous": True},
    "bf16": {"wire_dtype": torch.bfloat16},
    "fp16": {"wire_dtype": "fp16"},
}


class Net(torch.nn.Module):
    """An MLP and a second head that only even steps use (``strict-unused``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 3))
        self.extra = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def batch(worker: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Push ``k`` of ``worker``: its own seeded batch."""
    g = torch.Generator().manual_seed(1000 * worker + k)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def gradient(case: str, net: Net, worker: int, k: int) -> None:
    """What the case computes for push ``k``: ``.grad`` of every parameter (or None)."""
    x, y = batch(worker, k)
    use_extra = case != "strict-unused" or k % 2 == 0
    if case == "strict-accumulate":        # two micro-batches, gradients summed
        for part in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            torch.nn.functional.cross_entropy(net(x[part], use_extra), y[part]).backward()
        return
    torch.nn.functional.cross_entropy(net(x, use_extra), y).backward()
    if case == "strict-clip":
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(cluster, case: str) -> dict:
    net = Net()
    opt = mpisync.SyncReplicasOptimizer(optimizer(net.parameters()),
                                        named_parameters=net.named_parameters(),
                                        bucket_bytes=BUCKET_BYTES, **CASES[case])
    assert len(opt._dense.order) >= 4, opt._dense.order      # several buckets per push
    w = cluster.worker_index
    pushes = []
    while opt.global_step < STEPS and not opt.stopped and len(pushes) < 200:
        k = len(pushes)
        opt.zero_grad(set_to_none=not (case == "strict-unused" and k % 4 == 3))
        gradient(case, net, w, k)
        pushes.append(opt.global_step)
        opt.step()
    held = {n: p.detach().tolist() for n, p in net.named_parameters()}
    master = None
    if cluster.is_chief:        # what the ps ranks hold, at their global step
        values, step = {}, None
        for _, _, _, part, step in opt._parts.link.from_every_ps(Kind.STATE, "values"):
            values.update(part)
        master = {"step": step, "values": {n: v.tolist() for n, v in values.items()}}
    counts = dict(opt._dense.counts, shared=len(opt._dense.shared),   # ps ranks, in memory
                  hooks=len(opt._dense.hooks.hooks))                  # gradient hooks placed
    opt.close()
    return {"case": case, "pushes": pushes, "global_step": opt.global_step, "held": held,
            "master": master, "counts": counts}


def worker(cluster):
    for given in sys.argv[1:]:
        transport, _, case = given.rpartition(":")
        off = {"MPISYNC_SHARED_MEMORY": "0"} if transport == "messages" else {}
        with environment(**off):
            record = train(cluster, case)
        emit(role="worker", worker=cluster.worker_index, **dict(record, case=given))


if __name__ == "__main__":
    from mpi4py import MPI
    if str(MPI.COMM_WORLD.Get_rank()) in os.environ.get("SHM_OFF_ON_RANKS", "").split(","):
        os.environ["MPISYNC_SHARED_MEMORY"] = "0"    # this rank's pairs exchange messages
    run(worker)
