"""Several torch optimizers in one SyncReplicasOptimizer, against plain torch.

Each case named on the command line trains a model whose parameters two optimizers share
out (an LR scheduler on each), saves a checkpoint after ``SAVE`` steps, records its
values after ``STEPS``, then resumes a second optimizer from the checkpoint (the
tables' cases through a ``Checkpointer``: a full file, then an incremental one) and records
the values it reaches. ``reference(name)`` is the same training in one process over the
concatenated batches, with the same optimizers; the test compares the two. First of all,
one worker gives optimizers that leave a parameter out: every worker must raise.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from common import emit, run

import mpisync
from mpisync.protocol.multi import split_state_dict

WORKERS, BATCH, STEPS, SAVE = 2, 4, 5, 2
ROWS, DIM, BAG, FEATURES, CLASSES = 12, 4, 3, 6, 3
CASES = ("adam+sgd", "adam+adagrad", "adam+rowwise")


class Dense(torch.nn.Module):
    """Two linear layers: the first for Adam, the second for SGD with momentum."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(FEATURES, 8)
        self.second = torch.nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class Bags(torch.nn.Module):
    """An embedding-bag table (its own optimizer) and a linear head (Adam)."""

    def __init__(self, plain: bool):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        initial = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
        if plain:
            self.emb = torch.nn.EmbeddingBag(ROWS, DIM, mode="mean", sparse=True,
                                             _weight=initial.clone())
        else:
            self.emb = mpisync.EmbeddingBag(ROWS, DIM, mode="mean", weight=initial.clone(),
                                            partitioner=mpisync.fixed_size(2))
        torch.manual_seed(0)
        self.head = torch.nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.emb(x))


def build(name: str, plain: bool):
    """(model, [optimizers]) of a case, in float64 (the default dtype the ranks set at
    start and ``reference`` while it runs)."""
    if name == "adam+sgd":
        m = Dense()
        opts = [torch.optim.Adam(m.first.parameters(), lr=0.05),
                torch.optim.SGD(m.second.parameters(), lr=0.1, momentum=0.9)]
    else:
        m = Bags(plain)
        table = (torch.optim.Adagrad([m.emb.weight], lr=0.3) if name == "adam+adagrad"
                 else mpisync.RowWiseAdagrad([m.emb.weight], lr=0.3))
        opts = [torch.optim.Adam(m.head.parameters(), lr=0.05), table]
    return m, opts


def schedulers(opts: list) -> list:
    """StepLR on the first optimizer, LambdaLR on the second."""
    return [torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5),
            torch.optim.lr_scheduler.LambdaLR(opts[1], lambda t: 1 / (1 + t))]


def batch(name: str, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``t``'s combined batch (every worker's rows, worker after worker)."""
    g = torch.Generator().manual_seed(100 + t)
    n = WORKERS * BATCH
    y = torch.randint(0, CLASSES, (n,), generator=g)
    if name == "adam+sgd":
        return torch.randn(n, FEATURES, generator=g, dtype=torch.float64), y
    return torch.randint(0, ROWS, (n, BAG), generator=g), y


def values(m, opt=None) -> dict:
    """Every parameter, the tables read from the ps ranks where ``opt`` is given."""
    out = {n: p.detach().tolist() for n, p in m.named_parameters()
           if not isinstance(m, Bags) or not n.startswith("emb.")}
    if isinstance(m, Bags):
        if opt is None:
            out["emb.weight"] = m.emb.weight.detach().tolist()
        else:
            table = torch.zeros(ROWS, DIM, dtype=torch.float64)
            for shard in opt.table_shards("emb.weight", with_state=False):
                table[shard["ids"]] = shard["weight"]
            out["emb.weight"] = table.tolist()
    return out


def reference(name: str) -> dict:
    """Plain torch in one process: the same optimizers over the concatenated batches.

    Run in the test's own process: torch's default dtype is float64 only while it runs.
    """
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m, opts = build(name, plain=True)
        scheds = schedulers(opts)
        for t in range(STEPS):
            x, y = batch(name, t)
            for o in opts:
                o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
        return {"values": values(m), "state": [o.state_dict() for o in opts],
                "lrs": [g["lr"] for o in opts for g in o.param_groups]}
    finally:
        torch.set_default_dtype(before)


def train_step(name: str, t: int, m, opt, scheds, rows) -> None:
    """Global step ``t`` on this worker's rows of the batch, then every scheduler."""
    x, y = batch(name, t)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x[rows]), y[rows]).backward()
    opt.step()
    for s in scheds:
        s.step()


def train(cluster, name: str, path: str) -> dict:
    w = cluster.worker_index
    rows = slice(w * BATCH, (w + 1) * BATCH)
    # adam+sgd: schedulers built before the optimizers are joined, saved as ``extra``; the
    # tables' cases: built over the joined optimizers, which a Checkpointer saves and
    # restores (a full file, then an incremental one)
    m, opts = build(name, plain=False)
    scheds = schedulers(opts) if name == "adam+sgd" else None
    opt = mpisync.SyncReplicasOptimizer(opts, named_parameters=m.named_parameters(),
                                        cluster=cluster)
    ck = None if name == "adam+sgd" else mpisync.Checkpointer(path, m, opt, full_every=2)
    scheds = scheds or schedulers(opts)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:   # torch's, of a scheduler's order
        warnings.simplefilter("always")
        for t in range(STEPS):
            if t == SAVE and ck is None:
                mpisync.save(path, m, opt, extra=[s.state_dict() for s in scheds])
            elif t in (SAVE - 1, SAVE) and ck is not None:
                ck.save()
            train_step(name, t, m, opt, scheds, rows)
            lrs.append(opts[0].param_groups[0]["lr"])
    state = opt.state_dict(tables=False)
    out = {"values": values(m, opt), "lrs": lrs, "counts": state["mpisync"]["optimizers"],
           "scheduler_warnings": [str(c.message) for c in caught
                                  if "lr_scheduler" in str(c.message)],
           "state": {str(i): {k: v.tolist() if torch.is_tensor(v) else v for k, v in s.items()}
                     for i, s in state["state"].items()},
           "groups": [{k: v for k, v in g.items() if k in ("lr", "momentum", "params")}
                      for g in state["param_groups"]]}
    # a round trip of the state dict, joined and one per optimizer: loading what was read
    # changes nothing
    opt.load_state_dict(state)
    again = opt.state_dict(tables=False)
    out["reloaded"] = values(m, opt) == out["values"] and _same(again["state"], state["state"])
    apart = split_state_dict(state, state["mpisync"]["optimizers"])
    opt.load_state_dict({"optimizers": apart, "mpisync": state["mpisync"]})
    again = opt.state_dict(tables=False)
    out["reloaded_apart"] = values(m, opt) == out["values"] and _same(again["state"],
                                                                       state["state"])
    opt.close()
    # resume from the checkpoint in a new optimizer, and train the remaining steps
    m, opts = build(name, plain=False)
    scheds = schedulers(opts) if name == "adam+sgd" else None
    opt = mpisync.SyncReplicasOptimizer(opts, named_parameters=m.named_parameters(),
                                        cluster=cluster)
    if ck is None:
        for s, saved in zip(scheds, mpisync.load(path, m, opt)):
            s.load_state_dict(saved)
    else:
        ck = mpisync.Checkpointer(path, m, opt, full_every=2)
        scheds = schedulers(opts)
        ck.resume()
    for t in range(SAVE, STEPS):
        train_step(name, t, m, opt, scheds, rows)
    out["resumed"] = values(m, opt)
    out["resumed_lrs"] = [g["lr"] for o in opts for g in o.param_groups]
    out["resumed_step"] = opt.global_step
    opt.close()
    return out


def refused(cluster) -> dict:
    """Worker 1 leaves a parameter out of its optimizers: every worker raises, naming it."""
    m, opts = build("adam+sgd", plain=False)
    given = opts[:1] if cluster.worker_index == 1 else opts
    try:
        mpisync.SyncReplicasOptimizer(given, named_parameters=m.named_parameters(),
                                      cluster=cluster)
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def late_scheduler(cluster) -> dict:
    """Torch's warning of a scheduler stepped before the optimizer, where torch gives it:
    a scheduler built over the second optimizer after two steps and stepped before the
    next ``opt.step()`` warns once (in one process too: ``late_scheduler_warnings``);
    stepped after it, it does not."""
    m, opts = build("adam+sgd", plain=False)
    opt = mpisync.SyncReplicasOptimizer(opts, named_parameters=m.named_parameters(),
                                        cluster=cluster)
    rows = slice(cluster.worker_index * BATCH, (cluster.worker_index + 1) * BATCH)
    warned = late_scheduler_warnings(opts[1],
                                     lambda t: train_step("adam+sgd", t, m, opt, [], rows))
    opt.close()
    return {"warned": warned}


def late_scheduler_warnings(second, step) -> list[int]:
    """How many scheduler warnings ``sched.step()`` gave, before and after the third step."""
    step(0)
    step(1)
    sched = torch.optim.lr_scheduler.StepLR(second, step_size=2, gamma=0.5)
    counts = []
    for t in (2, 3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if t == 3:
                step(t)
            sched.step()
        counts.append(sum("lr_scheduler" in str(c.message) for c in caught))
    return counts


def _same(x, y) -> bool:
    if torch.is_tensor(x):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def worker(cluster):
    directory = sys.argv[1]
    emit(role="worker", worker=cluster.worker_index, case="refused", **refused(cluster))
    emit(role="worker", worker=cluster.worker_index, case="late", **late_scheduler(cluster))
    for name in sys.argv[2:]:
        emit(role="worker", worker=cluster.worker_index, case=name,
             **train(cluster, name, os.path.join(directory, name if name != "adam+sgd" else f"{name}.pt")))


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    run(worker)
