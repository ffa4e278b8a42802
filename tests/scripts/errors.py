"""Programs that go wrong on purpose, one per --case."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch
from common import dataset, emit, make_optimizer, model

import mpisync


def train(opt, net, steps: int, w: int) -> None:
    x, y = dataset(64, seed=w)
    for i in range(steps):
        if opt.stopped:
            break
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[:16]), y[:16]).backward()
        if CASE == "raise" and w == 1 and i == 5:
            raise ValueError("boom on purpose in user code")
        if CASE == "stall" and w == 1 and i == 5:
            time.sleep(30)
        if CASE == "killed" and w == 1 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # dies at once: no excepthook, no atexit
        opt.step()


def main() -> None:
    global CASE
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--num-ps", type=int, default=None)
    args = p.parse_args()
    CASE = args.case
    cluster = mpisync.init(num_ps=args.num_ps)
    if cluster.is_ps:
        if CASE == "raise_ps":
            raise RuntimeError("boom on purpose on a ps rank")
        if CASE == "killed_ps" and cluster.ps_index == 1:  # dies while serving
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        stats = cluster.serve()
        emit(role="ps", ps=cluster.ps_index, global_step=stats["global_step"])
        return
    w = cluster.worker_index
    net = model(hidden=33 if (CASE == "mismatch" and w == 1) else 32)
    opt = mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()), named_parameters=net.named_parameters(),
        replicas_to_aggregate={"replicas0": 0, "async_replicas": 2}.get(CASE),
        asynchronous=CASE == "async_replicas",
        max_staleness=1 if CASE == "staleness_without_async" else None,
        ema_decay={"ema_bad": 1.0, "step_in_averaged": 0.5}.get(CASE))
    if CASE == "averages_without_ema" and w == 1:
        opt.averages()
    if CASE == "step_in_averaged" and w == 0:
        with opt.averaged():
            opt.step()
    steps = 5 if (CASE == "chief_first" and cluster.is_chief) else 20
    if CASE == "killed_ps":
        steps = 10**6  # still training when the ps dies
    train(opt, net, steps, w)
    if CASE == "bad_state":         # refused on every worker; training goes on untouched
        bad = opt.state_dict()
        bad["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
        try:
            opt.load_state_dict(bad)
        except mpisync.ConfigError as exc:
            print(f"caught: {exc}", flush=True)
        train(opt, net, 5, w)
    if CASE != "exit_without_close":
        opt.close()
    if CASE == "step_after_close" and w == 1:
        opt.step()
    emit(role="worker", worker=w, global_step=opt.global_step, stopped=opt.stopped)


CASE = ""
if __name__ == "__main__":
    main()
