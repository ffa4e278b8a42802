"""A schedule of 'lr 0.1 for 5 global steps, then 0' with a slow worker: backup or async.

``--case NAME:OPTIONS`` (given several times) runs several trainings one after another in
one job, each with its own options (a RESULT record per case and worker).
"""
from __future__ import annotations

import argparse
import time

import torch
from common import dataset, emit, model, run
from training_cases import split_cases

import mpisync

CHANGE_AT = 5


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("backup", "async"), default=None)
    p.add_argument("--slow", type=int, default=0)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--case", action="append", default=[], metavar="NAME:OPTIONS",
                   help="run this case in the job (this program's options); repeatable")
    args = p.parse_args(argv)
    if args.mode is None and not args.case:
        p.error("--mode (or --case) is required")
    return args


def train(args, cluster) -> dict:
    w = cluster.worker_index
    net = model(hidden=8)
    kwargs = ({"asynchronous": True} if args.mode == "async"
              else {"replicas_to_aggregate": cluster.num_workers - 1})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        named_parameters=net.named_parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < CHANGE_AT else 0.0)
    x, y = dataset(512, seed=w)
    seen, lrs = [], []
    for i in range(10_000):
        if opt.stopped or (args.mode == "async" and i >= args.steps) or \
                (args.mode == "backup" and opt.global_step >= args.steps):
            break
        if w == args.slow and i % 3 == 1:
            time.sleep(0.3)
        opt.zero_grad()
        rows = slice((i % 32) * 16, (i % 32 + 1) * 16)
        torch.nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
        opt.step()
        sched.step()
        seen.append([opt.global_step, [v for p in net.parameters() for v in p.detach().flatten().tolist()]])
        lrs.append([opt.global_step, opt.param_groups[0]["lr"]])
    stats = opt.stats
    opt.close()
    return {"seen": seen, "lrs": lrs, "global_step": opt.global_step,
            "dropped": stats["gradients_dropped"]}


def worker(cluster) -> dict | None:
    args = parse()
    if not args.case:
        return train(args, cluster)
    for name, case_args in split_cases(args.case, parse):
        if case_args.mode is None:
            raise ValueError(f"case {name!r}: --mode is required")
        emit(role="worker", worker=cluster.worker_index, case=name, **train(case_args, cluster))
    return None


if __name__ == "__main__":
    run(worker)
