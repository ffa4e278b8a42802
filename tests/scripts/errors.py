"""Programs that go wrong on purpose, one per --case; or, with --cases, several that end
normally, one after another in one job."""
from __future__ import annotations

import argparse
import ast
import os
import signal
import sys
import tempfile
import threading
import time

import torch
from common import dataset, emit, make_optimizer, model

import mpisync

if "class_on_workers_only" in sys.argv:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() < MPI.COMM_WORLD.Get_size() - 1:   # the workers only

        class WorkersOnlySGD(torch.optim.SGD):
            pass


class ScaledSGD(torch.optim.SGD):
    """Keeps a constructor argument as an attribute."""

    def __init__(self, params, lr, scale):
        super().__init__(params, lr=lr)
        self.scale = scale


def train(opt, net, steps: int, w: int) -> None:
    x, y = dataset(64, seed=w)
    scaler = torch.amp.GradScaler("cpu") if CASE == "grad_scaler" else None
    ckpt = (mpisync.Checkpointer(tempfile.mkdtemp(dir=os.environ.get("RESULT_DIR")), net, opt,
                                 every_steps=100)
            if CASE == "exit_mid_training" else None)   # maybe_save() meets the other workers
    for i in range(steps):
        if opt.stopped:
            break
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[:16]), y[:16])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            continue
        loss.backward()
        if CASE == "allreduce_convert" and i == 2:
            net.double()                          # after wrapping: refused by the step
        if CASE == "metric_every_step":          # strict sync: a metric after every step
            opt.step()
            cluster_of(opt).worker_comm.allreduce(loss.item())
            continue
        if CASE == "attribute_changed" and i == 2:
            opt.wrapped.scale = 10.0              # the user's handle on the wrapped optimizer
        if CASE in ("raise", "allreduce_raise") and w == 1 and i == 5:
            raise ValueError("boom on purpose in user code")
        if CASE in ("stall", "allreduce_stall") and w == 1 and i == 5:
            time.sleep(30)
        if CASE == "nonfinite" and w == 1 and i == 3:
            net[2].weight.grad[0, 0] = float("nan")    # the default policy: raise
        if CASE == "killed" and w == 1 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # dies at once: no excepthook, no atexit
        if CASE == "dropped_write" and w == 2 and i == 3:
            time.sleep(1.0)                       # its gradient comes too late ...
            with torch.no_grad():
                net[0].bias.add_(1.0)             # ... and so does this write
        opt.step()
        after_step(ckpt, w, i)


def after_step(ckpt, w: int, i: int) -> None:
    if CASE == "exit_mid_training" and w == 1 and i == 4:
        sys.exit(3)                               # no exception hook: only its exit
    if ckpt is not None:
        ckpt.maybe_save()


def cluster_of(opt):
    return opt.cluster


def optimizer_for(net, w: int, cluster):
    """The optimizer each worker builds; some cases make the workers disagree."""
    if CASE == "lbfgs":
        return torch.optim.LBFGS(net.parameters())
    if CASE == "sparseadam":
        return torch.optim.SparseAdam(net.parameters())
    if CASE == "attribute_changed":
        return ScaledSGD(net.parameters(), lr=0.1, scale=0.5)
    if CASE == "class_on_workers_only":
        return WorkersOnlySGD(net.parameters(), lr=0.1)
    if CASE == "optimizer_differs" and w == 1:
        return torch.optim.Adam(net.parameters())
    if CASE == "lr_differs" and w == 1:
        return make_optimizer("sgd", net.parameters(), lr=0.2)
    return make_optimizer("sgd", net.parameters())


def options(w: int, cluster) -> dict:
    backup = cluster.num_workers - 1
    kw = {"replicas_to_aggregate": {"replicas0": 0, "async_replicas": 2,
                                    "collective_deadlock": backup,
                                    "dropped_write": backup,
                                    # one gradient a step: no step ever needs the chief's
                                    "collective_early_but_safe": 1,
                                    "collective_after_close": backup}.get(CASE),
          "asynchronous": CASE == "async_replicas",
          "max_staleness": 1 if CASE == "staleness_without_async" else None,
          "ema_decay": {"ema_bad": 1.0, "step_in_averaged": 0.5}.get(CASE)}
    if CASE.startswith("allreduce"):
        kw["dense"] = "allreduce"
        if SYNC:
            key, value = SYNC.split("=", 1)
            kw[key] = ast.literal_eval(value)
    if CASE == "placement_differs":       # a placement that depends on the worker
        kw["placement"] = lambda name, nbytes, loads: w % 2 if name == "2.weight" else 0
    return kw


class SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 10)
        self.out = torch.nn.Linear(10, 3)

    def forward(self, x):    # a sparse gradient from the functional form: not seen at set-up
        ids = (x.abs() * 5).long().clamp(max=19)
        return self.out(torch.nn.functional.embedding(ids, self.emb.weight, sparse=True).mean(1))


def after_training(opt, net, cluster, w: int) -> None:
    """What some cases do once their loop is over."""
    if CASE == "bad_state":         # refused on every worker; training goes on untouched
        bad = opt.state_dict()
        bad["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
        try:
            opt.load_state_dict(bad)
        except mpisync.ConfigError as exc:
            print(f"caught: {exc}", flush=True)
        train(opt, net, 5, w)
    if CASE in ("collective_deadlock", "collective_uneven") and w < 2:
        # before close(), while another worker still needs them for its steps
        cluster.worker_comm.allreduce(opt.global_step)
    if CASE == "collective_uneven_split":
        SUB[0].allreduce(opt.global_step)        # on a communicator made from worker_comm
    if CASE == "reduce_uneven":
        cluster.reduce(opt.global_step)          # mpisync's helper meets as worker_comm does
    if CASE == "update_vs_load":                 # each waits for the other's request
        if w == 0:
            opt.update("0.weight", torch.Tensor.relu_)
        else:
            opt.load_state_dict(opt.state_dict())
    if CASE == "collective_early_but_safe" and cluster.is_chief:
        steps = cluster.worker_comm.gather(opt.global_step)    # the others close first
        print(f"gathered while open: {steps}", flush=True)
    if CASE == "collective_early_but_safe" and not cluster.is_chief:
        opt.close()
        cluster.worker_comm.gather(opt.global_step)
    if CASE == "collective_after_close":
        opt.close()                                    # the safe end of training
        steps = cluster.worker_comm.gather(opt.global_step)
        if cluster.is_chief:
            print(f"gathered after close: {steps}", flush=True)


def main() -> None:
    global CASE, SYNC
    p = argparse.ArgumentParser()
    p.add_argument("--case", help="the one case this job runs")
    p.add_argument("--cases", help="cases that end normally, one after another in this job "
                                   "(each worker's record names its case)")
    p.add_argument("--num-ps", type=int, default=None)
    p.add_argument("--sync", default="", help="one more option, key=value")
    args = p.parse_args()
    if (args.case is None) == (args.cases is None):
        p.error("give --case or --cases")
    cases = [args.case] if args.cases is None else args.cases.split(",")
    CASE, SYNC = cases[0], args.sync
    cluster = mpisync.init(num_ps=args.num_ps)
    if cluster.is_ps:
        if CASE == "raise_ps":
            raise RuntimeError("boom on purpose on a ps rank")
        if CASE == "killed_ps" and cluster.ps_index == 1:  # dies while serving
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        stats = cluster.serve()
        if isinstance(stats, list):             # --cases: one optimizer per case
            emit(role="ps", ps=cluster.ps_index, global_steps=[s["global_step"] for s in stats])
        else:
            emit(role="ps", ps=cluster.ps_index, global_step=stats["global_step"])
        return
    for CASE in cases:
        record = worker(cluster)
        if args.cases is not None:
            record["case"] = CASE
        emit(**record)


def worker(cluster) -> dict:
    """One case on this worker: set up, train, what the case does after; its record."""
    w = cluster.worker_index
    net = SparseNet() if CASE == "sparse" else model(
        hidden=33 if (CASE == "mismatch" and w == 1) else 32)
    opt = mpisync.SyncReplicasOptimizer(optimizer_for(net, w, cluster),
                                        named_parameters=net.named_parameters(),
                                        **options(w, cluster))
    if CASE == "shared_two_opts":               # the same parameters, a second optimizer
        mpisync.SyncReplicasOptimizer(make_optimizer("sgd", net.parameters()),
                                      named_parameters=net.named_parameters())
    if CASE == "step_in_averaged" and w == 0:
        with opt.averaged():
            opt.step()
    if CASE == "collective_uneven_split":       # made while every worker is here
        SUB.append(cluster.worker_comm.Split(0, w))
    if CASE == "add_param_group":
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    steps = {"chief_first": 5 if w == 0 else 20,
             "collective_early_but_safe": 5 if w == 0 else 20,
             "collective_after_close": 5 if w == 0 else 20,
             "collective_deadlock": 5 if w < 2 else 20,
             "collective_uneven": 3 + w, "collective_uneven_split": 3 + w,
             "reduce_uneven": 3 + w, "update_vs_load": 3,
             "metric_every_step": 60}.get(CASE, 20)
    if CASE == "killed_ps":
        steps = 10**6  # still training when the ps dies
    train(opt, net, steps, w)
    after_training(opt, net, cluster, w)
    if CASE != "exit_without_close":
        opt.close()
    return {"role": "worker", "worker": w, "global_step": opt.global_step,
            "stopped": opt.stopped}


CASE = SYNC = ""
SUB: list = []
if __name__ == "__main__":
    main()
