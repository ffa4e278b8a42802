"""Asynchronous training: every worker logs, per push, the step its gradient was computed at.

``--case NAME:OPTIONS`` (given several times) runs several trainings one after another in
one job, each with its own options (a RESULT record per case and worker).
"""
from __future__ import annotations

import argparse
import time

import torch
from common import dataset, emit, make_optimizer, model, run
from training_cases import split_cases

import mpisync

BATCH = 8


def batch(worker: int, i: int, steps: int):
    """Worker ``worker``'s ``i``-th batch: its own rows of one seeded data set."""
    x, y = dataset(BATCH * steps * 8)
    lo = (worker * steps + i) * BATCH
    return x[lo:lo + BATCH], y[lo:lo + BATCH]


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--slow", type=int, default=-1, help="this worker sleeps before each push")
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--opt", default="sgd")
    p.add_argument("--case", action="append", default=[], metavar="NAME:OPTIONS",
                   help="run this case in the job (this program's options); repeatable")
    return p.parse_args(argv)


def train(args, cluster) -> dict:
    w = cluster.worker_index
    net = model()
    opt = mpisync.SyncReplicasOptimizer(
        make_optimizer(args.opt, net.parameters()), named_parameters=net.named_parameters(),
        asynchronous=True, max_staleness=args.max_staleness)
    pushes = []
    for i in range(args.steps):
        x, y = batch(w, i, args.steps)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if w == args.slow:
            time.sleep(args.sleep)
        pushes.append(opt.global_step)            # the parameters this gradient saw
        opt.step()
    opt.close()
    return {"pushes": pushes, "global_step": opt.global_step,
            "params": {n: p.detach().tolist() for n, p in net.named_parameters()}}


def main() -> None:
    args = parse()

    def worker(cluster):
        if not args.case:
            return train(args, cluster)
        for name, case_args in split_cases(args.case, parse):
            emit(role="worker", worker=cluster.worker_index, case=name,
                 **train(case_args, cluster))
        return None

    run(worker)


if __name__ == "__main__":
    main()
