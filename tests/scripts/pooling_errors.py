"""Bags given bad input on purpose, many cases in one job (see test_pooling_jobs.py).

``BAD``: the bad bags (module arguments, input, offsets, per_sample_weights, the message
expected after "mpisync.EmbeddingBag 'emb.weight' got "); tests/unit/test_pooling.py checks
each in one process too. In this job every worker gives each of them to a table at its
third step (pool_on_ps=True; "auto" for mode="max", which it cannot pool), catches the
error, records it (case ``bag-<index in BAD>``) and trains on; then leaves a feature out of
a collection, and gives one it has no table for, alike. The last case, ``uncaught``, ends
the job: worker 1 leaves feature "b" out at its third step and does not catch the KeyError,
and every rank stops, naming it. ``--cases a,b`` runs those only (default: all, in this
order).
"""
from __future__ import annotations

import argparse

import torch
from common import attempt, emit

import mpisync

ROWS, DIM, STEPS, BAD_AT = 50, 4, 4, 2

BAD = [
    ({"mode": "mean"}, torch.arange(4), torch.tensor([0, 2]), torch.ones(4),
     (r"per_sample_weights with mode='mean'; as nn.EmbeddingBag, per_sample_weights only go "
     r"with mode='sum'")),
    ({"mode": "max"}, torch.arange(4), torch.tensor([0, 2]), torch.ones(4),
     r"per_sample_weights with mode='max'"),
    ({"mode": "sum"}, torch.arange(4), torch.tensor([0, 3, 2]), None,
     r"offsets that decrease: offsets\[2\] = 2 after 3"),
    ({"mode": "sum"}, torch.arange(4), torch.tensor([1, 3]), None,
     r"offsets starting at 1; the first bag must start at 0"),
    ({"mode": "sum"}, torch.arange(4), torch.tensor([0, 5]), None,
     r"offsets\[-1\] = 5, beyond the input's length 4"),
    ({"mode": "sum"}, torch.arange(4), torch.tensor([0, 2]), torch.ones(3),
     r"per_sample_weights of shape \[3\]; expected the input's shape \[4\]"),
    ({"mode": "sum"}, torch.arange(4), None, None, r"1-D input without offsets"),
    ({"mode": "sum"}, torch.zeros(2, 2, dtype=torch.long), torch.tensor([0]), None,
     r"2-D input \[2, 2\] with offsets"),
    ({"mode": "sum", "include_last_offset": True}, torch.arange(4),
     torch.tensor([], dtype=torch.long), None, r"empty offsets with include_last_offset=True"),
    ({"mode": "sum", "include_last_offset": True}, torch.arange(4), torch.tensor([0, 2, 3]),
     None, r"offsets\[-1\] = 3 with include_last_offset=True; it must be the input's length 4"),
    ({"mode": "sum"}, torch.arange(4), torch.tensor([0, 2]), torch.ones(4, dtype=torch.float64),
     (r"per_sample_weights of dtype torch.float64; as nn.EmbeddingBag, they must have the "
     r"table's dtype torch.float32")),
    ({"mode": "sum"}, torch.arange(4), torch.tensor([0.0, 2.0]), None,
     r"offsets of dtype torch.float32"),
]



def optimizer(model):
    return mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())


def case_bags(w: int, kw: dict) -> list[dict]:
    """A table with ``kw``; at step BAD_AT, each bad bag of BAD for ``kw``, caught."""
    mine = [n for n, bad in enumerate(BAD) if bad[0] == kw]
    model = torch.nn.Module()
    model.emb = mpisync.EmbeddingBag(ROWS, DIM, pool_on_ps="auto" if kw["mode"] == "max"
                                      else True, **kw)
    opt = optimizer(model)
    last = [6] if kw.get("include_last_offset") else []
    errors = {}
    for t in range(STEPS):
        if t == BAD_AT:
            for n in mine:
                _, ids, offsets, psw, _ = BAD[n]
                errors[n] = attempt(model.emb, ids, offsets, psw)
        opt.zero_grad()
        model.emb(torch.arange(6), torch.tensor([0, 2, 4, *last])).sum().backward()
        opt.step()
    opt.close()
    return [{"case": f"bag-{n}", "error": errors[n], "global_step": opt.global_step}
            for n in mine]


def features(w: int, t: int, drop: set[int]) -> dict:
    out = {"a": torch.arange(6).view(3, 2), "b": torch.arange(6).view(3, 2)}
    if w in drop and t == BAD_AT:
        del out["b"]
    return out


def case_collection(w: int, uncaught: bool = False) -> list[dict]:
    """A collection of two tables; at step BAD_AT a feature left out, then one it has no
    table for, each caught on every worker; ``uncaught``: worker 1 leaves "b" out at step
    BAD_AT and does not catch it."""
    model = torch.nn.Module()
    model.ebc = mpisync.EmbeddingBagCollection(
        {k: mpisync.EmbeddingBag(ROWS, DIM, mode="sum", pool_on_ps=True) for k in "ab"})
    opt = optimizer(model)
    errors = {}
    for t in range(STEPS):
        if t == BAD_AT and not uncaught:
            errors["missing_feature"] = attempt(model.ebc, features(w, t, {w}))
            errors["unknown_feature"] = attempt(
                model.ebc, {**features(w, t, set()), "c": torch.zeros(3, 2).long()})
        opt.zero_grad()
        got = model.ebc(features(w, t, {1} if uncaught else set()))
        sum(out.sum() for out in got.values()).backward()
        opt.step()
    opt.close()
    return [{"case": name, "error": error, "global_step": opt.global_step}
            for name, error in errors.items()]


CASES = {**{f"bags-{n}": (lambda w, kw=kw: case_bags(w, kw))
            for n, kw in enumerate({repr(b[0]): b[0] for b in BAD}.values())},
         "collection": case_collection,
         "uncaught": lambda w: case_collection(w, uncaught=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cluster = mpisync.init()
    if cluster.is_ps:
        cluster.serve()
        return
    for name in args.cases.split(","):
        for record in CASES[name](cluster.worker_index):
            emit(role="worker", worker=cluster.worker_index, **record)


if __name__ == "__main__":
    main()
