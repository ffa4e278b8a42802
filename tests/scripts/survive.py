"""Ranks killed mid-run (SIGKILL) in a job that survives lost workers: who goes on, who ends."""
from __future__ import annotations

import argparse
import ast
import hashlib
import os
import signal
import threading
import time

import torch
from common import dataset, emit, make_optimizer, model, run

import mpisync


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--kill", default="", help="workers that die at their 5th push, e.g. 1,2")
    p.add_argument("--kill-ps", action="store_true", help="ps 0 dies a second into serving")
    p.add_argument("--steps", type=int, default=30, help="with --kill-ps: to the ps's death")
    p.add_argument("--mid-backward", action="store_true",
                   help="a doomed worker dies in backward, some buckets of its push sent")
    p.add_argument("--option", action="append", default=[],
                   help="an optimizer option as key=value (a Python literal), e.g. num_tokens=4")
    return p.parse_args()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def die(w: int) -> None:
    emit(role="killed", worker=w, at=time.time())
    os.kill(os.getpid(), signal.SIGKILL)    # no excepthook, no atexit, no word


def worker(cluster) -> dict:
    args = parse()
    doomed = {int(w) for w in args.kill.split(",") if w}
    net = model(hidden=256)           # several buckets with bucket_bytes=4096
    options = {"replicas_to_aggregate": 2, "bucket_bytes": 4096}
    for kv in args.option:
        key, value = kv.split("=", 1)
        options[key] = ast.literal_eval(value)
    opt = mpisync.SyncReplicasOptimizer(make_optimizer("sgd", net.parameters()),
                                        named_parameters=net.named_parameters(), **options)
    w = cluster.worker_index
    if w in doomed and args.mid_backward:       # the first layer's gradient comes last
        net[0].weight.register_post_accumulate_grad_hook(lambda p: die(w) if pushes == 5 else None)
    x, y = dataset(256, seed=w)
    pushes = 0
    while not opt.stopped and opt.global_step < args.steps:
        if w in doomed and pushes == 5 and not args.mid_backward:
            die(w)
        i = pushes % 16
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[i * 16:(i + 1) * 16]),
                                          y[i * 16:(i + 1) * 16]).backward()
        opt.step()
        pushes += 1
    record = {"global_step": opt.global_step, "params": digest(net.parameters())}
    if cluster.is_chief:          # the ps ranks' values, read at the same global step
        state, held = opt.state_and_values(tables=False)
        record["ps_step"] = state["mpisync"]["global_step"]
        record["ps_params"] = digest(held[n] for n, _ in net.named_parameters())
    opt.close()
    record["workers_lost"] = opt.stats["workers_lost"]
    return record


def main() -> None:
    if not parse().kill_ps:
        run(worker)
        return
    cluster = mpisync.init()
    if cluster.is_ps:                 # dies while serving, the workers mid-run
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        cluster.serve()
    else:
        worker(cluster)


if __name__ == "__main__":
    main()
