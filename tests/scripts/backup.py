"""Backup workers and token counts: one worker may sleep; every push is logged.

``--case NAME:OPTIONS`` (given several times) runs several trainings one after another in
one job, each with its own options (a RESULT record per case and worker); a case whose
optimizer is refused records the error (``"Type: message"``) and the job goes on.
"""
from __future__ import annotations

import argparse
import time

import torch
from common import dataset, emit, make_optimizer, model, run
from training_cases import split_cases

import mpisync


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=None, help="required (in each --case)")
    p.add_argument("--num-tokens", type=int, default=None)
    p.add_argument("--laggard", type=int, default=-1)
    p.add_argument("--sleep-at", type=int, default=3)
    p.add_argument("--sleep", type=float, default=2.0)
    p.add_argument("--after", type=int, default=10, help="steps to go on after the drop")
    p.add_argument("--steps", type=int, default=20, help="without a laggard: stop here")
    p.add_argument("--state-every", type=int, default=0,
                   help="the chief reads opt.state_dict() every N pushes meanwhile")
    p.add_argument("--case", action="append", default=[], metavar="NAME:OPTIONS",
                   help="run this case in the job (this program's options); repeatable")
    args = p.parse_args(argv)
    if args.replicas is None and not args.case:
        p.error("--replicas (or --case) is required")
    return args


def train(args, cluster) -> dict:
    net = model()
    opt = mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()), named_parameters=net.named_parameters(),
        replicas_to_aggregate=args.replicas, num_tokens=args.num_tokens)
    w = cluster.worker_index
    x, y = dataset(512, seed=w)
    pushes, drop_seen_at, seen_stats = [], None, []
    while not opt.stopped and len(pushes) < 5000:
        if w == args.laggard and len(pushes) == args.sleep_at:
            time.sleep(args.sleep)
        i = len(pushes) % 32
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[i * 16:(i + 1) * 16]),
                                          y[i * 16:(i + 1) * 16]).backward()
        before = opt.global_step
        opt.step()
        pushes.append([before, opt.global_step])
        if len(pushes) % 3 == 0:
            st = opt.stats
            seen_stats.append([st["gradients_applied"], st["global_step"],
                               st["gradients_pending"]])
        if args.state_every and cluster.is_chief and len(pushes) % args.state_every == 0:
            state = opt.state_dict()
            assert state["mpisync"]["global_step"] >= opt.global_step
            assert len(state["state"]) == len(list(net.parameters()))
        if args.laggard < 0:
            if opt.global_step >= args.steps:
                break
        elif w != args.laggard:
            if drop_seen_at is None:
                if opt.stats["dropped_per_worker"][args.laggard] > 0:
                    drop_seen_at = opt.global_step
            elif opt.global_step >= drop_seen_at + args.after:
                break
    opt.close()
    final = {k: v for k, v in opt.stats.items()     # less this worker's own figures
             if k not in ("local_steps", "token_wait_s", "bytes_per_ps", "lookups_per_ps",
                          "lookup_sent_per_ps", "lookup_received_per_ps")}
    return {"pushes": pushes, "stopped": opt.stopped, "global_step": opt.global_step,
                "seen_stats": seen_stats, "final": final}


def worker(cluster) -> dict | None:
    args = parse()
    if not args.case:
        return train(args, cluster)
    for name, case_args in split_cases(args.case, parse):
        if case_args.replicas is None:
            raise ValueError(f"case {name!r}: --replicas is required")
        try:
            record = train(case_args, cluster)
        except mpisync.ConfigError as exc:          # refused on every worker: the next case
            record = {"error": f"{type(exc).__name__}: {exc}"}
        emit(role="worker", worker=cluster.worker_index, case=name, **record)
    return None


if __name__ == "__main__":
    run(worker)
