"""Refusals, many cases in one job (2 workers, 2 ps ranks): each is refused on every rank it
reaches, every worker catches the error, records it and goes on to the next case, which
sets up an optimizer again. The messages themselves are tested in one process
(tests/unit/test_refusals.py); this job proves that every rank raises and nobody hangs.

Each worker prints what it caught as ``[caught] <its label>: <Type>: <message>`` (the form
of mpisync's exception hook) and records it: one RESULT record per case and rank, with
``error`` (``"Type: message"``), ``said`` (the printed line) and ``collective`` (whether
the error is raised on every rank alike; one that is not ends the job when uncaught). The
ps ranks print why a set-up failed and serve on; at the end each reports the global step
of every optimizer it served, in the order they were created. The last case leaves
without ``close()``: the job must still end cleanly.
"""
from __future__ import annotations

import argparse
import importlib.util

import torch
from common import dataset, emit, make_optimizer, model
from mpi4py import MPI

import mpisync

X, Y = dataset(256, seed=7)
HOROVOD = importlib.util.find_spec("horovod") is not None


class ScaledSGD(torch.optim.SGD):
    """Keeps a constructor argument as an attribute."""

    def __init__(self, params, lr, scale):
        super().__init__(params, lr=lr)
        self.scale = scale


def train(opt, net, steps: int, w: int, after_backward=None, scaler=None) -> None:
    for i in range(steps):
        opt.zero_grad()
        start = 16 * (2 * i + w) % 224
        loss = torch.nn.functional.cross_entropy(net(X[start:start + 16]), Y[start:start + 16])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            continue
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()


NOTHING = {"error": None, "said": None, "collective": None}


def caught(cluster, fn) -> dict:
    """Run ``fn``; what it raised, printed and recorded (all None when nothing was)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        said = f"{cluster.label}: {type(exc).__name__}: {exc}"
        print(f"[caught] {said}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}", "said": said,
                "collective": bool(getattr(exc, "collective", False))}
    return NOTHING


def sync_opt(net, optimizer=None, **kw):
    return mpisync.SyncReplicasOptimizer(
        optimizer if optimizer is not None else make_optimizer("sgd", net.parameters()),
        named_parameters=net.named_parameters(), **kw)


# -- set-up refused on every worker (and said on the ps ranks), then set up again ----------
def setup_refused(make):
    def case(w: int, cluster) -> dict:
        net = model()
        return caught(cluster, lambda: make(net, w))
    return case


def case_mismatch(w, cluster):
    """Worker 1 builds a wider model."""
    net = model(hidden=33 if w == 1 else 32)
    return caught(cluster, lambda: sync_opt(net))


def case_placement_differs(w, cluster):
    def placement(name, nbytes, loads):      # a placement that depends on the worker
        return w % 2 if name == "2.weight" else 0
    return caught(cluster, lambda: sync_opt(model(), placement=placement))


def allreduce_refused(**kw):
    return setup_refused(lambda net, w: sync_opt(net, dense="allreduce", **kw))


# -- refused after set-up, on every worker; training goes on ---------------------------------
def case_shared_two_opts(w, cluster):
    """A second optimizer over the parameters of the first, which is open (opened first of
    the job's optimizers: #0); the first trains on."""
    net = model()
    first = sync_opt(net)
    record = caught(cluster, lambda: sync_opt(net))
    train(first, net, 2, w)
    first.close()
    return dict(record, opt_id=first._spec.opt_id, global_step=first.global_step)


def case_grad_scaler(w, cluster):
    net = model()
    opt = sync_opt(net)
    train(opt, net, 1, w)
    record = caught(cluster, lambda: train(opt, net, 1, w, scaler=torch.amp.GradScaler("cpu")))
    step_at_error = opt.global_step
    del opt.found_inf, opt.grad_scale      # what GradScaler.step left on the optimizer
    train(opt, net, 2, w)
    opt.close()
    return dict(record, step_at_error=step_at_error, global_step=opt.global_step)


def case_add_param_group(w, cluster):
    net = model()
    opt = sync_opt(net)
    record = caught(cluster, lambda: opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(2))]}))
    train(opt, net, 2, w)
    opt.close()
    return dict(record, global_step=opt.global_step)


def case_attribute_changed(w, cluster):
    net = model()
    wrapped = ScaledSGD(net.parameters(), lr=0.1, scale=0.5)
    opt = sync_opt(net, wrapped)
    train(opt, net, 2, w)
    wrapped.scale = 10.0                      # the user's handle on the wrapped optimizer
    record = caught(cluster, lambda: train(opt, net, 1, w))
    step_at_error = opt.global_step
    wrapped.scale = 0.5
    train(opt, net, 2, w)
    opt.close()
    return dict(record, step_at_error=step_at_error, global_step=opt.global_step)


def case_step_in_averaged(w, cluster):
    """Worker 0 alone steps inside averaged(); worker 1 trains meanwhile."""
    net = model()
    opt = sync_opt(net, ema_decay=0.5)

    def step_in_averaged():
        with opt.averaged():
            opt.step()
    record = caught(cluster, step_in_averaged) if w == 0 else NOTHING
    train(opt, net, 3, w)
    opt.close()
    return dict(record, global_step=opt.global_step)


def case_averages_without_ema(w, cluster):
    """Worker 1 alone asks for averages() of an optimizer made without ema_decay."""
    net = model()
    opt = sync_opt(net)
    record = caught(cluster, opt.averages) if w == 1 else NOTHING
    train(opt, net, 3, w)
    opt.close()
    return dict(record, global_step=opt.global_step)


def case_step_after_close(w, cluster):
    """Worker 1 steps once more after close()."""
    net = model()
    opt = sync_opt(net)
    train(opt, net, 3, w)
    opt.close()
    record = caught(cluster, opt.step) if w == 1 else NOTHING
    return dict(record, global_step=opt.global_step)


def case_allreduce_convert(w, cluster):
    """dense='allreduce': the model converted to float64 between backward() and step()."""
    net = model()
    opt = sync_opt(net, dense="allreduce")
    train(opt, net, 2, w)
    record = caught(cluster, lambda: train(opt, net, 1, w, after_backward=net.double))
    net.float()
    train(opt, net, 2, w)
    opt.close()
    return dict(record, global_step=opt.global_step)


def case_bad_state(w, cluster):
    """A state that does not fit is refused on every worker and loses nothing."""
    net = model()
    opt = sync_opt(net)
    train(opt, net, 20, w)
    bad = opt.state_dict()
    bad["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
    record = caught(cluster, lambda: opt.load_state_dict(bad))
    train(opt, net, 5, w)
    opt.close()
    return dict(record, opt_id=opt._spec.opt_id, global_step=opt.global_step)


def skipped_unless(ready: bool, case):
    return case if ready else (lambda w, cluster: {"skipped": True})


WORKER_CASES = {
    # opens the job's first optimizer (#0): keep it before the other cases that open one
    "shared_two_opts": case_shared_two_opts,
    "replicas0": setup_refused(lambda net, w: sync_opt(net, replicas_to_aggregate=0)),
    "async_replicas": setup_refused(lambda net, w: sync_opt(
        net, replicas_to_aggregate=2, asynchronous=True)),
    "staleness_without_async": setup_refused(lambda net, w: sync_opt(net, max_staleness=1)),
    "ema_bad": setup_refused(lambda net, w: sync_opt(net, ema_decay=1.0)),
    "lbfgs": setup_refused(lambda net, w: sync_opt(net, torch.optim.LBFGS(net.parameters()))),
    "sparseadam": setup_refused(lambda net, w: sync_opt(
        net, torch.optim.SparseAdam(net.parameters()))),
    "mismatch": case_mismatch,
    "placement_differs": case_placement_differs,
    "optimizer_differs": setup_refused(lambda net, w: sync_opt(
        net, torch.optim.Adam(net.parameters()) if w == 1 else None)),
    "lr_differs": setup_refused(lambda net, w: sync_opt(
        net, make_optimizer("sgd", net.parameters(), lr=0.2) if w == 1 else None)),
    "allreduce_replicas": allreduce_refused(replicas_to_aggregate=1),
    "allreduce_async": allreduce_refused(asynchronous=True),
    "allreduce_tokens": allreduce_refused(num_tokens=1),
    "allreduce_nccl": skipped_unless(not torch.cuda.is_available(),
                                     allreduce_refused(allreduce_backend="nccl")),
    "allreduce_bucket_bytes": allreduce_refused(bucket_bytes=0),
    "allreduce_horovod": skipped_unless(not HOROVOD,
                                        allreduce_refused(allreduce_backend="horovod")),
    "grad_scaler": case_grad_scaler,
    "add_param_group": case_add_param_group,
    "attribute_changed": case_attribute_changed,
    "step_in_averaged": case_step_in_averaged,
    "averages_without_ema": case_averages_without_ema,
    "step_after_close": case_step_after_close,
    "allreduce_convert": case_allreduce_convert,
    "bad_state": case_bad_state,
}


def world_too_small(rank: int) -> dict:
    """Before the job's cluster: num_ps=2 of a world of 2 ranks (ranks 0 and 1)."""
    pair = MPI.COMM_WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if pair == MPI.COMM_NULL:
        return {"error": None}
    try:
        error = None
        mpisync.init(num_ps=2, comm=pair, abort_on_error=False)
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        error = f"{type(exc).__name__}: {exc}"
        print(f"[caught] {error}", flush=True)
    pair.Free()
    return {"error": error}


def num_ps_differs() -> dict:
    """Before the job's cluster, on every rank: num_ps=1 where the launcher set
    MPISYNC_NUM_PS=2 (this job's count); refused on every rank before any message."""
    try:
        mpisync.init(num_ps=1, abort_on_error=False)
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        error = f"{type(exc).__name__}: {exc}"
        print(f"[caught] {error}", flush=True)
        return {"num_ps_differs": error, "num_ps_differs_collective":
                bool(getattr(exc, "collective", False))}
    return {"num_ps_differs": None, "num_ps_differs_collective": None}


def exit_without_close(w: int, rank: int) -> None:
    """The last case: train, then leave the job without close() (the record first)."""
    net = model()
    opt = sync_opt(net)
    train(opt, net, 20, w)
    emit(role="worker", worker=w, rank=rank, case="exit_without_close",
         opt_id=opt._spec.opt_id, global_step=opt.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(WORKER_CASES))
    args = p.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    world = world_too_small(rank)
    world.update(num_ps_differs())
    cluster = mpisync.init(num_ps=2)
    role = {"role": "ps", "ps": cluster.ps_index} if cluster.is_ps else {
        "role": "worker", "worker": cluster.worker_index}
    emit(case="world", rank=rank, **world, **role)
    if cluster.is_ps:
        served = cluster.serve()
        served = served if isinstance(served, list) else [served]
        emit(case="served", rank=rank, steps=[s["global_step"] for s in served], **role)
        return
    for case in args.cases.split(","):
        emit(case=case, rank=rank, **WORKER_CASES[case](cluster.worker_index, cluster), **role)
    exit_without_close(cluster.worker_index, rank)


if __name__ == "__main__":
    main()
