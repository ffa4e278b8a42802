"""The dense step against every peer, on the same ranks, in one MPI job (run by bench.py).

Run it on W workers (``--workers``, default 2) and P ps ranks (the rest of the job)::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- \\
        .venv/bin/python benchmarks/suite.py --json-out /tmp/suite.json

For each model size D (``--mb``, MiB of float32 in 8 tensors), these run on the same W
worker ranks in ``--rounds`` interleaved blocks (so that the machine's load falls on all of
them alike), the ps ranks waiting in their serve loop while the peers run:

- ``allreduce_ms``: ``MPI_Allreduce`` (SUM) of D bytes over the workers;
- ``gloo_ms``: ``torch.distributed.all_reduce`` of D bytes (gloo, over the workers);
- ``ddp_ms``: a DDP step of the model: ``zero_grad``, a forward that sums the parameters,
  ``backward`` (DDP's buckets all-reduced while it runs), ``torch.optim.SGD.step``;
- ``step_ms``: ``opt.step()`` of a ``SyncReplicasOptimizer`` around SGD with the gradients
  written in place (no backward), as step_bench.py times it (with ``--set-to-none``, new
  gradient tensors each step, as after torch's default ``zero_grad()``);
- ``train_ms``: the DDP step's loop with mpisync (forward, backward, ``opt.step()``);

each timed call after a barrier of the workers (untimed, on a communicator of their own),
so that a figure is the call's own time, not the wait for a worker still in the untimed
work before it (a fill of 1,000 gradients takes longer than the step);

and ``pingpong_gbs`` (worker 0 and ps 0 bounce D bytes, before and after the rest, the
other ranks asleep; one-way GB/s from the median round trip), ``many_tensors`` (a 4 MiB model of 1,000
tensors against one tensor of the same bytes, ``opt.step()`` alone) and ``mlp`` (a real
training step of an MLP of about 10 M parameters on seeded random data, DDP against
mpisync; SGD with momentum, or Adam with ``--mlp-optimizer adam``). ``--only horovod``
runs Horovod's allreduce instead, interleaved with ``MPI_Allreduce``, on every rank (Open
MPI's virtualenv, no ps).

Every time is a median (p10, p90) over ``--steps`` timed iterations after ``--warmup``.
The chief prints one JSON object as the last line of stdout (and to ``--json-out``).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_bench import MiB, fill_grads, machine, pingpong, sleepy_barrier, summary_ms

import mpisync


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="W; the other ranks are ps")
    parser.add_argument("--mb", type=float, nargs="+", default=[4.0, 40.0],
                        help="dense model sizes, MiB of float32")
    parser.add_argument("--tensors", type=int, default=8, help="tensors of the dense model")
    parser.add_argument("--steps", type=int, default=100, help="timed iterations per figure")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument("--many", type=int, default=1000, help="tensors of the many-tensor model")
    parser.add_argument("--mlp-batch", type=int, default=32, help="MLP batch per worker")
    parser.add_argument("--mlp-steps", type=int, default=30, help="timed MLP steps")
    parser.add_argument("--mlp-optimizer", choices=("sgd", "adam"), default="sgd",
                        help="the MLP's optimizer: SGD with momentum 0.9 (default) or Adam")
    parser.add_argument("--rounds", type=int, default=5,
                        help="blocks of each figure, interleaved with the others'")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="figures left out: ddp, gloo, many, mlp")
    parser.add_argument("--set-to-none", action="store_true",
                        help="the step figures' zero_grad(set_to_none=True), torch's default: "
                             "each step's gradients are new tensors (default: written in "
                             "place, set_to_none=False)")
    parser.add_argument("--sync-options", default="{}",
                        help="JSON of extra SyncReplicasOptimizer arguments (e.g. wire dtype)")
    parser.add_argument("--only", choices=["horovod"], default=None,
                        help="horovod: Horovod's allreduce on the workers alone")
    parser.add_argument("--json-out", default=None)
    return parser.parse_args()


def steps_of(args, mb: float) -> tuple[int, int]:
    """(warmup, timed) iterations: half as many for models over 16 MiB."""
    if mb > 16:
        return max(2, args.warmup // 2), max(10, args.steps // 2)
    return args.warmup, args.steps


class DenseModel(torch.nn.Module):
    """Float32 tensors; the forward sums them (each gradient is then all ones)."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.tensors = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in sizes)

    def forward(self) -> torch.Tensor:
        return sum(t.sum() for t in self.tensors)


def dense_sizes(mb: float, tensors: int) -> list[int]:
    numel = int(mb * MiB) // 4 // tensors
    return [numel] * tensors


def mlp(seed: int = 0) -> torch.nn.Module:
    """1024 -> 2048 -> 2048 -> 2048 -> 10, ReLU: 10.5 M parameters (42 MB)."""
    torch.manual_seed(seed)
    layers = []
    widths = [1024, 2048, 2048, 2048, 10]
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def mlp_batches(worker: int, batch: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + worker)
    return [(torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(count)]


def timed(fn, warmup: int, steps: int, before=None) -> list[float]:
    """Seconds of ``fn()`` per call; ``before()`` runs untimed ahead of each call."""
    out = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


# -- the figures ---------------------------------------------------------------------------
def gloo_group(worker_comm: MPI.Comm):
    """torch.distributed over the workers: the chief picks a port and tells the others."""
    import torch.distributed as dist
    if worker_comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    port = worker_comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=worker_comm.Get_rank(), world_size=worker_comm.Get_size())
    return dist


def sync_options(args) -> dict:
    """The extra optimizer arguments this mpisync accepts (an older one may lack some)."""
    extra = json.loads(args.sync_options)
    known = inspect.signature(mpisync.SyncReplicasOptimizer).parameters
    dropped = sorted(set(extra) - set(known))
    if dropped:
        print(f"suite: this mpisync has no {dropped}; measured without", file=sys.stderr)
    return {k: v for k, v in extra.items() if k in known}


def local_optimizer(params, args, dense: bool) -> torch.optim.Optimizer:
    """The models' optimizer: SGD (momentum 0.9 for the MLP), or Adam (``--mlp-optimizer``)."""
    if dense:
        return torch.optim.SGD(params, lr=1e-9)
    if args.mlp_optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def wrap(cluster, model: torch.nn.Module, args, dense: bool = True):
    return mpisync.SyncReplicasOptimizer(
        local_optimizer(model.parameters(), args, dense),
        named_parameters=model.named_parameters(), cluster=cluster, **sync_options(args))


class Figure:
    """One timed thing: ``fn()`` per iteration, ``before()`` untimed ahead of it."""

    def __init__(self, fn, before=None, close=None):
        self.fn, self.before, self.close = fn, before, close
        self.times: list[float] = []


def allreduce_figure(comm: MPI.Comm, nbytes: int) -> Figure:
    """MPI_Allreduce (SUM) of float32, a barrier before each call (as step_bench.py)."""
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    return Figure(lambda: comm.Allreduce(send, recv, op=MPI.SUM), comm.Barrier)


def step_only(cluster, workers: MPI.Comm, sizes: list[int], args) -> Figure:
    """``opt.step()`` with the gradients written in place (as step_bench.py), then a
    barrier of the workers (``workers``, a communicator of their own), as before each of
    the peers' timed calls."""
    model = DenseModel(sizes)
    opt = wrap(cluster, model, args)

    def fill():
        opt.zero_grad(set_to_none=args.set_to_none)
        fill_grads(model)
        workers.Barrier()
    return Figure(opt.step, fill, opt.close)


def train(model: torch.nn.Module, opt, batches):
    """A training step: zero_grad, forward (and loss), backward, ``opt.step()``."""
    it = [0]

    def step():
        opt.zero_grad()
        if batches is None:
            model().backward()
        else:
            x, y = batches[it[0] % len(batches)]
            it[0] += 1
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def sync_train(cluster, workers: MPI.Comm, model: torch.nn.Module, batches, args) -> Figure:
    opt = wrap(cluster, model, args, dense=batches is None)
    return Figure(train(model, opt, batches), workers.Barrier, opt.close)


def ddp_train(dist, model: torch.nn.Module, batches, args) -> Figure:
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)
    opt = local_optimizer(ddp.parameters(), args, dense=batches is None)
    return Figure(train(ddp, opt, batches), dist.barrier)


def interleave(figures: dict[str, Figure], rounds: int, per_round: int, warmup: int) -> dict:
    """Every figure's iterations in rounds, one block of each per round, so that the
    machine's moods fall on all of them alike; their medians (and p10, p90)."""
    for r in range(rounds):
        for fig in figures.values():
            fig.times += timed(fig.fn, warmup if r == 0 else 1, per_round, fig.before)
    for fig in figures.values():
        if fig.close is not None:
            fig.close()
    return {name: summary_ms(fig.times) for name, fig in figures.items()}


def mpisync_phase(cluster, workers: MPI.Comm, dist, args, out: dict, key: str) -> None:
    """Every mpisync figure on one cluster, each interleaved with its peers on the same
    workers (the ps ranks wait in their serve loop meanwhile)."""
    if cluster.is_ps:
        cluster.serve()
        return
    rounds = args.rounds
    for mb in args.mb:
        warmup, steps = steps_of(args, mb)
        sizes = dense_sizes(mb, args.tensors)
        nbytes = 4 * sum(sizes)
        figs = {"allreduce_ms": allreduce_figure(workers, nbytes),
                "step_ms": step_only(cluster, workers, sizes, args)}
        if dist is not None and "gloo" not in args.skip:
            t = torch.ones(nbytes // 4)
            figs["gloo_ms"] = Figure(lambda t=t: dist.all_reduce(t), dist.barrier)
        if dist is not None and "ddp" not in args.skip:
            figs["ddp_ms"] = ddp_train(dist, DenseModel(sizes), None, args)
            figs["train_ms"] = sync_train(cluster, workers, DenseModel(sizes), None, args)
        out[f"{mb:g}"].setdefault("mpisync", {})[key] = interleave(
            figs, rounds, max(1, steps // rounds), warmup)
    if "many" not in args.skip:
        numel = int(4 * MiB) // 4
        many = [numel // args.many] * args.many
        many[-1] += numel - sum(many)
        got = interleave({"one_ms": step_only(cluster, workers, [numel], args),
                          "many_ms": step_only(cluster, workers, many, args)},
                         rounds, max(1, args.steps // rounds), args.warmup)
        out["many_tensors"] = {"tensors": args.many, **got}
    if "mlp" not in args.skip and dist is not None:
        batches = mlp_batches(cluster.worker_index, args.mlp_batch)
        ddp_model, sync_model = mlp(), mlp()
        out["mlp"]["params"] = sum(p.numel() for p in sync_model.parameters())
        out["mlp"][key] = interleave({"ddp_ms": ddp_train(dist, ddp_model, batches, args),
                                      "mpisync_ms": sync_train(cluster, workers, sync_model,
                                                               batches, args)},
                                     rounds, max(1, args.mlp_steps // rounds), 2)


def pingpongs(world: MPI.Comm, num_workers: int, args, out: dict) -> None:
    """Ping-pong of each size between worker 0 and ps 0; the other ranks sleep."""
    rank = world.Get_rank()
    for mb in args.mb:
        warmup, steps = steps_of(args, mb)
        nbytes = 4 * sum(dense_sizes(mb, args.tensors))
        fig = out.setdefault(f"{mb:g}", {"bytes": nbytes})
        sleepy_barrier(world)
        if rank in (0, num_workers):
            gbs = _pingpong(world, rank, num_workers, nbytes, warmup, steps)
            if rank == 0:
                fig.setdefault("pingpong_runs_gbs", []).append(round(gbs, 3))
                fig["pingpong_gbs"] = round(float(np.median(fig["pingpong_runs_gbs"])), 3)
                fig["memcpy_ms"] = summary_ms(_memcpy(nbytes, steps))["median"]
    sleepy_barrier(world)


def _pingpong(world: MPI.Comm, rank: int, num_workers: int, nbytes: int, warmup: int,
              steps: int) -> float:
    """pingpong() of step_bench.py between world ranks 0 and ``num_workers``."""
    class Ends:        # the two ends as step_bench.pingpong sees a cluster
        comm = world
        is_chief = rank == 0
        is_ps = rank == num_workers
        ps_index = 0

        @staticmethod
        def ps_rank(_):
            return num_workers
    return pingpong(Ends, nbytes, warmup, steps) or 0.0


def _memcpy(nbytes: int, steps: int) -> list[float]:
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    return timed(lambda: np.copyto(dst, src), 2, steps)


def horovod_only(world: MPI.Comm, args) -> dict:
    """Horovod's allreduce of each size, interleaved with MPI_Allreduce, on every rank."""
    import horovod.torch as hvd
    hvd.init(comm=world)
    out = {"horovod": horovod_version()}
    for mb in args.mb:
        warmup, steps = steps_of(args, mb)
        nbytes = 4 * sum(dense_sizes(mb, args.tensors))
        t = torch.ones(nbytes // 4)
        figs = {"horovod_ms": Figure(lambda t=t: hvd.allreduce_(t, op=hvd.Sum, name="bench"),
                                     world.Barrier),
                "allreduce_ms": allreduce_figure(world, nbytes)}
        out[f"{mb:g}"] = {"bytes": nbytes,
                          **interleave(figs, args.rounds, max(1, steps // args.rounds), warmup)}
    hvd.shutdown()
    return out


def horovod_version() -> str:
    import horovod
    return horovod.__version__


def main() -> None:
    args = parse_args()
    world = MPI.COMM_WORLD
    wall = time.perf_counter()
    if args.only == "horovod":
        result = horovod_only(world, args)
    else:
        result = run_suite(world, args)
    if world.Get_rank() != 0:
        return
    result.update(
        machine=machine(), cores=os.cpu_count(), load=os.getloadavg()[0],
        date=datetime.date.today().isoformat(), world=world.Get_size(),
        mpi=" ".join(MPI.Get_library_version().split("\n")[0].split()),
        torch=torch.__version__, mpisync=str(Path(mpisync.__file__).parent),
        wall_s=round(time.perf_counter() - wall, 1), args=vars(args))
    line = json.dumps(result)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line, flush=True)


def run_suite(world: MPI.Comm, args) -> dict:
    size, rank = world.Get_size(), world.Get_rank()
    num_workers = args.workers
    if size <= num_workers:
        raise SystemExit(f"suite.py: {size} ranks hold {num_workers} workers and no ps rank")
    key = f"P{size - num_workers}"
    workers = world.Split(0 if rank < num_workers else MPI.UNDEFINED, rank)
    dist = None
    if workers != MPI.COMM_NULL and not {"gloo", "ddp", "mlp"} <= set(args.skip):
        dist = gloo_group(workers)
    out: dict = {"workers": num_workers, "ps": size - num_workers, "mlp": {}}
    pingpongs(world, num_workers, args, out)
    cluster = mpisync.init(num_ps=size - num_workers, comm=world)
    if cluster.layout.worker_ranks != tuple(range(num_workers)):
        raise SystemExit(f"suite.py: the workers must be ranks 0..{num_workers - 1} "
                         f"(MPISYNC_PS_LAYOUT=last), got {cluster.layout.worker_ranks}")
    mpisync_phase(cluster, workers, dist, args, out, key)
    cluster.close()
    sleepy_barrier(world)
    pingpongs(world, num_workers, args, out)
    if dist is not None:
        dist.destroy_process_group()
    if workers != MPI.COMM_NULL:
        workers.Free()
    return out


if __name__ == "__main__":
    main()
