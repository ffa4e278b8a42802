"""Time one synchronous mpisync step against MPI_Allreduce and a ping-pong, in one MPI job.

Run it on W workers and P ps ranks, e.g.::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- \\
        .venv/bin/python benchmarks/step_bench.py --mb 4

The model is D MiB of float32 parameters in ``--tensors`` equal tensors (no forward pass:
the gradients are filled in place). Three phases, each with ``--warmup`` untimed and
``--steps`` timed iterations, ordered so that the ranks not taking part only sleep:

1. ping-pong: worker 0 and ps 0 bounce a D MiB message (``cluster.comm``); one-way GB/s
   from the median round trip;
2. allreduce: ``MPI_Allreduce`` (SUM) of D MiB of float32 over the workers only
   (``cluster.worker_comm``), the ps ranks sleep in a barrier; ms per call on the chief;
3. step: ``opt.step()`` of a ``SyncReplicasOptimizer`` around ``torch.optim.SGD`` (or ``--optimizer``)
   (push gradients, apply on the ps, token, pull parameters); ms per step on the chief;
4. allreduce step: the same with ``dense="allreduce"`` (the gradients averaged among the
   workers in buckets, SGD applied on every worker, the token still from ps 0). With no
   backward pass here, the whole allreduce runs inside ``step()``;
5. with ``--stats-ab B``: 2B more optimizers like the one of phase 3, one after another,
   alternately without and with the statistics log (``stats_log=``), ``--steps`` timed
   steps each: the log's cost measured on and off in the same run.

``MPISYNC_STATS`` and ``MPISYNC_TIMELINE`` apply to phases 3 and 4 as to any job.

The chief prints one JSON object as the last line of stdout (and to ``--json-out``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch
from mpi4py import MPI

import mpisync

MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="model size in MiB (float32)")
    parser.add_argument("--tensors", type=int, default=8, help="parameter tensors")
    parser.add_argument("--steps", type=int, default=50, help="timed iterations per phase")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per phase")
    parser.add_argument("--json-out", default=None, help="also write the JSON object here")
    parser.add_argument("--stats-ab", type=int, default=0, metavar="B",
                        help="B optimizers without and B with the statistics log, alternating")
    parser.add_argument("--stats-ab-log", default="/tmp/mpisync-step-bench-stats.jsonl",
                        help="where the --stats-ab optimizers log")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                        help="the optimizer the ps ranks apply (default: sgd)")
    parser.add_argument("--no-allreduce-step", action="store_true",
                        help="leave out phase 4 (the dense='allreduce' optimizer)")
    return parser.parse_args()


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-9),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-9, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-9),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-9),
}


class DenseModel(torch.nn.Module):
    """``num_tensors`` float32 parameters of ``numel`` elements each; never called."""

    def __init__(self, num_tensors: int, numel: int):
        super().__init__()
        self.tensors = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(numel)) for _ in range(num_tensors))


def sleepy_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps while it waits, so that idle ranks leave the cores alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def summary_ms(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"median": round(float(np.median(ms)), 3), "p10": round(float(np.percentile(ms, 10)), 3),
            "p90": round(float(np.percentile(ms, 90)), 3)}


def pingpong(cluster, nbytes: int, warmup: int, steps: int) -> float | None:
    """Worker 0 <-> ps 0 round trips; one-way GB/s from the median round trip, on worker 0."""
    comm, peer = cluster.comm, None
    if cluster.is_chief:
        peer = cluster.ps_rank(0)
    elif cluster.is_ps and cluster.ps_index == 0:
        peer = 0
    if peer is None:
        return None
    buf = np.ones(nbytes, np.uint8)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        if cluster.is_chief:
            comm.Send([buf, MPI.BYTE], dest=peer, tag=7)
            comm.Recv([buf, MPI.BYTE], source=peer, tag=7)
        else:
            comm.Recv([buf, MPI.BYTE], source=peer, tag=7)
            comm.Send([buf, MPI.BYTE], dest=peer, tag=7)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return nbytes / (float(np.median(times)) / 2) / 1e9


def allreduce(comm: MPI.Comm, nbytes: int, warmup: int, steps: int) -> list[float]:
    """Per-call seconds of MPI_Allreduce(SUM) of float32; a barrier before each call."""
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    times = []
    for i in range(warmup + steps):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def memcpy(nbytes: int, steps: int) -> list[float]:
    """Per-copy seconds of a local D MiB copy: the floor any step's data movement sits on."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times


def fill_grads(model: torch.nn.Module) -> None:
    """Every gradient 1.0, written in place where one exists (the send buffers' views)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.ones_like(p)
        else:
            p.grad.fill_(1.0)


def sync_steps(cluster, args, numel: int, dense: str = "ps",
               stats_log=None) -> tuple[list[float], dict]:
    """Per-step seconds of opt.step() on this worker, and the final statistics."""
    model = DenseModel(args.tensors, numel)
    opt = mpisync.SyncReplicasOptimizer(
        OPTIMIZERS[args.optimizer](model.parameters()),
        named_parameters=model.named_parameters(), cluster=cluster, dense=dense,
        stats_log=stats_log)
    times = []
    for i in range(args.warmup + args.steps):
        # set_to_none=False: after the first step the gradients are views into the send
        # buffers, written in place (see benchmarks/README.md); torch's first one is None
        opt.zero_grad(set_to_none=False)
        fill_grads(model)
        start = time.perf_counter()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    opt.close()
    return times, opt.stats


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}; {platform.system()} {platform.release()}"


def main() -> None:
    args = parse_args()
    cluster = mpisync.init()
    numel = int(args.mb * MiB) // 4 // args.tensors
    nbytes = numel * 4 * args.tensors
    wall = time.perf_counter()

    sleepy_barrier(cluster.comm)
    gbs = pingpong(cluster, nbytes, args.warmup, args.steps)
    sleepy_barrier(cluster.comm)
    if not cluster.is_ps:
        ar = allreduce(cluster.worker_comm, nbytes, args.warmup, args.steps)
    sleepy_barrier(cluster.comm)
    if cluster.is_ps:
        cluster.serve()      # every optimizer, one after the other
        return
    steps, stats = sync_steps(cluster, args, numel)
    reduced = [] if args.no_allreduce_step else sync_steps(cluster, args, numel,
                                                            dense="allreduce")[0]
    ab = {False: [], True: []}
    for block in range(2 * args.stats_ab):
        on = block % 2 == 1
        ab[on] += sync_steps(cluster, args, numel, stats_log=args.stats_ab_log if on else False)[0]
    if not cluster.is_chief:
        return

    step_ms, ar_ms = summary_ms(steps), summary_ms(ar)
    reduced_ms = summary_ms(reduced) if reduced else {"median": float("nan")}
    result = {
        "machine": machine(), "cores": os.cpu_count(),
        "workers": cluster.num_workers, "ps": cluster.num_ps, "mb": args.mb,
        "tensors": args.tensors, "optimizer": args.optimizer, "steps": args.steps,
        "step_ms": step_ms, "allreduce_ms": ar_ms,
        "ratio_step_to_allreduce": round(step_ms["median"] / ar_ms["median"], 2),
        "allreduce_step_ms": reduced_ms,
        "ratio_allreduce_step_to_step": round(reduced_ms["median"] / step_ms["median"], 2),
        "pingpong_gbs": round(gbs, 3),
        "memcpy_ms": summary_ms(memcpy(nbytes, args.steps))["median"],
        "global_step": stats["global_step"], "gradients_dropped": stats["gradients_dropped"],
        "wall_s": round(time.perf_counter() - wall, 2),
        **({"stats_ab": {"blocks": args.stats_ab, "off_ms": summary_ms(ab[False]),
                         "on_ms": summary_ms(ab[True])}} if args.stats_ab else {}),
        "mpi": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "torch": torch.__version__,
    }
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
