"""The distribution helpers in one job of 3 workers and 2 ps ranks (see test_helpers_jobs.py).

Reductions and broadcasts among the workers against MPI's own all-reduce of the same
values, between the steps of a training run; metrics; colocation; ``opt.update`` (its
results go to the test, which trains the same model in one process); the sampler; and
bad input to each, which must be the same error on every worker, after which training
goes on. Each check prints a RESULT record.
"""
from __future__ import annotations

import functools
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import emit
from mpi4py import MPI

import mpisync
from mpisync.runtime.collectives import OPS

W, B, STEPS = 3, 4, 6
DECAY = 0.5


# -- functions for opt.update: module level, so that the ps ranks find them -----------------
def max_norm(w: torch.Tensor, limit: float) -> torch.Tensor:
    """Rows of norm above ``limit`` scaled down to it (a new tensor)."""
    return torch.renorm(w, 2, 0, limit)


def renorm_in_place(w: torch.Tensor, limit: float) -> None:
    w.renorm_(2, 0, limit)


class Clip:
    """A callable instance holding plain data."""

    def __init__(self, bound: float):
        self.bound = bound

    def __call__(self, w: torch.Tensor) -> None:
        w.clamp_(-self.bound, self.bound)


def needs_one_dim(w: torch.Tensor) -> None:
    if w.dim() != 1:
        raise ValueError(f"wanted a vector, got {w.dim()} dimensions")


UPDATES = {"emb_dense": (functools.partial(max_norm, limit=1.0), "all"),
           "part": (functools.partial(renorm_in_place, limit=0.8), "all"),
           "table.weight": (functools.partial(renorm_in_place, limit=0.7), "touched"),
           "sparse.weight": (functools.partial(max_norm, limit=0.9), "all")}
# a second function on the sparse nn.Embedding, on the rows each step touched: it must get
# those rows, not the ones the first function changed
SECOND = ("sparse.weight", functools.partial(renorm_in_place, limit=0.6), "touched")
CLIP_FROM, CLIP_UNTIL = 2, 4          # "lin.*" clipped after the steps 2 and 3 only


# -- the model of opt.update -----------------------------------------------------------------
class Net(torch.nn.Module):
    """An embedding-like dense parameter, a partitioned one, a table, a sparse nn.Embedding."""

    def __init__(self, plain: bool):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.emb_dense = torch.nn.Parameter(torch.randn(20, 4, generator=g))
        self.part = torch.nn.Parameter(torch.randn(12, 4, generator=g))
        rows = torch.randn(30, 4, generator=g)
        if plain:
            self.table = torch.nn.Embedding(30, 4, sparse=True)
            with torch.no_grad():
                self.table.weight.copy_(rows)
        else:
            self.table = mpisync.Embedding(30, 4, partitioner=mpisync.fixed_size(2), weight=rows)
        self.sparse = torch.nn.Embedding(25, 4, sparse=True)
        with torch.no_grad():
            self.sparse.weight.copy_(torch.randn(25, 4, generator=g))
        self.lin = torch.nn.Linear(16, 1)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(1, 16, generator=g))
            self.lin.bias.fill_(0.1)
        self.frozen = torch.nn.Parameter(torch.ones(2))     # in no param group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([F.embedding(ids[:, 0], self.emb_dense), F.embedding(ids[:, 1], self.part),
                       self.table(ids[:, 2]), self.sparse(ids[:, 3])], 1)
        return self.lin(x).squeeze(1)


def adagrad(net: Net) -> torch.optim.Optimizer:
    return torch.optim.Adagrad([p for n, p in net.named_parameters() if n != "frozen"], lr=0.3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (every worker's B samples, in worker order)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.stack([torch.randint(0, n, (W * B,), generator=g) for n in (20, 12, 30, 25)], 1)
    return ids, torch.randn(W * B, generator=g)


def reference(clip: tuple[int, int] = (CLIP_FROM, CLIP_UNTIL)) -> dict:
    """One process, the combined batch, each constraint applied after every step (the
    clip of "lin.*" after the steps in ``range(*clip)``)."""
    net = Net(plain=True)
    opt = adagrad(net)
    floating = ["emb_dense", "part", "lin.weight", "lin.bias"]
    params = dict(net.named_parameters())
    averages = {n: params[n].detach().clone() for n in floating}
    for step in range(STEPS):
        ids, y = batch(step)
        opt.zero_grad()
        F.mse_loss(net(ids), y).backward()
        opt.step()
        with torch.no_grad():
            for name, (fn, _) in [*UPDATES.items(), (SECOND[0], SECOND[1:])]:
                out = fn(params[name])
                if out is not None:
                    params[name].copy_(out)
            if clip[0] <= step < clip[1]:
                for name in ("lin.weight", "lin.bias"):
                    Clip(0.3)(params[name])
            for n in floating:
                averages[n].lerp_(params[n], 1 - DECAY)
    return {"params": {n: p.detach().tolist() for n, p in params.items() if n != "frozen"},
            "averages": {n: a.tolist() for n, a in averages.items()}}


def train_with_updates(cluster, dense: str = "ps") -> None:
    """Registered before step 0 (and "lin.*" between steps); bad registrations in between.

    With ``dense="allreduce"`` the workers update emb_dense and lin.* themselves (and run
    their functions), the ps ranks the rest.
    """
    w = cluster.worker_index
    net = Net(plain=False)
    colocate = [["lin.bias", "emb_dense", "lin.weight"], ["table.weight", "sparse.weight"]]
    opt = mpisync.SyncReplicasOptimizer(
        adagrad(net), named_parameters=net.named_parameters(), ema_decay=DECAY,
        partitioner={"part": mpisync.fixed_size(3), "sparse.weight": mpisync.fixed_size(2)},
        colocate=colocate if dense == "ps" else colocate[1:], dense=dense)
    plan = opt.plan
    if dense == "ps":
        emit(role="worker", worker=w, case="colocated",
             owners=[[plan.owner(u) for u in g] for g in plan.colocate],
             groups=[list(g) for g in plan.colocate], table=str(plan))
    initial = opt.state_dict()            # the table's rows as made: most over the limit
    for name, (fn, rows) in [*UPDATES.items(), (SECOND[0], SECOND[1:])]:
        opt.update(name, fn, rows=rows)
    for step in range(STEPS):
        if step == CLIP_FROM:
            opt.update("lin.*", Clip(0.3))
            if dense == "ps":
                bad_updates(opt, w)
        if step == CLIP_UNTIL:
            opt.update("lin.*", None)
        ids, y = batch(step)
        opt.zero_grad()
        F.mse_loss(net(ids[w * B:(w + 1) * B]), y[w * B:(w + 1) * B]).backward()
        opt.step()
    params = dict(net.named_parameters())
    if dense == "ps" and w == W - 1:
        time.sleep(1.0)   # worker 0 is in load_state_dict() below meanwhile: rows as they are
    params["table.weight"] = net.table.rows(torch.arange(30))
    emit(role="worker", worker=w, case=f"update_{dense}", global_step=opt.global_step,
         params={n: p.detach().tolist() for n, p in params.items() if n != "frozen"},
         averages={n: a.tolist() for n, a in opt.averages().items()})
    if dense == "ps":     # loaded rows, touched by no step yet: rows="touched" sees them too
        opt.load_state_dict(initial)
        ids, y = batch(0)
        opt.zero_grad()
        F.mse_loss(net(ids[w * B:(w + 1) * B]), y[w * B:(w + 1) * B]).backward()
        opt.step()
        emit(role="worker", worker=w, case="update_after_load",
             norm=net.table.rows(torch.arange(30)).norm(dim=1).max().item())
    opt.close()


def bad_updates(opt, w: int) -> None:
    """Each refused on every worker; training goes on untouched."""
    local_max_norm = functools.partial(lambda t, limit: t.renorm_(2, 0, limit), limit=1.0)

    def closure(t):
        t.clamp_(0)
    cases = {"update_lambda": lambda: opt.update("part", lambda t: t.clamp_(0)),
             "update_partial_of_lambda": lambda: opt.update("part", local_max_norm),
             "update_closure": lambda: opt.update("part", closure),
             "update_unknown_name": lambda: opt.update("nope*", Clip(1.0)),
             "update_frozen": lambda: opt.update("frozen", Clip(1.0)),
             "update_rows": lambda: opt.update("part", Clip(1.0), rows="some"),
             "update_fails_on_stand_in": lambda: opt.update("part", needs_one_dim),
             "update_differs": lambda: opt.update("part", Clip(1.0 + w)),
             "update_only_on_workers": lambda: opt.update("part", globals()["only_on_workers"])}
    for name, call in cases.items():
        expect_error(name, w, call)


def expect_error(case: str, w: int, call, role: str = "worker") -> None:
    """Record the error ``call`` raises (None if it does not)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test checks which, on every worker
        emit(role=role, worker=w, case=case, error=type(exc).__name__, message=str(exc))
    else:
        emit(role=role, worker=w, case=case, error=None, message="")


# -- reductions ------------------------------------------------------------------------------
def values(w: int, r: int) -> dict:
    """Worker ``w``'s values of round ``r``: every dtype, 0-dim, empty, numbers, nests;
    in round 2 more than SMALL_BYTES, which take the Allreduce (the others travel with the
    agreement)."""
    g = torch.Generator().manual_seed(100 * r + w)
    large = {"large": torch.randn(64, 80, generator=g)} if r == 2 else {}
    f32 = torch.randn(5, 3, generator=g)
    if w == 1 and r:          # max and min propagate NaN, in small values and large ones
        f32[0, 0] = math.nan
        if r == 2:
            large["large"][3, 5] = math.nan
    return {**large,
        "f32": f32,
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "f16": torch.randn(6, generator=g).half(),
        "bf16": torch.randn(6, generator=g).bfloat16(),
        "i32": torch.randint(-50, 50, (7,), generator=g, dtype=torch.int32),
        "i64": torch.randint(-10**12, 10**12, (2, 2), generator=g),
        "i64_big": torch.full((2,), 2**62 + w),         # its sum wraps, its mean must not
        "u8": torch.randint(0, 80, (3,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(5, generator=g) > 0.5,
        "zero_dim": torch.tensor(1.5 + w),
        "empty": torch.empty(0, 4),
        "numbers": [w + 1, 0.25 * w + r, w % 2 == 0, 2**70 + w],   # Python ints: exact
        "numpy": (np.float32(w + 0.5), np.arange(3, dtype=np.int16) * (w + r)),
        "nested": {"a": [torch.arange(3) * (w + 1), (2.0 * w, torch.ones(2, dtype=torch.float64))]},
    }


_MPI = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def mpi_reduce(comm, x, op: str):
    """``x`` reduced by MPI itself, leaf by leaf: what cluster.reduce must give."""
    if isinstance(x, dict):
        return {k: mpi_reduce(comm, v, op) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(mpi_reduce(comm, v, op) for v in x)
    if isinstance(x, (bool, int, float)):
        total = comm.allreduce(x, op=_MPI[op])
        if op == "mean":
            return total / comm.Get_size()
        return bool(total) if isinstance(x, bool) else type(x)(total)
    res = _mpi_tensor(comm, torch.as_tensor(x), op)
    if isinstance(x, np.ndarray):
        return res.numpy()
    return res.numpy()[()] if isinstance(x, np.generic) else res


def _mpi_tensor(comm, t: torch.Tensor, op: str) -> torch.Tensor:
    mop = _MPI[op]
    if t.dtype == torch.bool:                 # a logical or (and) of the workers' bools
        send = t.numpy().astype(np.int64)
        mop = {"sum": MPI.LOR, "mean": MPI.SUM, "max": MPI.LOR, "min": MPI.LAND}[op]
    elif t.dtype in (torch.float16, torch.bfloat16):     # MPI has no such type: float32
        send = t.float().numpy()
    elif op == "mean" and not t.is_floating_point():     # summed in float64: no wrapping
        send = t.numpy().astype(np.float64)
    else:
        send = t.numpy()
    out = np.empty_like(send)
    comm.Allreduce(np.ascontiguousarray(send), out, op=mop)
    if op in ("max", "min") and t.is_floating_point():    # NaN wins, as in torch.maximum
        nan = np.array(np.isnan(send), dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, nan, op=MPI.LOR)
        out[nan.astype(bool)] = np.nan
    res = torch.from_numpy(out)
    if op != "mean":
        return res.to(t.dtype)
    if t.is_floating_point():
        return (res / comm.Get_size()).to(t.dtype)
    return (res.double() / comm.Get_size()).to(torch.get_default_dtype())


def mismatches(got, ref, exact: bool = False, path: str = "value") -> list[str]:
    """Where ``got`` differs from ``ref``: in type, dtype, shape or value."""
    if isinstance(ref, dict):
        if not isinstance(got, dict) or list(got) != list(ref):
            return [f"{path}: keys {list(got) if isinstance(got, dict) else got!r}"]
        return [m for k in ref for m in mismatches(got[k], ref[k], exact, f"{path}[{k!r}]")]
    if isinstance(ref, (list, tuple)):
        if type(got) is not type(ref) or len(got) != len(ref):
            return [f"{path}: {type(got).__name__} of {len(got)}"]
        return [m for i, (a, b) in enumerate(zip(got, ref))
                for m in mismatches(a, b, exact, f"{path}[{i}]")]
    if type(got) is not type(ref):
        return [f"{path}: {type(got).__name__}, expected {type(ref).__name__}"]
    if torch.is_tensor(ref) or isinstance(ref, (np.ndarray, np.generic)):
        a, b = torch.as_tensor(got), torch.as_tensor(ref)
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)}, expected {b.dtype}{list(b.shape)}"]
        rtol = 0 if exact or not b.is_floating_point() else (
            1e-12 if b.dtype == torch.float64 else 1e-6)
        wide = torch.complex128 if b.is_complex() else torch.float64
        return [] if torch.allclose(a.to(wide), b.to(wide), rtol=rtol, atol=0,
                                    equal_nan=True) else [
            f"{path}: {a.tolist()} != {b.tolist()}"]
    ok = got == ref if exact or not isinstance(ref, float) else abs(got - ref) <= 1e-12 * abs(ref)
    return [] if ok else [f"{path}: {got!r} != {ref!r}"]


def check_reductions(cluster, r: int) -> None:
    """Every op over every kind of value; batch_reduce; broadcast; the same on every worker."""
    w, ref_comm = cluster.worker_index, cluster.worker_comm
    mine = values(w, r)
    for op in OPS:
        got = cluster.reduce(mine, op)
        bad = mismatches(got, mpi_reduce(ref_comm, mine, op))
        every = ref_comm.allgather(got)
        bad += [f"worker {v}: {m}" for v, theirs in enumerate(every)
                for m in mismatches(theirs, every[0], exact=True)]
        emit(role="worker", worker=w, case=f"reduce_{op}_{r}", bad=bad)
    parts = [mine["f32"], mine["numbers"], {"x": mine["i64"], "y": mine["f16"]}]
    got = cluster.batch_reduce(parts, "mean")
    emit(role="worker", worker=w, case=f"batch_reduce_{r}",
         bad=mismatches(got, [mpi_reduce(ref_comm, p, "mean") for p in parts]))
    src = r % W
    sent = dict(values(src, r), text="hello", nothing=None)
    got = cluster.broadcast(sent if w == src else None, src=src)
    emit(role="worker", worker=w, case=f"broadcast_{r}", bad=mismatches(got, sent, exact=True))


def bad_reductions(cluster) -> None:
    """Bad input to each helper: the same error on every worker, then a good call works."""
    w = cluster.worker_index
    cases = {
        "shape": lambda: cluster.reduce(torch.ones(4 if w == 1 else 3)),
        "structure": lambda: cluster.reduce({"a": 1.0, **({"b": 2.0} if w == 2 else {})}),
        "dtype": lambda: cluster.reduce(torch.ones(3, dtype=torch.float64 if w else None)),
        "op_differs": lambda: cluster.reduce(1.0, "sum" if w == 0 else "mean"),
        "op_unknown": lambda: cluster.reduce(1.0, "prod"),
        "leaf": lambda: cluster.reduce([1.0, "text" if w == 2 else 2.0]),
        "complex_max": lambda: cluster.reduce(torch.ones(2, dtype=torch.complex64), "max"),
        "batch_not_a_list": lambda: cluster.batch_reduce(torch.ones(2)),
        "big_structure": lambda: cluster.reduce({f"t{i:02d}": torch.ones(
            4 if (w, i) == (2, 17) else 3) for i in range(40)}),
        "src_range": lambda: cluster.broadcast(1.0, src=W),
        "src_differs": lambda: cluster.broadcast(1.0, src=w % 2),
        "unpicklable": lambda: cluster.broadcast({"f": lambda: 0} if w == 1 else None, src=1),
        # failures of one worker's value that are no ConfigError: still every worker's error
        "meta_on_one": lambda: cluster.reduce(torch.empty(3, device="meta") if w == 1
                                              else torch.ones(3)),
        "meta_broadcast": lambda: cluster.broadcast(torch.empty(2, device="meta") if w == 1
                                                    else None, src=1),
        "uint64": lambda: cluster.reduce(np.uint64(3)),
        "other_collective": lambda: (cluster.reduce(1.0) if w == 0
                                     else cluster.worker_comm.bcast(1.0)),
    }
    for name, call in cases.items():
        expect_error(f"bad_{name}", w, call)
    # one MPI collective under two names (both MPI_Barrier): no error
    expect_error("barrier_either_spelling", w, lambda: (cluster.worker_comm.barrier() if w == 0
                                                        else cluster.worker_comm.Barrier()))
    got = cluster.batch_reduce([torch.tensor([1.0, 2.0]) * (w + 1), torch.tensor([1j * w])])
    emit(role="worker", worker=w, case="after_bad",
         bad=mismatches(got, [torch.tensor([6.0, 12.0]), torch.tensor([3j])]))


def reductions_between_steps(cluster) -> None:
    """Training in strict sync, with reductions between (and inside) the steps."""
    w = cluster.worker_index
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        named_parameters=net.named_parameters())
    x = torch.randn(W * B, 3, generator=torch.Generator().manual_seed(1))
    steps = []
    for r in range(3):
        opt.zero_grad()
        loss = net(x[w * B:(w + 1) * B]).pow(2).mean()
        loss.backward()
        opt.step()
        steps.append(cluster.reduce(opt.global_step, "max") == opt.global_step)
        check_reductions(cluster, r)
    bad_reductions(cluster)
    opt.zero_grad()
    net(x[w * B:(w + 1) * B]).pow(2).mean().backward()
    opt.step()                            # nothing was lost: the job trains on
    during = opt.stats["global_step"]     # answers from ps 0, after the collectives
    opt.close()
    emit(role="worker", worker=w, case="steps_between", same_step=all(steps),
         global_step=opt.global_step, stats=[during, opt.stats["global_step"]])


# -- metrics -------------------------------------------------------------------------------
def metric_records(w: int, rnd: int) -> dict:
    """What worker ``w`` records in round ``rnd``: w + 1 losses, weighted values, predictions."""
    g = torch.Generator().manual_seed(10 * rnd + w)
    n = 2 * w + 3
    return {"losses": [float(10 * w + i + rnd) for i in range(w + 1)],
            "values": torch.randn(n, generator=g), "weights": torch.rand(n, generator=g),
            "scores": torch.randn(n, 3, generator=g), "labels": torch.randint(0, 3, (n,),
                                                                              generator=g)}


def check_metrics(cluster) -> None:
    """Each worker records locally; every worker reads the same aggregate, across resets."""
    w = cluster.worker_index
    loss, weighted, total, accuracy = mpisync.Mean(), mpisync.Mean(), mpisync.Sum(), \
        mpisync.Accuracy()
    emit(role="worker", worker=w, case="metric_empty", mean=repr(loss.compute()),
         sum=total.compute())
    for rnd in range(2):
        rec = metric_records(w, rnd)
        for x in rec["losses"]:
            loss.update(x)
        weighted.update(rec["values"], weight=rec["weights"])
        total.update(torch.tensor(rec["losses"]))
        accuracy.update(rec["scores"], rec["labels"])
        emit(role="worker", worker=w, case=f"metric_{rnd}", loss=loss.compute(),
             weighted=weighted.compute(), sum=total.compute(), accuracy=accuracy.compute(),
             local_loss=loss.compute(local=True))
        for m in (loss, weighted, total, accuracy):
            m.reset()
    expect_error("metric_bad_weight", w, lambda: weighted.update(torch.ones(3), torch.ones(2)))
    expect_error("metric_bad_value", w, lambda: loss.update("x"))
    expect_error("metric_bad_shapes", w, lambda: accuracy.update(torch.ones(4), torch.ones(3)))


# -- colocation ------------------------------------------------------------------------------
def owner_is_odd(name: str, nbytes: int, ps_bytes: tuple) -> int:
    return 1 if name.endswith("bias") else 0


def colocation(cluster) -> None:
    """Groups share an owner under every strategy; impossible groups fail on every worker."""
    w = cluster.worker_index

    def make(colocate, placement="greedy_sorted", partitioner=None):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return mpisync.SyncReplicasOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
            placement=placement, partitioner=partitioner, colocate=colocate)
    group = [["2.bias", "0.weight"]]
    for placement in ("round_robin", "greedy", "greedy_sorted", owner_is_odd):
        opt = make(group, placement)
        emit(role="worker", worker=w, case=f"colocate_{getattr(placement, '__name__', placement)}",
             owners=[opt.plan.owner(n) for n in group[0]], plan=str(opt.plan))
        opt.close()
    bad = {"unknown": [["0.weight", "nope"]],
           "twice": [["0.weight", "0.bias"], ["0.bias", "2.weight"]],
           "shards": [["0.weight", "2.bias"]],
           "differs": [["0.weight", "0.bias" if w != 1 else "2.bias"]],
           "not_a_list": ["0.weight"]}
    for name, colocate in bad.items():
        parts = {"0.weight": mpisync.fixed_size(2)} if name == "shards" else None
        expect_error(f"colocate_{name}", w, lambda c=colocate, p=parts: make(c, partitioner=p))


# -- the sampler -----------------------------------------------------------------------------
def check_sampler(cluster) -> None:
    w = cluster.worker_index
    sampler = cluster.sampler(list(range(10)), shuffle=True, seed=3)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    even = list(cluster.sampler(list(range(10)), seed=3, drop_last=True))
    emit(role="worker", worker=w, case="sampler", epochs=epochs, length=len(sampler), even=even)


def define_only_on_workers() -> None:
    """A module-level function that only the workers define: the ps ranks cannot load it."""
    global only_on_workers

    def only_on_workers(t: torch.Tensor) -> None:
        t.clamp_(0)


def main() -> None:
    cluster = mpisync.init(num_ps=2)
    if cluster.is_ps:
        expect_error("ps_reduce", cluster.ps_index, lambda: cluster.reduce(1.0), role="ps")
        cluster.serve()
        return
    if cluster.num_workers != W:
        raise SystemExit(f"helpers.py runs on {W} workers")
    define_only_on_workers()
    reductions_between_steps(cluster)
    check_metrics(cluster)
    colocation(cluster)
    train_with_updates(cluster)
    train_with_updates(cluster, dense="allreduce")
    check_sampler(cluster)
    emit(role="worker", worker=cluster.worker_index, case="done")


if __name__ == "__main__":
    main()
