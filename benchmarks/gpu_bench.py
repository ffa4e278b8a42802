"""Workers on GPUs, the ps on the CPU: an mpisync step beside DDP with NCCL and one GPU.

Run it on a machine with CUDA (it exits with a message elsewhere)::

    .venv/bin/python benchmarks/gpu_bench.py [--gpus 1|2] [--steps 30] [--json-out F]

For each model, a 10 M-parameter MLP (``mlp10m``: 2048-2048-2048-512 ReLU, float32) and
the digits example's MLP (``digits``), in one run:

- ``mpisync``: 2 workers on the GPUs (``--gpus 1``: both share GPU 0) and 1 ps rank,
  ``SyncReplicasOptimizer(SGD)``: ms per step (median over the chief's steps, forward,
  backward and ``step()``), bytes over PCIe per step and worker (gradients to the host,
  parameters back), and ``overlap``: the share of gradient buckets whose copy to the host
  started from backward's hooks, before backward ended;
- ``mpisync_p2p``: the same with ``MPISYNC_SHARED_MEMORY=0``, so that the buckets go
  over MPI messages, each sent from backward's hooks once its copy landed, as between
  nodes (through shared memory, one node, every bucket goes at ``step()``: overlap 0);
- ``ddp``: the same 2 processes with ``DistributedDataParallel``, SGD: over NCCL with a GPU
  each, over gloo where they share one (NCCL refuses two ranks on one device);
- ``single``: one process on GPU 0 with both workers' batches together.

Ratios (``mpisync / ddp``, ``mpisync / single``) come from the same run. The summary is
one JSON object on the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

MODELS = {"mlp10m": (2048, 2048, 2048, 512), "digits": (64, 128, 64, 10)}
BATCH = 64


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="mlp10m", choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=0, help="GPUs for the 2 workers (1 or 2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json-out", default="")
    return p.parse_args(argv)


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    widths = MODELS[name]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def data(name: str, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, MODELS[name][0], generator=g)
    y = torch.randint(0, MODELS[name][-1], (rows,), generator=g)
    return x.to(device), y.to(device)


def timed_steps(args, net, opt, x, y) -> list[float]:
    """Seconds per step (forward, backward, step), each ended by a device sync."""
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def median_ms(times: list[float]) -> float:
    return 1e3 * sorted(times)[len(times) // 2]


def role_mpisync(args) -> None:
    import mpisync
    cluster = mpisync.init(num_ps=1)
    if cluster.is_ps:
        cluster.serve()
        return
    net = make_model(args.model).to(cluster.device)
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                        named_parameters=net.named_parameters())
    x, y = data(args.model, BATCH, cluster.device)
    times = timed_steps(args, net, opt, x, y)
    dense = opt._dense
    counts = dense.counts
    staging, steps = dense.staging, args.warmup + args.steps
    record = {"ms": median_ms(times), "device": str(cluster.device),
              # what the staging copied, gradients down and parameters up, per step
              "pcie_bytes_per_step": (staging.bytes_to_host + staging.bytes_to_devices) / steps,
              "overlap": counts["from_hooks"] / max(counts["buckets"], 1),
              "pinned": bool(dense.staging.cuda), "cuda_aware": cluster.cuda_aware}
    opt.close()
    if cluster.is_chief:
        print("RESULT " + json.dumps(record), flush=True)


def role_ddp(args) -> None:
    from mpi4py import MPI

    from mpisync.worker.devices import nccl_group, worker_device
    world = MPI.COMM_WORLD
    comm = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if comm == MPI.COMM_NULL:
        return                                   # the third rank: no part in DDP
    device = worker_device(comm)
    # NCCL refuses two ranks on one GPU: with --gpus 1 both processes share it over gloo
    backend = "nccl" if args.gpus >= 2 else "gloo"
    nccl_group(comm, device, backend=backend)
    net = torch.nn.parallel.DistributedDataParallel(make_model(args.model).to(device),
                                                    device_ids=[device])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = data(args.model, BATCH, device)
    times = timed_steps(args, net, opt, x, y)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"ms": median_ms(times), "device": str(device),
                                      "backend": backend}), flush=True)
    torch.distributed.destroy_process_group()


def role_single(args) -> dict:
    device = torch.device("cuda", 0)
    net = make_model(args.model).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = data(args.model, 2 * BATCH, device)
    return {"ms": median_ms(timed_steps(args, net, opt, x, y)), "device": str(device)}


def launch(args, role: str, **extra: str) -> dict:
    """``role`` on 2 workers and 1 ps rank under mpisync's launcher; the chief's record."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(args.gpus))), **extra)
    cmd = [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1", "--",
           sys.executable, os.path.abspath(__file__), "--role", role, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--gpus", str(args.gpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        # the other rows still come: the failure is printed and kept in the JSON
        print(f"gpu_bench.py: the {role} job ({args.model}) failed ({proc.returncode}):\n"
              f"{proc.stdout}\n{proc.stderr}", file=sys.stderr, flush=True)
        return {"ms": float("nan"), "error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    args = parse()
    if args.role == "mpisync":
        return role_mpisync(args)
    if args.role == "ddp":
        return role_ddp(args)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA GPU: torch.cuda.is_available() is False "
                         "on this machine (torch " + torch.__version__ + "); run it where "
                         "the workers have GPUs")
    args.gpus = args.gpus or min(2, torch.cuda.device_count())
    rows = {}
    for name in MODELS:
        args.model = name
        mine, ddp, alone = launch(args, "mpisync"), launch(args, "ddp"), role_single(args)
        # without shared memory the buckets go over MPI from backward's hooks (as between
        # nodes): overlap is measured there; through shared memory every bucket goes at step()
        p2p = launch(args, "mpisync", MPISYNC_SHARED_MEMORY="0")
        rows[name] = {"mpisync": mine, "mpisync_p2p": p2p, "ddp": ddp, "single": alone,
                      "mpisync_over_ddp": mine["ms"] / ddp["ms"],
                      "mpisync_over_single": mine["ms"] / alone["ms"]}
    summary = {"gpus": args.gpus, "gpu": torch.cuda.get_device_name(0), "batch": BATCH,
               "steps": args.steps, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "models": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
