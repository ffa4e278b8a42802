"""Bad input on purpose, many cases in one job: each is refused with a clear error on every
rank it reaches, and the job goes on (every worker catches the error, records it and
checks that nothing done before was lost). One RESULT record per case and rank.

Run at MPI_THREAD_SINGLE (``--thread-level single``) so that a case can ask for what needs
more; mpisync's own calls all come from the thread that makes them.
"""
from __future__ import annotations

import argparse
import sys
import time

import mpi4py

if "--thread-level" in sys.argv:
    mpi4py.rc.thread_level = sys.argv[sys.argv.index("--thread-level") + 1]

import torch
from common import attempt, dataset, emit, make_optimizer, model
from mpi4py import MPI

import mpisync

X, Y = dataset(256, seed=7)


def train(opt, net, steps: int, w: int, dtype=torch.float32, device="cpu",
          after_backward=None, first: int = 0) -> None:
    for i in range(first, first + steps):
        opt.zero_grad()
        start = 16 * (2 * i + w) % 224
        x, y = X[start:start + 16].to(device, dtype), Y[start:start + 16].to(device)
        loss = torch.nn.functional.cross_entropy(net(x).float(), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()



def sync_opt(net, **kw):
    return mpisync.SyncReplicasOptimizer(make_optimizer("sgd", net.parameters()),
                                         named_parameters=net.named_parameters(), **kw)


def params_of(net) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in net.parameters()]


def held_by_ps(opt) -> list[list[float]]:
    """The parameters as the ps ranks hold them, read at one global step."""
    values = opt.state_and_values(tables=False)[1]
    return [values[n].flatten().tolist() for n in opt._names]


# -- set-up refused on every worker (and said on the ps ranks) -------------------------------
def refused_setup(make):
    def case(w: int, cluster) -> dict:
        net = model()
        return {"error": attempt(lambda: make(net, w))}
    return case


def case_named_parameters_not_pairs(w, cluster):
    net = model()
    return {"error": attempt(lambda: mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()), named_parameters=net.parameters()))}


def case_shared_parameter(w, cluster):
    """A second optimizer over a parameter the first (open) one holds; the first goes on."""
    net = model()
    first = sync_opt(net)
    train(first, net, 2, w)
    error = attempt(lambda: sync_opt(net))
    train(first, net, 2, w)
    first.close()
    return {"error": error, "global_step": first.global_step}


def case_orders_differ(w, cluster):
    """Worker 0 creates the optimizer of net a first, worker 1 that of net b."""
    a, b = model(hidden=32), model(hidden=16)
    first, second = (a, b) if w == 0 else (b, a)
    return {"error": attempt(lambda: sync_opt(first)),
            "second": attempt(lambda: sync_opt(second))}


# -- refused at step(), on the worker that did it, before anything is sent ------------------
def step_refused(spoil, repair):
    """Train 2 steps, spoil something, see step() refuse it, repair, train 2 more.

    ``unchanged``: the ps ranks still hold the parameters of before (nothing was sent).
    """
    def case(w: int, cluster) -> dict:
        net = model()
        opt = sync_opt(net)
        train(opt, net, 2, w)
        before = params_of(net)
        spoiled = spoil(net, opt, w)
        error = attempt(lambda: train(opt, net, 1, w, **spoiled))
        step_at_error = opt.global_step
        repair(net, opt, w)
        unchanged = held_by_ps(opt) == before
        train(opt, net, 2, w)
        opt.close()
        return {"error": error, "unchanged": unchanged, "step_at_error": step_at_error,
                "global_step": opt.global_step}
    return case


def append_param(net, opt, w):
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    return {}


def pop_param(net, opt, w):
    opt._popped = opt.param_groups[0]["params"].pop()
    return {}


def to_double(net, opt, w):
    def convert():                       # between backward() and step()
        net[0].weight.data = net[0].weight.data.double()
    return {"after_backward": convert}


def to_half(net, opt, w):
    net.half()
    return {"dtype": torch.half}


def to_meta(net, opt, w):
    opt._held = dict(net.named_parameters())
    net.to("meta")
    return {"device": "meta"}


def back_from_meta(net, opt, w):
    for name, p in opt._held.items():
        module, attr = net.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(module, attr, p)


def case_nonfinite_skip(w, cluster):
    """Worker 1's gradient of step 2 holds NaN and Inf: the step is skipped, training goes
    on; ``matches``: the parameters equal a one-process loop over both workers' batches
    that skips that step."""
    net, ref = model(), model()
    opt = sync_opt(net, nonfinite="skip")

    def spoil():
        if w == 1:
            net[0].weight.grad[0, :2] = torch.tensor([float("nan"), float("inf")])
    for i in range(5):
        train(opt, net, 1, w, after_backward=spoil if i == 2 else None, first=i)
    ref_opt = make_optimizer("sgd", ref.parameters())
    for i in (0, 1, 3, 4):
        ref_opt.zero_grad()
        for k in (0, 1):                 # the mean of the two workers' gradients
            start = 16 * (2 * i + k) % 224
            (torch.nn.functional.cross_entropy(ref(X[start:start + 16]), Y[start:start + 16])
             / 2).backward()
        ref_opt.step()
    matches = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                  for a, b in zip(net.parameters(), ref.parameters()))
    opt.close()
    return {"error": None, "matches": matches, "global_step": opt.global_step,
            "skipped": opt.stats["steps_skipped_nonfinite"]}


def case_nonfinite_allreduce(w, cluster):
    """dense='allreduce': every worker's averaged gradient of step 2 holds NaN (worker 1's
    backward made it): NonFiniteError on every worker before anything is pushed or applied;
    training then goes on from where it was."""
    net = model()
    opt = sync_opt(net, dense="allreduce", allreduce_backend="mpi")
    train(opt, net, 2, w)
    before = params_of(net)
    hook = net[2].weight.register_hook(lambda g: g * float("nan")) if w == 1 else None
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(X[:16]), Y[:16])
    loss.backward()
    if hook is not None:
        hook.remove()
    error = attempt(opt.step)
    unchanged = params_of(net) == before
    train(opt, net, 2, w, first=2)
    opt.close()
    return {"error": error, "unchanged": unchanged, "global_step": opt.global_step}


def wrong_grad_shape(net, opt, w):
    def write():                         # .grad's setter checks the shape; .data does not
        net[0].weight.grad.data = torch.ones(net[0].weight.shape[1:])
    return {"after_backward": write}


# -- accepted, meaning what torch means ---------------------------------------------------
def case_step_before_backward(w, cluster):
    """step() with every .grad None: nothing is updated (torch), the step counts."""
    net = model()
    opt = sync_opt(net)
    before = params_of(net)
    opt.step()
    same = params_of(net) == before
    state = opt.state_dict()["state"]
    train(opt, net, 2, w)
    opt.close()
    return {"error": None, "unchanged": same, "state": len(state),
            "global_step": opt.global_step}


def case_close_twice(w, cluster):
    net = model()
    opt = sync_opt(net)
    train(opt, net, 3, w)
    opt.close()
    first = {k: v for k, v in opt.stats.items() if k != "token_wait_s"}
    error = attempt(opt.close)
    again = {k: v for k, v in opt.stats.items() if k != "token_wait_s"}
    return {"error": error, "same_stats": first == again, "global_step": opt.global_step}


def case_used_after_close(w, cluster):
    net = model()
    opt = sync_opt(net)
    train(opt, net, 1, w)
    opt.close()
    return {"error": attempt(opt.state_dict), "zero_grad": attempt(opt.zero_grad),
            "load": attempt(lambda: opt.load_state_dict({}))}


def case_state_dict_on_one_worker(w, cluster):
    """Only worker 0 reads the state, between its steps; worker 1 trains on meanwhile."""
    net = model()
    opt = sync_opt(net)
    train(opt, net, 2, w)
    read_at = None
    if w == 0:
        time.sleep(0.5)                  # worker 1 already waits inside its next step()
        read_at = opt.state_dict()["mpisync"]["global_step"]
    train(opt, net, 3, w)
    opt.close()
    return {"error": None, "read_at": read_at, "global_step": opt.global_step}


def case_load_on_one_worker(w, cluster):
    """Worker 0 loads a state; worker 1 goes on to step(): both get a DeadlockError."""
    net = model()
    opt = sync_opt(net)
    train(opt, net, 2, w)
    saved = opt.state_dict()
    if w == 0:
        error = attempt(lambda: opt.load_state_dict(saved))
    else:
        time.sleep(1.0)                  # worker 0's load is asked for first
        error = attempt(lambda: train(opt, net, 1, w))
    opt.close()
    return {"error": error, "global_step": opt.global_step}


WORKER_CASES = {
    "replicas_not_int": refused_setup(lambda net, w: sync_opt(net, replicas_to_aggregate="2")),
    "total_not_workers": refused_setup(lambda net, w: sync_opt(net, total_num_replicas=5)),
    "named_parameters_not_pairs": case_named_parameters_not_pairs,
    "named_not_tensor": refused_setup(lambda net, w: mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()),
        named_parameters=[*net.named_parameters(), ("temperature", 0.5)])),
    "duplicate_names": refused_setup(lambda net, w: mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()),
        named_parameters=[("w", p) for p in net.parameters()])),
    "empty_model": refused_setup(lambda net, w: mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()), named_parameters=[])),
    "horovod_without_threads": refused_setup(lambda net, w: sync_opt(
        net, dense="allreduce", allreduce_backend="horovod")),
    "shared_parameter": case_shared_parameter,
    "orders_differ": case_orders_differ,
    "groups_appended": step_refused(
        append_param, lambda net, opt, w: opt.param_groups[0]["params"].pop()),
    "groups_removed": step_refused(
        pop_param, lambda net, opt, w: opt.param_groups[0]["params"].append(opt._popped)),
    "dtype_changed": step_refused(
        to_double, lambda net, opt, w: setattr(net[0].weight, "data", net[0].weight.data.float())),
    "model_half": step_refused(to_half, lambda net, opt, w: net.float()),
    "model_to_meta": step_refused(to_meta, back_from_meta),
    "meta_parameter": refused_setup(lambda net, w: sync_opt(net.to("meta"))),
    "grad_shape": step_refused(wrong_grad_shape, lambda net, opt, w: None),
    "nonfinite_unknown": refused_setup(lambda net, w: sync_opt(net, nonfinite="ignore")),
    "nonfinite_skip": case_nonfinite_skip,
    "nonfinite_allreduce": case_nonfinite_allreduce,
    "nonfinite_skip_allreduce": refused_setup(
        lambda net, w: sync_opt(net, dense="allreduce", nonfinite="skip")),
    "step_before_backward": case_step_before_backward,
    "close_twice": case_close_twice,
    "used_after_close": case_used_after_close,
    "state_dict_on_one_worker": case_state_dict_on_one_worker,
    "load_on_one_worker": case_load_on_one_worker,
}


def init_cases(rank: int) -> tuple:
    """Before the job's cluster exists: versions that differ, then init() twice."""
    out = {}
    saved = mpisync.__version__
    if rank == 1:
        mpisync.__version__ = "0.0.1"          # as if an older mpisync ran here
    out["version_differs"] = attempt(lambda: mpisync.init(abort_on_error=False))
    mpisync.__version__ = saved
    wire = mpisync.ps_ranks.WIRE_VERSION
    if rank == MPI.COMM_WORLD.Get_size() - 1:
        mpisync.ps_ranks.WIRE_VERSION = wire + 1   # ... or another wire format
    out["wire_differs"] = attempt(lambda: mpisync.init(abort_on_error=False))
    mpisync.ps_ranks.WIRE_VERSION = wire
    # the MPI wheels are not CUDA-aware: asking for it is refused on every rank
    out["cuda_aware_required"] = attempt(lambda: mpisync.init(abort_on_error=False,
                                                              cuda_aware=True))
    cluster = mpisync.init()
    out["init_twice"] = attempt(mpisync.init)
    return cluster, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--thread-level", default="multiple")
    p.add_argument("--cases", default=",".join(WORKER_CASES))
    args = p.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    cluster, before = init_cases(rank)
    role = {"role": "ps", "ps": cluster.ps_index} if cluster.is_ps else {
        "role": "worker", "worker": cluster.worker_index}
    for case, error in before.items():
        emit(case=case, rank=rank, error=error, **role)
    if cluster.is_ps:
        served = cluster.serve()
        served = served if isinstance(served, list) else [served]
        emit(case="served", rank=rank, steps=[s["global_step"] for s in served], **role)
        emit(case="cluster_close", rank=rank, error=attempt(cluster.close), **role)
        return
    for case in args.cases.split(","):
        record = WORKER_CASES[case](cluster.worker_index, cluster)
        emit(case=case, rank=rank, **record, **role)
    # at MPI_THREAD_SINGLE, MPICH refuses to free a communicator with unread messages:
    # the final statistics of each optimizer closed without reading them
    emit(case="cluster_close", rank=rank, error=attempt(cluster.close), **role)


if __name__ == "__main__":
    main()
