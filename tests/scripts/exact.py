"""Run the named cases of cases.py under mpisync, one optimizer after another, in one job.

``--dense=allreduce`` first runs them all with the dense parameters averaged among the
workers instead of held on the ps ranks. A name may also say how its case runs:
``allreduce:NAME`` (that case alone with ``dense="allreduce"``) or ``staged:NAME`` (its
CPU parameters staged through host copies, as ``MPISYNC_STAGE_CPU=1`` does); each record
names its case as given.
"""
from __future__ import annotations

import sys

from cases import BATCH, BY_NAME, batches, build, describe_group, loop_step, snapshot
from common import emit, run
from training_cases import environment

import mpisync
from mpisync.protocol.wire import Kind


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
                        for piece in opt._parts.link.from_every_ps(Kind.STATE, "state")]
    out["applied"] = applied
    out["staged"] = len(opt._dense.staging.params)    # parameters kept off the host buffers
    stats = opt.stats
    opt.close()
    out.update(global_step=opt.global_step, dropped=stats["gradients_dropped"])
    return out


def run_case(cluster, given: str, extra: dict) -> dict:
    """The case ``[MODE:]NAME`` run as its mode says."""
    mode, _, name = given.rpartition(":")
    if mode == "allreduce":
        return train(cluster, name, dict(extra, dense="allreduce"))
    if mode == "staged":
        with environment(MPISYNC_STAGE_CPU="1"):
            return train(cluster, name, extra)
    if mode:
        raise ValueError(f"{given!r}: the mode is allreduce or staged, got {mode!r}")
    return train(cluster, name, extra)


def worker(cluster):
    names, extra = sys.argv[1:], {}
    if names and names[0].startswith("--dense="):
        extra["dense"] = names.pop(0).split("=", 1)[1]
    for given in names:
        emit(role="worker", worker=cluster.worker_index, case=given,
             **run_case(cluster, given, extra))


if __name__ == "__main__":
    run(worker)
