"""Training on CUDA workers (tests marked gpu): the model on ``cluster.device``, the ps on
the CPU, or (``--single N``) one process on the GPU with the N workers' batches together.

``--split``: the first layer on the CPU, the rest on the GPU. ``--backup``: one worker
more than ``replicas_to_aggregate``, the last one slow; each global step t uses the batch
(t, worker), so the ps's ``per_step`` record replays the run in one process.
``--move``: the model moves to the CPU after 2 steps; every worker must refuse it.
``--backend nccl`` with several workers on one GPU: every worker refuses the set-up.
"""
from __future__ import annotations

import argparse
import time

import torch
from common import dataset, make_optimizer, model, run

BATCH = 16


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--single", type=int, default=0)
    p.add_argument("--opt", default="sgd")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dense", default="ps")
    p.add_argument("--backend", default="auto", help="allreduce_backend")
    p.add_argument("--split", action="store_true")
    p.add_argument("--backup", action="store_true")
    p.add_argument("--move", action="store_true")
    p.add_argument("--replay", default="", help="a JSON list of each step's taken workers")
    p.add_argument("--dump", default="")
    return p.parse_args(argv)


def build(device: torch.device, split: bool) -> torch.nn.Module:
    net = model().to(device)
    if split:                                  # first layer on the CPU: a model on two devices
        net[0].to("cpu")
    return net


def forward(net, x, split: bool):
    if split:
        return net[2](net[1](net[0](x.cpu()).to(net[2].weight.device)))
    return net(x)


def batch(x, y, t: int, w: int, workers: int, device):
    lo = (t * workers + w) * BATCH
    return x[lo:lo + BATCH].to(device), y[lo:lo + BATCH].to(device)


def single(args) -> None:
    """One process on the GPU; with ``--replay``, each step over the taken workers' batches."""
    import json
    device = torch.device("cuda")
    net = build(device, args.split)
    opt = make_optimizer(args.opt, net.parameters())
    x, y = dataset(BATCH * args.single * args.steps * 2)
    taken = json.loads(args.replay) if args.replay else [list(range(args.single))] * args.steps
    for t, workers in enumerate(taken):
        xs, ys = zip(*(batch(x, y, t, w, args.single, device) for w in sorted(workers)))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(net, torch.cat(xs), args.split),
                                          torch.cat(ys)).backward()
        opt.step()
    torch.save({n: p.detach().cpu() for n, p in net.named_parameters()}, args.dump)


def distributed(args, cluster) -> dict:
    import mpisync

    device = cluster.device
    assert device.type == "cuda", device
    net = build(device, args.split)
    kw = {"dense": args.dense, "allreduce_backend": args.backend}
    if args.backup:
        kw.update(replicas_to_aggregate=cluster.num_workers - 1)
    try:
        opt = mpisync.SyncReplicasOptimizer(make_optimizer(args.opt, net.parameters()),
                                            named_parameters=net.named_parameters(), **kw)
    except mpisync.ConfigError as exc:
        if args.backend != "nccl":
            raise
        return {"error": str(exc), "collective": exc.collective}
    x, y = dataset(BATCH * cluster.num_workers * args.steps * 2)
    w, error = cluster.worker_index, None
    slow = args.backup and w == cluster.num_workers - 1
    while opt.global_step < args.steps and not opt.stopped:
        if args.move and opt.global_step == 2:
            net.cpu()
            device = torch.device("cpu")      # the batch follows the model, as users write
        xb, yb = batch(x, y, opt.global_step, w, cluster.num_workers, device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(net, xb, args.split), yb).backward()
        if slow:
            time.sleep(0.2)
        try:
            opt.step()
        except TypeError as exc:
            error = str(exc)
            break
    if args.move:
        return {"error": error}
    if cluster.is_chief and args.dump:
        torch.save({n: p.detach().cpu() for n, p in net.named_parameters()}, args.dump)
    stats = opt.stats
    local = opt._parts.local
    backend = local.channel.reducer.__class__.__name__ if local is not None else None
    opt.close()
    return {"global_step": opt.global_step, "applied": stats["gradients_applied"],
            "dropped": stats["gradients_dropped"], "backend": backend,
            "staged": len(opt._dense.staging.params), "pinned": bool(opt._dense.staging.cuda),
            "from_hooks": opt._dense.counts["from_hooks"],
            "devices": sorted({str(p.device) for p in net.parameters()}),
            "checksum": float(sum(p.detach().double().sum().item() for p in net.parameters()))}


if __name__ == "__main__":
    a = parse()
    if a.single:
        single(a)
    else:
        run(lambda cluster: distributed(a, cluster))
