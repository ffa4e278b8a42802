"""Run the named cases of cases.py under mpisync, one optimizer after another, in one job.

``--dense=allreduce`` first runs them all with the dense parameters averaged among the
workers instead of held on the ps ranks.
"""
from __future__ import annotations

import sys

from cases import BATCH, BY_NAME, batches, build, describe_group, loop_step, snapshot
from common import emit, run

import mpisync
from mpisync.wire import Kind


def train(cluster, name: str, extra: dict) -> dict:
    case = BY_NAME[name]
    w = cluster.worker_index
    m, inner = build(case, w)
    opt = mpisync.SyncReplicasOptimizer(inner, named_parameters=m.named_parameters(),
                                        named_buffers=m.named_buffers(), **case.sync, **extra)
    sched = case.scheduler(opt) if case.scheduler else None
    if case.before:
        case.before(m)
    if case.restore:
        case.restore(m, opt)
    rows = slice(w * BATCH, (w + 1) * BATCH)
    for t, (xb, yb) in enumerate(batches(case.steps)):
        applied = loop_step(case, m, opt, sched, t, xb[rows], yb[rows], opt.zero_grad)
    out = snapshot(m, opt)
    # the hyper-parameters each ps applied at the last step, with their types
    out["ps_groups"] = [[describe_group(g) for g in piece[2]]
                        for piece in opt._from_every_ps(Kind.STATE, "state")]
    out["applied"] = applied
    out["staged"] = len(opt._dense.staging.params)    # parameters kept off the host buffers
    stats = opt.stats
    opt.close()
    out.update(global_step=opt.global_step, dropped=stats["gradients_dropped"])
    return out


def worker(cluster):
    names, extra = sys.argv[1:], {}
    if names and names[0].startswith("--dense="):
        extra["dense"] = names.pop(0).split("=", 1)[1]
    for name in names:
        emit(role="worker", worker=cluster.worker_index, case=name,
             **train(cluster, name, extra))


if __name__ == "__main__":
    run(worker)
