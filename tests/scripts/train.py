"""Training under test: N workers with batch B, or (--single) one process with batch N*B.

``--case NAME:OPTIONS`` (given several times) runs several trainings one after another in
one job, each with its own options and a fresh model and optimizer (a RESULT record per
case and worker); the job's own options (``--num-ps``) stay outside the cases.
"""
from __future__ import annotations

import argparse
import time

import torch
from common import dataset, emit, make_optimizer, model, run
from training_cases import environment, split_cases


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--single", type=int, default=0, help="run alone as N workers' big batch")
    p.add_argument("--opt", default="sgd")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sched", default="")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--dump", default="")
    p.add_argument("--num-ps", type=int, default=None)
    p.add_argument("--placement", default="greedy_sorted")
    p.add_argument("--start", type=int, default=0, help="skip this many global batches")
    p.add_argument("--stop", type=int, default=None, help="stop before this global batch")
    p.add_argument("--resume", default="", help="a --dump file to restore from")
    p.add_argument("--ema", type=float, default=None, help="ema_decay")
    p.add_argument("--ema-num-updates", action="store_true")
    p.add_argument("--zero-in-place", action="store_true",
                   help="zero_grad(set_to_none=False): gradients stay in the send buffers")
    p.add_argument("--stage-cpu", action="store_true",
                   help="this run's parameters staged through host copies (MPISYNC_STAGE_CPU=1)")
    p.add_argument("--case", action="append", default=[], metavar="NAME:OPTIONS",
                   help="run this case in the job (this program's options); repeatable")
    return p.parse_args(argv)


def batches(n_workers: int, batch: int, steps: int, start: int = 0, stop: int | None = None):
    x, y = dataset(n_workers * batch * steps)
    for t in range(start, steps if stop is None else stop):
        lo = t * n_workers * batch
        yield x[lo:lo + n_workers * batch], y[lo:lo + n_workers * batch]


def scheduler(opt, name):
    if name == "steplr":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    return None


def single(args) -> None:
    net = model()
    opt = make_optimizer(args.opt, net.parameters())
    sched = scheduler(opt, args.sched)
    averages = {n: p.detach().clone() for n, p in net.named_parameters()}
    for t, (xb, yb) in enumerate(batches(args.single, args.batch, args.steps), start=1):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
        if args.ema is not None:    # TensorFlow's ExponentialMovingAverage, by hand
            decay = min(args.ema, (1 + t) / (10 + t)) if args.ema_num_updates else args.ema
            for n, p in net.named_parameters():
                averages[n].lerp_(p.detach(), 1.0 - decay)
        if sched:
            sched.step()
    torch.save({"params": dict(net.named_parameters()), "state": opt.state_dict(),
                "averages": averages}, args.dump)


def distributed(args, cluster) -> dict:
    import mpisync
    from mpisync.runtime import heap

    net = model()
    saved = torch.load(args.resume) if args.resume else None
    if saved:
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(saved["params"][name])
    staging = {"MPISYNC_STAGE_CPU": "1"} if args.stage_cpu else {}    # else as the job's
    with environment(**staging):
        opt = mpisync.SyncReplicasOptimizer(
            make_optimizer(args.opt, net.parameters()), named_parameters=net.named_parameters(),
            cluster=cluster, deterministic=args.deterministic, placement=args.placement,
            ema_decay=args.ema, ema_num_updates=args.ema_num_updates)
    if saved:
        opt.load_state_dict(saved["state"])
    sched = scheduler(opt, args.sched)
    w, b = cluster.worker_index, args.batch
    start = time.perf_counter()
    for xb, yb in batches(cluster.num_workers, b, args.steps, args.start, args.stop):
        opt.zero_grad(set_to_none=not args.zero_in_place)
        torch.nn.functional.cross_entropy(net(xb[w * b:(w + 1) * b]), yb[w * b:(w + 1) * b]) \
            .backward()
        opt.step()
        if sched:
            sched.step()
    elapsed = time.perf_counter() - start
    state = opt.state_dict()
    averaged_ok = None
    if args.ema is not None and cluster.is_chief:
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        with opt.averaged() as averages:
            inside = {n: p.detach().clone() for n, p in net.named_parameters()}
        averaged_ok = (all(torch.equal(inside[n], averages[n]) for n in inside)
                       and all(torch.equal(p, before[n]) for n, p in net.named_parameters()))
    if cluster.is_chief and args.dump:
        torch.save({"params": dict(net.named_parameters()), "state": state,
                    "averages": opt.averages() if args.ema is not None else None}, args.dump)
    stats = opt.stats
    held = heap.in_force()
    opt.close()
    return {"global_step": opt.global_step, "plan": opt.plan.digest(),
                "lr": opt.param_groups[0]["lr"], "elapsed": elapsed,
                "applied": stats["gradients_applied"], "dropped": stats["gradients_dropped"],
                "averaged_ok": averaged_ok, "staged": len(opt._dense.staging.params),
                "checksum": float(sum(p.detach().double().sum() for p in net.parameters())),
                "heap": held, "heap_after": heap.in_force()}


def cases(specs: list[str], cluster) -> None:
    """Each case in turn, its record tagged with its name."""
    for name, args in split_cases(specs, parse):
        emit(role="worker", worker=cluster.worker_index, case=name,
             **distributed(args, cluster))


if __name__ == "__main__":
    a = parse()
    if a.single:
        single(a)
    elif a.case:
        run(lambda cluster: cases(a.case, cluster), num_ps=a.num_ps)
    else:
        run(lambda cluster: distributed(a, cluster), num_ps=a.num_ps)
