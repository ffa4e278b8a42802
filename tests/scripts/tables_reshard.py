"""Tables and their optimizer state loaded into another partitioning (see test_checkpoint_jobs.py).

``tables_reshard.py save DIR CASE...`` trains each case K steps and saves ``DIR/CASE.pt``.
``tables_reshard.py load DIR CASE...`` runs each case twice at this job's layout: unbroken for
K + M steps, then restored (``DIR/CASE.pt`` loaded into a fresh model and optimizer) for
M more; it reports both. A case ``shape:CASE`` there loads ``DIR/CASE.pt`` into tables
with one row more and with one column more, and reports the errors. Each case names the
table kind, the optimizer, and the partitioner and ``partition_strategy`` at save and at
load; the layout is the job's number of ps ranks. Every batch touches every shard of
every layout used here (so SparseAdam's per-shard step counters stay equal), and each
step's batch is drawn from a generator seeded with the step, so a restored run sees the
data an unbroken one sees. Everything runs in deterministic mode. checkpoint_jobs.py runs
it in a job beside other programs (``tables_reshard MODE DIR CASE...`` there).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from common import emit, run

import mpisync
from mpisync.protocol import partition

ROWS, DIM, FIELDS, FEATURES, CLASSES = 24, 4, 2, 3, 3
WORKERS, BATCH, K, M = 2, 8, 3, 3


@dataclass(frozen=True)
class Case:
    name: str
    kind: str                 # "resident" (mpisync.Embedding), "bag", "sparse" (nn.Embedding)
    optimizer: str            # "adagrad" | "adagrad_plain" (no lr_decay) | "sparse_adam" | "adam"
    saved: tuple              # (partitioner or None, strategy) of the job that saves
    loaded: tuple             # ... and of the jobs that load


CASES = [
    Case("adagrad-mod", "resident", "adagrad", (None, "mod"), (None, "mod")),
    Case("adagrad-fixed-div", "resident", "adagrad", (mpisync.fixed_size(2), "mod"),
         (mpisync.fixed_size(5), "div")),
    Case("sparse-adam-div-mod", "resident", "sparse_adam", (mpisync.fixed_size(3), "div"),
         (None, "mod")),
    Case("bag-adam-axis-size", "bag", "adam", (None, "div"),
         (mpisync.axis_size(100), "mod")),           # 16-byte rows: 4 shards
    Case("sparse-embedding-adagrad", "sparse", "adagrad", (mpisync.fixed_size(2), "div"),
         (mpisync.min_max(3, min_slice_size=64), "div")),
    # step 1 gives the saved shard 1 no rows: it steps all the same (the table had a
    # gradient), as the whole table does in one process, so the shards' counters agree
    Case("adagrad-missed-step", "resident", "adagrad_plain", (mpisync.fixed_size(2), "div"),
         (None, "mod")),
]
BY_NAME = {c.name: c for c in CASES}


def _anchors() -> list[int]:
    """One id in every shard of every layout here (up to 5 shards, "mod" and "div")."""
    return sorted({int(partition.unmap_ids(k, torch.tensor(0), ROWS, n, s))
                   for n in range(1, 6) for k in range(n) for s in ("mod", "div")})


def batch(t: int, worker: int, missed: bool = False):
    """Step t's batch of one worker (``worker=-1``: all of them); ``missed``: at step 1
    only rows below ROWS // 2 (the first of two "div" shards)."""
    g = torch.Generator().manual_seed(2000 + t)
    x = torch.randn(WORKERS * BATCH, FEATURES, generator=g)
    ids = torch.randint(0, ROWS, (WORKERS * BATCH, FIELDS), generator=g)
    anchors = torch.tensor(_anchors())
    ids[:len(anchors), 0] = anchors
    if missed and t == 1:
        ids %= ROWS // 2
    y = torch.randint(0, CLASSES, (WORKERS * BATCH,), generator=g)
    rows = slice(worker * BATCH, (worker + 1) * BATCH) if worker >= 0 else slice(None)
    return x[rows], ids[rows], y[rows]


class Net(torch.nn.Module):
    def __init__(self, case: Case, layout: tuple, rows: int = ROWS, dim: int = DIM):
        super().__init__()
        w = torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))
        partitioner, strategy = layout
        self.bag = case.kind == "bag"
        if case.kind == "sparse":
            self.emb = torch.nn.Embedding(rows, dim, sparse=True, _weight=w)
        else:
            cls = mpisync.EmbeddingBag if self.bag else mpisync.Embedding
            kw = {"mode": "sum"} if self.bag else {}
            self.emb = cls(rows, dim, partitioner=partitioner, partition_strategy=strategy,
                           weight=w, **kw)
        torch.manual_seed(0)
        self.head = torch.nn.Linear(FEATURES + dim * (1 if self.bag else FIELDS), CLASSES)
        self.head.requires_grad_(case.optimizer != "sparse_adam")   # SparseAdam: tables only

    def forward(self, x, ids):
        e = self.emb(ids)
        return self.head(torch.cat([x, e if self.bag else e.flatten(1)], 1))


def make(case: Case, layout: tuple, **net):
    m = Net(case, layout, **net)
    params = [p for p in m.parameters() if p.requires_grad]
    if case.optimizer == "adagrad":
        inner = torch.optim.Adagrad(params, lr=0.3, lr_decay=0.01)   # the step counts too
    elif case.optimizer == "adagrad_plain":
        inner = torch.optim.Adagrad(params, lr=0.3)
    elif case.optimizer == "adam":
        inner = torch.optim.Adam(params, lr=0.05)
    else:
        inner = torch.optim.SparseAdam(params, lr=0.05)
    kw = {}
    if case.kind == "sparse" and layout[0] is not None:
        kw["partitioner"] = {"emb.weight": layout[0]}
    opt = mpisync.SyncReplicasOptimizer(inner, named_parameters=m.named_parameters(),
                                        deterministic=True, **kw)
    return m, opt


def train(m, opt, w: int, until: int, case: Case) -> None:
    while opt.global_step < until:
        x, ids, y = batch(opt.global_step, w, case.name == "adagrad-missed-step")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x, ids), y).backward()
        opt.step()


def _listed(state: dict) -> dict:
    return {k: v.tolist() if torch.is_tensor(v) else v for k, v in state.items()}


def snapshot(case: Case, m, opt) -> dict:
    """The table, its optimizer state (per row, and per shard), the dense part and its state."""
    sd = opt.state_dict(tables=False)
    order = opt.group_order()
    out = {"global_step": opt.global_step,
           "dense": {n: p.detach().tolist() for n, p in m.named_parameters()
                     if n != "emb.weight"},
           "dense_state": {order[int(i)]: _listed(st) for i, st in sd["state"].items()
                           if order[int(i)] != "emb.weight"}}
    if case.kind == "sparse":
        out["table"] = m.emb.weight.detach().tolist()
        out["table_state"] = _listed(sd["state"][order.index("emb.weight")])
        out["shards"] = next(t.num_shards for t in opt._spec.tables)
        return out
    table = torch.zeros(ROWS, DIM)
    rows: dict = {}
    scalars = []
    shards = list(opt.table_shards("emb.weight"))
    for sh in shards:
        table[sh["ids"]] = sh["weight"]
        for key, value in sh["state"].items():
            if torch.is_tensor(value) and value.dim() and len(value) == len(sh["ids"]):
                rows.setdefault(key, torch.zeros(ROWS, *value.shape[1:], dtype=value.dtype))
                rows[key][sh["ids"]] = value
        scalars.append({k: v.tolist() if torch.is_tensor(v) else v
                        for k, v in sh["state"].items() if k not in rows})
    assert torch.equal(m.emb.rows(torch.arange(ROWS)), table)
    out.update(table=table.tolist(), table_state=_listed(rows), scalars=scalars,
               shards=len(shards))
    return out


def save(cluster, case: Case, where: str) -> dict:
    m, opt = make(case, case.saved)
    train(m, opt, cluster.worker_index, K, case)
    mpisync.save(os.path.join(where, f"{case.name}.pt"), m, opt)
    out = snapshot(case, m, opt)
    opt.close()
    return out


def load(cluster, case: Case, where: str) -> dict:
    w = cluster.worker_index
    m, opt = make(case, case.loaded)
    train(m, opt, w, K + M, case)
    unbroken = snapshot(case, m, opt)
    opt.close()
    m, opt = make(case, case.loaded)
    mpisync.load(os.path.join(where, f"{case.name}.pt"), m, opt)
    loaded_at = opt.global_step
    train(m, opt, w, K + M, case)
    restored = snapshot(case, m, opt)
    opt.close()
    return {"unbroken": unbroken, "restored": restored, "loaded_at": loaded_at,
            "global_step": restored["global_step"]}


def shape(cluster, case: Case, where: str) -> dict:
    out = {}
    for what, net in (("rows", {"rows": ROWS + 1}), ("dim", {"dim": DIM + 1})):
        m, opt = make(case, case.loaded, **net)
        try:
            mpisync.load(os.path.join(where, f"{case.name}.pt"), m, opt)
            out[what] = "loaded"
        except mpisync.ConfigError as exc:
            out[what] = str(exc)
        out[f"{what}_step"] = opt.global_step     # nothing loaded: still 0
        opt.close()
    return dict(out, global_step=0)


def cases(cluster, argv: list[str]):
    """``argv`` = ``MODE DIR CASE...``: each case's ``(name, record)`` in turn."""
    mode, where, names = argv[0], argv[1], argv[2:]
    for name in names:
        do, case = (shape, name.removeprefix("shape:")) if name.startswith("shape:") else \
            (save if mode == "save" else load, name)
        yield name, do(cluster, BY_NAME[case], where)


def worker(cluster) -> None:
    for name, record in cases(cluster, sys.argv[1:]):
        emit(role="worker", worker=cluster.worker_index, case=name, **record)


if __name__ == "__main__":
    run(worker)
