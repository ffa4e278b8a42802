"""mpisync.HashEmbedding under mpisync, case by case (see test_hashtables_jobs.py).

``exact`` cases: every worker looks up ids from a pool of int64 ids (negative and huge
ones), with capacity to spare; the model holds the hash table and, beside it, an
``mpisync.Embedding`` twin over the same ids mapped to ``0..n-1`` whose ``weight=`` is
the hash table's initial rows. Both must end equal, row by id, and equal to plain torch.
``evict`` cases: only worker 0 looks up (so the order of lookups is fixed), into shards
too small for the ids; ``simulate(case)`` trains the same model in one process with the
plain reference shard (hash_reference.py) deciding what is held. ``shared`` cases: both
workers look up the same batch each step, with ``admit_after=2``: the second lookup of a
new id admits it, whichever worker's it is; the worker whose lookup read zeros has its
gradient for that id dropped, the other's counts (``simulate`` does both lookups).
A case with ``save`` writes a checkpoint after every step into ``--save DIR`` (a
``Checkpointer`` chain: the first file full, the later ones the rows changed and the ids
evicted since), whose newest file hashtables_load.py loads into another number of ps ranks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from common import emit, run
from hash_reference import ReferenceShard

import mpisync
from mpisync import hashing

DIM, FIELDS, CLASSES, WORKERS = 3, 2, 3, 2
POOL = torch.tensor([-2**63, -2**40 - 3, -977, -1, 0, 1, 7, 12345, 2**31, 2**40 + 1, 2**62,
                     2**63 - 1, 99, -99, 5 * 10**17, -5 * 10**17, 31337, 2**33 + 5])


@dataclass
class Case:
    name: str
    kind: str = "exact"               # "exact" | "evict" | "shared"
    optimizer: str = "adagrad"        # "adagrad" | "adam" | "sgd"
    bag: bool = False
    capacity: int = 40
    shards: int | None = 2            # None: one per ps rank
    eviction: str = "lru"
    admit_after: int = 1
    steps: int = 5
    batch: int = 4
    save: bool = False
    init_std: float = 1.0


CASES = [
    Case("exact-adagrad"),
    Case("exact-adam-bag-mean", optimizer="adam", bag=True, shards=None, init_std=0.05),
    Case("evict-lru-sgd", kind="evict", optimizer="sgd", capacity=3, batch=2, steps=8),
    Case("evict-lfu-admit2-adagrad", kind="evict", capacity=3, eviction="lfu", admit_after=2,
         batch=2, steps=10),
    Case("evict-lru-adagrad-saved", kind="evict", capacity=4, shards=None, batch=2, steps=8,
         save=True),
    Case("shared-lfu-admit2-sgd", kind="shared", optimizer="sgd", capacity=3, eviction="lfu",
         admit_after=2, batch=2, steps=8),
]
BY_NAME = {c.name: c for c in CASES}


def data(case: Case):
    """Per step and worker: (ids [batch, FIELDS], labels); an empty batch if it looks nothing up."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(case.steps):
        step = []
        for w in range(WORKERS):
            at = (torch.rand(case.batch, FIELDS, generator=g) ** 2 * len(POOL)).long()
            y = torch.randint(0, CLASSES, (case.batch,), generator=g)
            if case.kind == "evict" and w:
                at, y = at[:0], y[:0]
            if case.kind == "shared" and w:
                at, y = step[0][2], step[0][1]
            step.append((POOL[at], y, at))
        out.append(step)
    return out


def head(case: Case) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(DIM if case.bag else DIM * FIELDS, CLASSES)


def make_optimizer(case: Case, params) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.Adagrad(params, lr=0.3)


def loss_of(case: Case, emb, lin, ids, y):
    e = emb(ids)
    out = lin(e if case.bag else e.flatten(1))
    return torch.nn.functional.cross_entropy(out, y, reduction="sum") / case.batch


def build(case: Case) -> torch.nn.ModuleDict:
    part = None if case.shards is None else mpisync.fixed_size(case.shards)
    kw = {"capacity_per_shard": case.capacity, "eviction": case.eviction,
          "admit_after": case.admit_after, "seed": 3, "partitioner": part,
          "init_std": case.init_std}
    emb = (mpisync.HashEmbeddingBag(DIM, mode="mean", **kw) if case.bag
           else mpisync.HashEmbedding(DIM, **kw))
    model = torch.nn.ModuleDict({"emb": emb, "head": head(case)})
    if case.kind == "exact":
        initial = emb.initial_rows(POOL)
        twin = (mpisync.EmbeddingBag(len(POOL), DIM, mode="mean", weight=initial,
                                      pool_on_ps=False) if case.bag
                else mpisync.Embedding(len(POOL), DIM, weight=initial))
        model["twin"], model["twin_head"] = twin, head(case)
    return model


def table_by_id(opt, name: str = "emb.weight") -> dict:
    """The hash table's rows, optimizer state and counts, by id, and shard by shard."""
    rows, shards = {}, []
    for shard in opt.table_shards(name):
        ids = shard["ids"].tolist()
        shards.append(ids)
        for n, i in enumerate(ids):
            rows[str(i)] = {"weight": shard["weight"][n].tolist(),
                            "state": {k: v[n].tolist() for k, v in shard["state"].items()
                                      if torch.is_tensor(v) and v.dim()},
                            "count": int(shard["counters"]["count"][n])}
    return {"rows": rows, "shards": shards}


def train(cluster, case: Case, save: str | None) -> dict:
    w = cluster.worker_index
    model = build(case)
    opt = mpisync.SyncReplicasOptimizer(make_optimizer(case, model.parameters()),
                                        named_parameters=model.named_parameters())
    ckpt = (mpisync.Checkpointer(save, model, opt, every_steps=1, full_every=1000)
            if case.save and save else None)
    for step in data(case):
        ids, y, at = step[w]
        opt.zero_grad()
        loss = loss_of(case, model["emb"], model["head"], ids, y)
        if case.kind == "exact":
            loss = loss + loss_of(case, model["twin"], model["twin_head"], at, y)
        loss.backward()
        opt.step()
        if ckpt is not None:
            ckpt.maybe_save()
    out = {"global_step": opt.global_step, "table": table_by_id(opt),
           "hash_stats": opt.stats["hash_tables"]["emb.weight"]}
    got = out["table"]["rows"]
    read = model["emb"].rows(POOL)          # zeros for ids without a row
    expect = torch.zeros(len(POOL), DIM)
    for n, i in enumerate(POOL.tolist()):
        if str(i) in got:
            expect[n] = torch.tensor(got[str(i)]["weight"])
    out["rows_agree"] = bool(torch.equal(read, expect))
    if case.kind == "exact":
        twin = torch.zeros(len(POOL), DIM)
        for shard in opt.table_shards("twin.weight", with_state=False):
            twin[shard["ids"]] = shard["weight"]
        out["twin"] = twin.tolist()
        out["heads"] = [[p.detach().tolist() for p in model[k].parameters()]
                        for k in ("head", "twin_head")]
    else:
        out["head"] = [p.detach().tolist() for p in model["head"].parameters()]
    opt.close()
    return out


# -- one process ---------------------------------------------------------------------------
def reference_exact(case: Case) -> dict:
    """Plain torch with a dense table of the pool's initial rows, on the combined batch."""
    initial = hashing.initial_rows(POOL, DIM, 3, std=case.init_std)
    emb = (torch.nn.EmbeddingBag(len(POOL), DIM, mode="mean", _weight=initial.clone())
           if case.bag else torch.nn.Embedding(len(POOL), DIM, _weight=initial.clone()))
    lin = head(case)
    opt = make_optimizer(case, [*emb.parameters(), *lin.parameters()])
    for step in data(case):
        opt.zero_grad()
        loss = sum(loss_of(case, emb, lin, at, y) for _, y, at in step) / WORKERS
        loss.backward()
        opt.step()
    return {"table": emb.weight.detach(), "head": [p.detach() for p in lin.parameters()]}


def simulate(case: Case) -> dict:
    """An evict or shared case in one process: the reference shards decide which rows
    exist; a gradient counts for the rows its lookup read (not the zeros of an id not yet
    admitted), if they are still held."""
    n = case.shards or 1       # saved cases run at 1 ps: one shard
    shards = [ReferenceShard(case.capacity, case.eviction, case.admit_after) for _ in range(n)]
    rows, acc = {}, {}
    lin = head(case)
    opt = make_optimizer(case, lin.parameters())
    for step in data(case):
        looked = []
        for ids, y, _ in step[:2 if case.kind == "shared" else 1]:
            unique, inverse = torch.unique(ids, return_inverse=True)
            where = hashing.shard_of(unique, n)
            for k, shard in enumerate(shards):
                admitted, evicted = shard.see(unique[where == k].tolist())
                for i in evicted:
                    del rows[i], acc[i]
                for i in admitted:
                    rows[i] = hashing.initial_rows(torch.tensor([i]), DIM, 3, std=case.init_std)[0]
                    acc[i] = torch.zeros(DIM)
            leaf = torch.stack([rows.get(i, torch.zeros(DIM)) for i in unique.tolist()])
            held = [i in rows for i in unique.tolist()]
            looked.append((ids, y, unique, inverse, leaf.requires_grad_(True), held))
        opt.zero_grad()
        loss = sum(loss_of(case, lambda _, leaf=leaf, inverse=inverse: leaf[inverse], lin, ids, y)
                   for ids, y, _, inverse, leaf, _ in looked) / WORKERS
        loss.backward()
        opt.step()
        grads: dict[int, torch.Tensor] = {}
        for _, _, unique, _, leaf, held in looked:
            for m, i in enumerate(unique.tolist()):
                if held[m] and i in rows:
                    grads[i] = leaf.grad[m] if i not in grads else grads[i] + leaf.grad[m]
        for i, g in grads.items():
            if case.optimizer == "sgd":
                rows[i] = rows[i] - 0.5 * g
            else:
                acc[i] = acc[i] + g * g
                rows[i] = rows[i] - 0.3 * g / (acc[i].sqrt() + 1e-10)
    return {"rows": rows, "acc": acc, "head": [p.detach() for p in lin.parameters()],
            "shards": shards}


def worker(cluster):
    args = sys.argv[1:]
    save = None
    if "--save" in args:
        at = args.index("--save")
        save = args[at + 1]
        del args[at:at + 2]
    for name in args:
        emit(role="worker", worker=cluster.worker_index, case=name,
             **train(cluster, BY_NAME[name], save))


if __name__ == "__main__":
    run(worker)
