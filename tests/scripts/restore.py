"""The documented restore pattern, many times over: load_state_dict() on every worker, then
train, with one worker delayed at random before its load or before its first step."""
from __future__ import annotations

import argparse
import random
import time

import torch
from common import dataset, model, run

import mpisync

STEPS = 3


def saved_state(net) -> dict:
    """A state from plain torch: Adam after two steps on the chief's data."""
    ref = model(hidden=16)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    x, y = dataset(64, seed=99)
    for i in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[i * 16:(i + 1) * 16]),
                                          y[i * 16:(i + 1) * 16]).backward()
        opt.step()
    net.load_state_dict(ref.state_dict())
    return opt.state_dict()


def one_round(cluster, r: int, rng: random.Random) -> list:
    w = cluster.worker_index
    net = model(hidden=16)
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                        named_parameters=net.named_parameters())
    state = saved_state(net)
    delayed, where, delay = rng.randrange(cluster.num_workers), rng.choice("lf"), rng.random()
    if w == delayed and where == "l":
        time.sleep(0.3 * delay)
    opt.load_state_dict(state)
    if w == delayed and where == "f":
        time.sleep(0.3 * delay)
    x, y = dataset(64, seed=w)
    for i in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[i * 8:(i + 1) * 8]),
                                          y[i * 8:(i + 1) * 8]).backward()
        opt.step()
    step = opt.global_step
    checksum = float(sum(p.detach().double().sum() for p in net.parameters()))
    state_steps = [int(s["step"]) for s in opt.state_dict()["state"].values()]
    opt.close()
    return [step, checksum, state_steps]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()

    def worker(cluster):
        rng = random.Random(1234)            # the same draws on every worker
        return {"rounds": [one_round(cluster, r, rng) for r in range(args.rounds)]}

    run(worker)


if __name__ == "__main__":
    main()
