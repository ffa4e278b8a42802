"""Embedding tables under mpisync, case by case, against plain torch (see test_tables_jobs.py).

A case names the table kind (``resident``: mpisync.Embedding / EmbeddingBag on the ps
ranks; ``sparse``: nn.Embedding(sparse=True) on every worker), the optimizer, the id map
and the shards. ``reference(case)`` trains the same model with a dense nn.Embedding in
one process on the workers' combined batch (``sparse_adam``: torch's SparseAdam on a sparse
nn.Embedding).

The command line names the cases to run, one optimizer after another (``--dense=X`` first:
every case with ``dense=X``). A name ``allreduce:NAME`` runs case NAME with
``dense="allreduce"``; the names of ``OTHER`` run the cases of tables_modes.py (backup
workers, K-batch, async, the bytes a step moves) and tables_state.py (save and load). Each
ps rank reports each optimizer it served under the name of its case.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

import tables_modes
import tables_state
import torch
from common import emit

import mpisync

ROWS, DIM, FIELDS, CLASSES = 50, 4, 3, 3
WORKERS, BATCH, STEPS = 3, 5, 6


@dataclass
class Case:
    name: str
    kind: str = "resident"            # "resident" | "sparse" | "bag"
    optimizer: str = "sgd"      # "sgd" | "adagrad" | "sparse_adam" | "adam" | "rowwise*"
    strategy: str = "mod"
    shards: int = 3
    zero: str = "none"                # "none" | "zeros" (the optimizer's zero_grad), "model"
                                      # (model.zero_grad(): None), "model-zeros"
    write: bool = False               # clamp the table in place after step 2 (sparse only)
    mode: str = "sum"                 # of the bags
    padding: int | None = None
    pool: bool = False                # the bags pooled on the ps ranks (pool_on_ps=True)
    sync: dict = field(default_factory=dict)
    steps: int = STEPS
    device: str | None = None         # the model and the ids there, the table's device=
    scribble: bool = False            # the batch's ids overwritten after the forward, as a
                                      # loader that reuses its buffer does
    skip: bool = False                # the table left out of the forward of steps 1, 4, ...
    freeze: int | None = None         # the table's weight requires_grad=False from this step


CASES = [
    Case("resident-sgd-mod"),
    Case("resident-sgd-div", strategy="div", shards=4),
    Case("resident-adagrad-mod", optimizer="adagrad", shards=7),
    Case("resident-adagrad-div-zeros", optimizer="adagrad", strategy="div", zero="zeros"),
    Case("resident-adam-dense-update", optimizer="adam"),
    Case("resident-sparse-adam", optimizer="sparse_adam"),
    Case("resident-bag-adagrad", kind="bag", optimizer="adagrad"),
    Case("resident-bag-mean-padding", kind="bag", mode="mean", padding=0, strategy="div"),
    Case("resident-bag-pooled-adagrad", kind="bag", optimizer="adagrad", pool=True),
    Case("resident-bag-pooled-one-shard-scribbled", kind="bag", optimizer="adagrad", pool=True,
         shards=1, scribble=True),
    Case("resident-padding", optimizer="adagrad", padding=0),
    Case("resident-groups-steplr", optimizer="groups", strategy="div", shards=5),
    Case("sparse-sgd", kind="sparse"),
    Case("sparse-adagrad-partitioned", kind="sparse", optimizer="adagrad", shards=3),
    Case("sparse-sgd-momentum", kind="sparse", optimizer="sgd_momentum", shards=2),
    Case("sparse-sparse-adam", kind="sparse", optimizer="sparse_adam", shards=2),
    Case("sparse-adagrad-written", kind="sparse", optimizer="adagrad", shards=2, write=True),
    Case("resident-rowwise", optimizer="rowwise"),
    Case("resident-bag-rowwise-decay-div", kind="bag", optimizer="rowwise_decay", strategy="div"),
    Case("sparse-rowwise-partitioned", kind="sparse", optimizer="rowwise", shards=2),
    # 7 shards "div": shard 4 gets no ids in steps 2-4, and steps all the same
    Case("resident-adagrad-idle-shard", optimizer="adagrad", strategy="div", shards=7),
    Case("resident-sparse-adam-idle-shard", optimizer="sparse_adam", strategy="div", shards=7),
    Case("resident-adam-idle-shard", optimizer="adam", strategy="div", shards=7),
    Case("resident-bag-pooled-idle-shard", kind="bag", optimizer="adagrad", pool=True,
         strategy="div", shards=7),
    # the table left out of some steps' forward: after zero_grad(set_to_none=False) its
    # gradient is zero, not None, so torch steps it (Adagrad's step count, Adam's moments)
    Case("resident-adagrad-skipped-zeros", optimizer="adagrad", zero="zeros", skip=True),
    Case("resident-adam-skipped-zeros", optimizer="adam", zero="zeros", skip=True),
    Case("resident-adam-skipped", optimizer="adam", skip=True),
    Case("resident-adam-skipped-model-zero", optimizer="adam", zero="model", skip=True),
    Case("resident-bag-pooled-skipped-model-zeros", kind="bag", optimizer="adagrad",
         pool=True, zero="model-zeros", skip=True),
    Case("resident-bag-pooled-skipped-zeros", kind="bag", optimizer="adagrad", pool=True,
         zero="zeros", skip=True),
    Case("sparse-adagrad-skipped-zeros", kind="sparse", optimizer="adagrad", shards=2,
         zero="zeros", skip=True),
    # a frozen table (requires_grad=False) in the optimizer: torch never steps it from the
    # start; frozen later, a gradient set to None is skipped, a zeroed one still steps
    Case("resident-adam-frozen", optimizer="adam", freeze=0),
    Case("resident-rowwise-frozen-later", optimizer="rowwise", freeze=3),
    Case("resident-bag-pooled-adam-frozen-later-zeros", kind="bag", optimizer="adam", pool=True,
         zero="zeros", freeze=3),
    Case("sparse-adagrad-frozen-later", kind="sparse", optimizer="adagrad", shards=2, freeze=3),
    Case("resident-adagrad-device", optimizer="adagrad", device="cpu"),
    Case("resident-bag-device", kind="bag", optimizer="adagrad", device="cpu"),
]
#: On a GPU worker (tests marked gpu): rows come to the device, gradients go to the host
GPU_CASES = [
    Case("cuda-resident-adagrad", optimizer="adagrad", device="cuda"),
    Case("cuda-resident-adam-zeros", optimizer="adam", zero="zeros", device="cuda"),
    Case("cuda-bag-pooled-adagrad", kind="bag", optimizer="adagrad", pool=True, device="cuda"),
    Case("cuda-bag-mean", kind="bag", mode="mean", strategy="div", device="cuda"),
]
BY_NAME = {c.name: c for c in CASES + GPU_CASES}
ALLREDUCE = "allreduce:"
#: Cases of other programs, for a job of 3 workers: name -> (the worker's record of it)
OTHER = {
    "mode-backup": lambda cluster: tables_modes.train(cluster, "backup", steps=12),
    "mode-kbatch": lambda cluster: tables_modes.train(cluster, "kbatch", steps=8),
    "mode-async": lambda cluster: tables_modes.train(cluster, "async", steps=8),
    "moves-rows": lambda cluster: tables_modes.train(cluster, "scale", rows=10**6, ids=100),
    "state": tables_state.train_state,
}


def initial_table() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))


def data(steps: int):
    """Ids with repeats within and across workers (a skewed draw), and labels."""
    g = torch.Generator().manual_seed(11)
    n = WORKERS * BATCH * steps
    ids = (torch.rand(n, FIELDS, generator=g) ** 3 * ROWS).long()
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return ids, y


class Net(torch.nn.Module):
    def __init__(self, emb: torch.nn.Module, bag: bool, head: bool):
        super().__init__()
        self.emb, self.bag = emb, bag
        torch.manual_seed(0)
        width = DIM if bag else DIM * FIELDS
        self.head = torch.nn.Linear(width, CLASSES)
        self.head.requires_grad_(head)

    def forward(self, ids, skip: bool = False):
        if skip:                           # the table left out of this forward
            e = torch.zeros(len(ids), *(() if self.bag else (FIELDS,)), DIM, device=ids.device)
        else:
            e = self.emb(ids)
        return self.head(e if self.bag else e.flatten(1))


def build(case: Case, plain: bool) -> Net:
    """The case's model: under mpisync (plain=False), or for the one-process reference."""
    w = initial_table()
    bag = case.kind == "bag"
    pad = case.padding
    if plain:
        sparse = case.optimizer == "sparse_adam" or case.optimizer.startswith("rowwise")
        emb = (torch.nn.EmbeddingBag(ROWS, DIM, mode=case.mode, sparse=sparse, padding_idx=pad)
               if bag else torch.nn.Embedding(ROWS, DIM, sparse=sparse, padding_idx=pad))
        with torch.no_grad():
            emb.weight.copy_(w)
    elif case.kind == "sparse":
        emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(w)
    else:
        cls = mpisync.EmbeddingBag if bag else mpisync.Embedding
        kw = {"mode": case.mode, "pool_on_ps": case.pool} if bag else {}
        emb = cls(ROWS, DIM, partitioner=mpisync.fixed_size(case.shards),
                  partition_strategy=case.strategy, weight=w, padding_idx=pad,
                  device=case.device, **kw)
    return Net(emb, bag, head=case.optimizer != "sparse_adam")


def make_optimizer(case: Case, m: Net) -> torch.optim.Optimizer:
    params = [p for p in m.parameters() if p.requires_grad]
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if case.optimizer == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.3, momentum=0.9)
    if case.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=0.3, lr_decay=0.01)
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.05)
    if case.optimizer == "rowwise":
        return mpisync.RowWiseAdagrad(params, lr=0.3, initial_accumulator_value=0.1)
    if case.optimizer == "rowwise_decay":
        return mpisync.RowWiseAdagrad(params, lr=0.2, weight_decay=0.05, eps=1e-6)
    if case.optimizer == "groups":       # the table in a group of its own, scheduled
        return torch.optim.Adagrad([{"params": m.emb.parameters(), "lr": 0.5},
                                    {"params": m.head.parameters()}], lr=0.1)
    return torch.optim.SparseAdam(params, lr=0.05)


def sync_kwargs(case: Case) -> dict:
    kw = dict(case.sync)
    if case.kind == "sparse" and case.shards > 1:
        kw["partitioner"] = {"emb.weight": mpisync.fixed_size(case.shards)}
    return kw


def scheduler(case: Case, opt):
    if case.optimizer == "groups":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return None


def after_step(case: Case, m: Net, t: int) -> None:
    if case.write and t == 2:
        m.emb.weight.data.clamp_(-0.5, 0.5)       # on every worker, as a restore would


def zero_grad(case: Case, m: Net, opt) -> None:
    """The gradients reset as the case says: by the optimizer or by the model."""
    if case.zero.startswith("model"):
        m.zero_grad(set_to_none=case.zero == "model")
    else:
        opt.zero_grad(set_to_none=case.zero == "none")


def freeze(case: Case, m: Net, t: int) -> None:
    """At the case's step, the table's weight leaves autograd, as torch users freeze it."""
    if case.freeze == t:
        m.emb.weight.requires_grad_(False)


def skipped(case: Case, t: int) -> bool:
    """Whether step ``t`` leaves the table out of its forward."""
    return case.skip and t % 3 == 1


def reference(case: Case) -> dict:
    m = build(case, plain=True)
    opt = make_optimizer(case, m)
    sched = scheduler(case, opt)
    ids, y = data(case.steps)
    rows = WORKERS * BATCH
    for t in range(case.steps):
        freeze(case, m, t)
        zero_grad(case, m, opt)
        torch.nn.functional.cross_entropy(m(ids[t * rows:(t + 1) * rows], skipped(case, t)),
                                          y[t * rows:(t + 1) * rows]).backward()
        opt.step()
        if sched is not None:
            sched.step()
        after_step(case, m, t)
    return {"table": m.emb.weight.detach().tolist(),
            "head": [p.detach().tolist() for p in m.head.parameters()]}


def train(cluster, case: Case, extra: dict) -> dict:
    w = cluster.worker_index
    m = build(case, plain=False)
    device = torch.device(case.device or "cpu")
    if case.device:
        m.to(device)
    opt = mpisync.SyncReplicasOptimizer(make_optimizer(case, m),
                                        named_parameters=m.named_parameters(),
                                        **sync_kwargs(case), **extra)
    sched = scheduler(case, opt)
    ids, y = data(case.steps)
    if case.device:      # the ids on the worker's device; the rows come there
        ids, y = ids.to(device), y.to(device)
        with torch.no_grad():
            assert m.emb(ids[:BATCH]).device == ids.device
    rows = WORKERS * BATCH
    for t in range(case.steps):
        lo = t * rows + w * BATCH
        freeze(case, m, t)
        zero_grad(case, m, opt)
        batch = ids[lo:lo + BATCH].clone() if case.scribble else ids[lo:lo + BATCH]
        out = m(batch, skipped(case, t))
        if case.scribble:       # the push still sends the gradient of the ids looked up
            batch.fill_(0)
        torch.nn.functional.cross_entropy(out, y[lo:lo + BATCH]).backward()
        opt.step()
        if sched is not None:
            sched.step()
        after_step(case, m, t)
    if case.kind == "sparse":
        table = m.emb.weight.detach()
    else:
        table = torch.zeros(ROWS, DIM)
        for shard in opt.table_shards("emb.weight", with_state=False):
            table[shard["ids"]] = shard["weight"]
        assert torch.equal(m.emb.rows(torch.arange(ROWS)).cpu(), table)
        twin = copy.deepcopy(m)       # a copy of a served table: the same table on the ps
        assert twin.emb.table is m.emb.table
        assert torch.equal(twin.emb.rows(torch.arange(ROWS)).cpu(), table)
    stats = opt.stats
    out = {"table": table.tolist(),
           "head": [p.detach().cpu().tolist() for p in m.head.parameters()],
           "global_step": opt.global_step, "bytes_per_ps": stats["bytes_per_ps"],
           "plan": str(opt.plan)}
    opt.close()
    return out


def arguments(argv: list[str]) -> tuple[list[str], dict]:
    """The case names and the options of ``--dense=X``."""
    names, extra = list(argv), {}
    if names and names[0].startswith("--dense="):
        extra["dense"] = names.pop(0).split("=", 1)[1]
    return names, extra


def run_case(cluster, name: str, extra: dict) -> dict:
    if name in OTHER:
        return OTHER[name](cluster)
    if name.startswith(ALLREDUCE):
        return train(cluster, BY_NAME[name[len(ALLREDUCE):]], dict(extra, dense="allreduce"))
    return train(cluster, BY_NAME[name], extra)


def main() -> None:
    names, extra = arguments(sys.argv[1:])
    cluster = mpisync.init()
    if cluster.is_ps:
        served = cluster.serve()
        for n, stats in enumerate(served if isinstance(served, list) else [served]):
            emit(role="ps", ps=cluster.ps_index, case=names[n] if n < len(names) else None,
                 global_step=stats["global_step"],
                 stats=stats if cluster.ps_index == 0 else None)
        return
    for name in names:
        emit(role="worker", worker=cluster.worker_index, case=name,
             **run_case(cluster, name, extra))


if __name__ == "__main__":
    main()
