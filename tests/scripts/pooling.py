"""Bags pooled where the rows live, against the rows path and plain torch (see
test_pooling_jobs.py).

Each case trains, under one optimizer, two copies of one ``mpisync.EmbeddingBag`` (the
same initial rows, the same bags): ``rows`` with ``pool_on_ps=False`` and ``pooled`` with
the case's ``pool``; each has its own head, and the loss is the sum of both. Case
``collection`` trains an ``EmbeddingBagCollection`` of three tables beside three separate
tables. Cases ``bytes-*`` train a larger table (bags of 20 ids, rarely repeated) for the
bytes a step moves.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from common import emit, run

import mpisync

ROWS, DIM, CLASSES = 40, 4, 3
WORKERS, BATCH, STEPS = 2, 6, 4
BIG_ROWS, BIG_DIM, BIG_BATCH, BAG = 100_000, 64, 64, 20


@dataclass
class Case:
    name: str
    mode: str = "sum"
    pool: bool | str = True
    layout: str = "2d"              # "2d" | "offsets" | "last" (include_last_offset=True)
    weighted: bool = False          # per_sample_weights
    padding: int | None = None
    strategy: str = "mod"
    shards: int = 3
    twice: bool = False             # each table looked up twice per step
    steps: int = STEPS
    sync: dict | None = None        # SyncReplicasOptimizer's mode: backup, K-batch, async
    turns: bool = False             # the workers step one after another (async: each
    #                                 forward then reads both copies at one version)


CASES = [
    Case("sum-2d"),
    Case("mean-offsets-padding", mode="mean", layout="offsets", padding=0, strategy="div"),
    Case("sum-weights-last-offset", layout="last", weighted=True, shards=4),
    Case("sum-weights-padding", weighted=True, padding=3, shards=2),
    Case("mean-twice-auto", mode="mean", layout="offsets", pool="auto", twice=True),
    Case("max-auto", mode="max", layout="offsets", padding=1, pool="auto"),
]
# the same two copies under another mode: which pushes a step takes varies from run to run,
# but both copies are in every push, so they must still agree (each worker pushes as many
# gradients as complete its steps: 6 of 3 per step for K-batch)
MODES = [
    Case("backup", mode="mean", layout="offsets", padding=0, sync={"replicas_to_aggregate": 1}),
    Case("kbatch", layout="last", weighted=True, steps=3, sync={"replicas_to_aggregate": 3}),
    Case("async", weighted=True, padding=3, shards=2, sync={"asynchronous": True}, turns=True),
]
BY_NAME = {c.name: c for c in CASES + MODES}
COLLECTION = {"a": {"mode": "sum", "pool_on_ps": True},
              "b": {"mode": "mean", "pool_on_ps": False, "padding_idx": 2},
              "c": {"mode": "sum", "pool_on_ps": True, "partition_strategy": "div"}}
NAMES = [c.name for c in CASES + MODES] + ["collection", "bytes-rows", "bytes-pooled"]


def initial_table(rows: int = ROWS, dim: int = DIM) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))


def batch(case: Case, t: int, w: int, seed: int = 0):
    """Worker ``w``'s bags at step ``t``: ``(input, offsets, per_sample_weights)``, labels.

    Jagged layouts have empty bags, bags of one, and repeated ids; the draw is skewed.
    """
    g = torch.Generator().manual_seed(1000 * seed + 10 * t + w)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    if case.layout == "2d":
        ids = (torch.rand(BATCH, 3, generator=g) ** 2 * ROWS).long()
        offsets = None
    else:
        lengths = torch.tensor([0, 1, 4, 2, 0, 5][:BATCH])[torch.randperm(BATCH, generator=g)]
        ids = (torch.rand(int(lengths.sum()), generator=g) ** 2 * ROWS).long()
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        if case.layout == "offsets":
            offsets = offsets[:-1]
    weights = torch.rand(ids.shape, generator=g) + 0.5 if case.weighted else None
    return (ids, offsets, weights), y


def make_bag(case: Case, pool, plain: bool = False):
    kw = {"mode": case.mode, "padding_idx": case.padding,
          "include_last_offset": case.layout == "last"}
    if plain:
        emb = torch.nn.EmbeddingBag(ROWS, DIM, **kw)
        with torch.no_grad():
            emb.weight.copy_(initial_table())
        return emb
    return mpisync.EmbeddingBag(ROWS, DIM, partitioner=mpisync.fixed_size(case.shards),
                                partition_strategy=case.strategy, weight=initial_table(),
                                pool_on_ps=pool, **kw)


def head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, CLASSES)


def loss_of(emb, lin, args, y, twice: bool) -> torch.Tensor:
    out = emb(*args)
    if twice:
        out = out + 0.5 * emb(*args)
    return torch.nn.functional.cross_entropy(lin(out), y)


def reference(case: Case) -> list:
    """The table after training the rows copy's model in one process on both workers' bags."""
    emb, lin = make_bag(case, False, plain=True), head()
    opt = torch.optim.Adagrad([*emb.parameters(), *lin.parameters()], lr=0.3)
    for t in range(case.steps):
        opt.zero_grad()
        loss = sum(loss_of(emb, lin, *batch(case, t, w), case.twice) for w in range(WORKERS))
        (loss / WORKERS).backward()
        opt.step()
    return emb.weight.detach().tolist()


def table_of(opt, name: str, rows: int, dim: int) -> torch.Tensor:
    table = torch.zeros(rows, dim)
    for shard in opt.table_shards(name, with_state=False):
        table[shard["ids"]] = shard["weight"]
    return table


def train_case(case: Case, w: int, cluster=None) -> dict:
    model = torch.nn.ModuleDict({"rows": make_bag(case, False), "pooled": make_bag(case, case.pool),
                                 "rows_head": head(), "pooled_head": head()})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.3),
                                        named_parameters=model.named_parameters(),
                                        **(case.sync or {}))
    # under a mode the workers do not meet at one step: the others stop after their steps
    # and close; the chief steps on until they did (their last steps may need its
    # gradients), then reads the tables alone, while nothing changes them
    pushed, t, n = 0, 0, WORKERS
    while not opt.stopped and (t < case.steps or (
            case.sync and not case.turns and cluster.is_chief and not all(
                cluster.worker_comm.iprobe(source=o) for o in range(1, n)))):
        if case.turns and (w, t) != (0, 0):
            cluster.worker_comm.recv(source=(w - 1) % n)      # the previous one stepped
        args, y = batch(case, t, w)
        opt.zero_grad()
        (loss_of(model["rows"], model["rows_head"], args, y, case.twice)
         + loss_of(model["pooled"], model["pooled_head"], args, y, case.twice)).backward()
        opt.step()
        if case.turns and (w, t) != (n - 1, case.steps - 1):
            cluster.worker_comm.send(t, dest=(w + 1) % n)
        pushed, t = pushed + 1, t + 1
    heads = [(a - b).abs().max().item() for a, b in
             zip(model["rows_head"].parameters(), model["pooled_head"].parameters())]
    if case.sync and not cluster.is_chief:
        opt.close()
        cluster.worker_comm.send(pushed, dest=0)
        return {"heads": heads, "global_step": None}
    if case.sync:
        pushed += sum(cluster.worker_comm.recv(source=o) for o in range(1, n))
    out = {"rows": table_of(opt, "rows.weight", ROWS, DIM).tolist(),
           "pooled": table_of(opt, "pooled.weight", ROWS, DIM).tolist(),
           "heads": heads, "global_step": opt.global_step}
    opt.close()
    if case.sync:
        stats = opt.stats                   # the job's totals, once every worker closed
        out.update(global_step=None, steps=stats["global_step"], pushed=pushed,
                   applied=stats["gradients_applied"], dropped=stats["gradients_dropped"])
    return out


def train_collection(w: int) -> dict:
    """Three tables in a collection beside the same three looked up one by one."""
    case = Case("collection", layout="offsets", weighted=True)

    def tables():
        return {k: mpisync.EmbeddingBag(ROWS, DIM, partitioner=mpisync.fixed_size(3),
                                        weight=initial_table(), **kw)
                for k, kw in COLLECTION.items()}

    model = torch.nn.ModuleDict({"together": mpisync.EmbeddingBagCollection(tables()),
                                 "apart": torch.nn.ModuleDict(tables()),
                                 "head": torch.nn.Linear(3 * DIM, CLASSES)})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.3),
                                        named_parameters=model.named_parameters())
    lookups = []
    for t in range(case.steps):
        features, labels = {}, None
        for n, k in enumerate(COLLECTION):
            (ids, offsets, weights), y = batch(case, t, w, seed=n + 1)
            labels = y if labels is None else labels
            features[k] = (ids, offsets) if COLLECTION[k]["mode"] == "mean" else \
                (ids, offsets, weights)
        opt.zero_grad()
        together = model["together"](features)
        apart = {k: model["apart"][k](*features[k]) for k in COLLECTION}
        loss = sum(torch.nn.functional.cross_entropy(
            model["head"](torch.cat([out[k] for k in COLLECTION], 1)), labels)
            for out in (together, apart))
        loss.backward()
        opt.step()
        lookups.append((opt.stats["lookups_per_ps"], expected_lookups(model, features)))
    out = {k: (table_of(opt, f"together.tables.{k}.weight", ROWS, DIM)
               - table_of(opt, f"apart.{k}.weight", ROWS, DIM)).abs().max().item()
           for k in COLLECTION}
    out = {"diff": out, "lookups_per_ps": lookups, "global_step": opt.global_step}
    opt.close()
    return out


def ps_touched(emb, ids: torch.Tensor) -> set[int]:
    """The ps ranks holding shards with some of ``ids`` (those a lookup sends a message)."""
    spec = emb.table.channel.tables[emb.table.channel.index_of(emb.table)].spec
    return {spec.owners[k] for k in spec.locate(ids)[0].tolist()}


def expected_lookups(model, features) -> list[int]:
    """Per ps: one message for the whole collection, one per table looked up apart."""
    count = [0, 0]
    together = set().union(*(ps_touched(model["together"].tables[k], features[k][0])
                             for k in COLLECTION))
    for j in together:
        count[j] += 1
    for k in COLLECTION:
        for j in ps_touched(model["apart"][k], features[k][0]):
            count[j] += 1
    return count


def train_bytes(pool: bool, w: int) -> dict:
    """Bytes a step moves: one table of BIG_ROWS x 64, bags of 20 uniform ids."""
    model = torch.nn.ModuleDict({"emb": mpisync.EmbeddingBag(BIG_ROWS, BIG_DIM, mode="sum",
                                                             pool_on_ps=pool, seed=1),
                                 "head": torch.nn.Linear(BIG_DIM, 1)})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(w)
    per_step = []
    for _ in range(2):
        ids = torch.randint(0, BIG_ROWS, (BIG_BATCH, BAG), generator=g)
        opt.zero_grad()
        model["head"](model["emb"](ids)).square().mean().backward()
        opt.step()
        s = opt.stats
        per_step.append(sum(s["bytes_per_ps"]) + sum(s["lookup_sent_per_ps"])
                        + sum(s["lookup_received_per_ps"]))
    out = {"bytes_per_step": per_step, "global_step": opt.global_step}
    opt.close()
    return out


def worker(cluster):
    w = cluster.worker_index
    for name in sys.argv[1:]:
        if name == "collection":
            got = train_collection(w)
        elif name.startswith("bytes-"):
            got = train_bytes(name == "bytes-pooled", w)
        else:
            got = train_case(BY_NAME[name], w, cluster)
        emit(role="worker", worker=cluster.worker_index, case=name, **got)


if __name__ == "__main__":
    run(worker)
