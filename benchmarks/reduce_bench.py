"""Time the workers' helpers (``cluster.reduce``, a metric's ``compute()``) against MPI itself.

Run it on W workers and P ps ranks, e.g.::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- \\
        .venv/bin/python benchmarks/reduce_bench.py --mb 4

With a ``SyncReplicasOptimizer`` open (as between two training steps), each iteration
times, in turn and after a barrier, on a private communicator of the workers:

- ``raw_pair``: ``MPI_Allreduce`` of two float64 (the baseline of a metric);
- ``worker_comm_float``: ``cluster.worker_comm.allreduce(1.0)`` (pickled, the workers
  meet first: what a user writes by hand);
- ``reduce_float``: ``cluster.reduce(1.0)``; ``metric_compute``: ``mpisync.Mean().compute()``;
- ``self_float``: ``mpisync.runtime.collectives.reduce`` of 1.0 on ``MPI.COMM_SELF``: the helper's
  own work without the other workers (no meeting, a one-rank ``allgather``);
- ``raw_mb`` and ``reduce_mb``: ``MPI_Allreduce`` and ``cluster.reduce`` of D MiB of
  float32.

The chief prints one JSON object (medians in microseconds, and ratios to the raw
all-reduce of the same data) as the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
from mpi4py import MPI

import mpisync
from mpisync.runtime import collectives


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="MiB of float32 for *_mb")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cluster = mpisync.init()
    raw = MPI.COMM_WORLD.Split(MPI.UNDEFINED if cluster.is_ps else 0, cluster.rank)
    if cluster.is_ps:
        cluster.serve()
        return
    net = torch.nn.Linear(4, 4)
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        named_parameters=net.named_parameters())
    metric = mpisync.Mean()
    metric.update(torch.ones(8))
    pair = np.ones(2)
    big = torch.ones(int(args.mb * (1 << 20)) // 4)
    big_np = big.numpy().copy()
    variants = {
        "raw_pair": lambda: raw.Allreduce(MPI.IN_PLACE, pair, op=MPI.SUM),
        "worker_comm_float": lambda: cluster.worker_comm.allreduce(1.0),
        "reduce_float": lambda: cluster.reduce(1.0),
        "self_float": lambda: collectives.reduce(MPI.COMM_SELF, 1.0),
        "metric_compute": metric.compute,
        "raw_mb": lambda: raw.Allreduce(MPI.IN_PLACE, big_np, op=MPI.SUM),
        "reduce_mb": lambda: cluster.reduce(big),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for it in range(args.warmup + args.iters):
        for name, call in variants.items():     # interleaved: drift hits every variant alike
            raw.Barrier()
            start = time.perf_counter()
            call()
            if it >= args.warmup:
                times[name].append(time.perf_counter() - start)
    opt.close()
    raw.Free()
    if cluster.is_chief:
        us = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
        print(json.dumps({
            "workers": cluster.num_workers, "ps": cluster.num_ps, "mb": args.mb,
            "iters": args.iters, "host": platform.node(), "median_us": us,
            "ratio_reduce_float_to_raw_pair": us["reduce_float"] / us["raw_pair"],
            "ratio_metric_compute_to_raw_pair": us["metric_compute"] / us["raw_pair"],
            "ratio_worker_comm_float_to_raw_pair": us["worker_comm_float"] / us["raw_pair"],
            "ratio_reduce_mb_to_raw_mb": us["reduce_mb"] / us["raw_mb"],
            "date": time.strftime("%Y-%m-%d")}), flush=True)


if __name__ == "__main__":
    main()
