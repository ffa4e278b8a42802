"""A long run of the digits model (examples/digits.py) with a worker that sleeps at random.

Every worker records, per push, the global step it computed at and its batch; ps 0 reports
which gradients each step took (``serve()``'s ``per_step``); each rank samples its resident
memory. The test replays the steps in one process and compares the parameters bitwise.

    --mode backup: replicas_to_aggregate = workers - 1 (a backup worker)
    --mode async:  asynchronous=True, max_staleness=2
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import sys
import threading
import time
from pathlib import Path

import torch
from common import emit
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits import load_data, make_model

import mpisync

BATCH = 8
LR = 1e-3
WARM_UP = 200          # global steps before the memory is taken as settled
SLOW = 1               # the worker that sleeps now and then


PICKLED = [0, 0]       # objects mpi4py pickled and unpickled in this process


def count_pickling() -> None:
    """Count every object mpi4py pickles or unpickles from now on (its pickle hooks)."""
    def dumps(obj, *args):
        PICKLED[0] += 1
        return pickle.dumps(obj, *args)

    def loads(data, *args):
        PICKLED[1] += 1
        return pickle.loads(data, *args)

    MPI.pickle.__init__(dumps, loads)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def options(mode: str, num_workers: int) -> dict:
    if mode == "async":
        return {"asynchronous": True, "max_staleness": 2}
    return {"replicas_to_aggregate": num_workers - 1}


def worker(cluster, args) -> None:
    w = cluster.worker_index
    x, y, _, _ = load_data(0)
    torch.manual_seed(0)
    net = make_model()
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adam(net.parameters(), lr=LR),
                                        named_parameters=net.named_parameters(),
                                        **options(args.mode, cluster.num_workers))
    batches = torch.Generator().manual_seed(1000 + w)
    naps = random.Random(w)
    memory = {"start": rss_bytes()}
    pushes = []
    before = list(PICKLED)
    while opt.global_step < args.steps and not opt.stopped:
        at = opt.global_step
        idx = torch.randint(0, len(x), (BATCH,), generator=batches)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        if w == SLOW and naps.random() < 0.3:
            time.sleep(naps.uniform(0.0, 0.004))
        opt.step()
        pushes.append([at, *idx.tolist()])
        if "warm" not in memory and opt.global_step >= WARM_UP:
            memory["warm"], memory["warm_at"] = rss_bytes(), time.time()
    memory["end"] = rss_bytes()
    pickled = [PICKLED[0] - before[0], PICKLED[1] - before[1]]     # on the step's path
    path = os.path.join(os.environ["RESULT_DIR"], f"worker-{w}.pt")
    torch.save({"params": {n: p.detach().clone() for n, p in net.named_parameters()},
                "pushes": pushes}, path)
    opt.close()
    emit(role="worker", worker=w, global_step=opt.global_step, stopped=opt.stopped,
         saved=path, memory=memory, stats=opt.stats, pickled=pickled)


def serve(cluster) -> None:
    """Serve, sampling this rank's memory every 0.2 s meanwhile: (time, bytes)."""
    samples, done = [], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            samples.append((time.time(), rss_bytes()))

    samples.append((time.time(), rss_bytes()))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    before = list(PICKLED)
    stats = cluster.serve()
    pickled = [PICKLED[0] - before[0], PICKLED[1] - before[1]]
    done.set()
    sampler.join()
    samples.append((time.time(), rss_bytes()))
    path = os.path.join(os.environ["RESULT_DIR"], f"ps-{cluster.ps_index}.pt")
    torch.save(stats, path)              # per_step: long
    emit(role="ps", ps=cluster.ps_index, saved=path, memory=samples, pickled=pickled,
         stats={k: v for k, v in stats.items() if k != "per_step"})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["backup", "async"], required=True)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    torch.set_num_threads(1)
    count_pickling()
    cluster = mpisync.init()
    if cluster.is_ps:
        serve(cluster)
    else:
        worker(cluster, args)


if __name__ == "__main__":
    main()
