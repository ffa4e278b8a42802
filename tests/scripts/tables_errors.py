"""Embedding tables given bad input on purpose, many cases in one job (see test_tables_jobs.py).

Each case is refused on every worker, which catches the error, records it (a RESULT
record per case and worker) and goes on: bad ids at the third step of training (then the
step is made with good ids), a bad set-up (then the optimizer is set up again as it should
be, and trains), a table the optimizer does not hold looked up. The last case,
``uncaught``, ends the job: worker 1 gives an id out of range at its third step and does
not catch the IndexError, and every rank stops, naming it. ``--cases a,b`` runs those
only (default: all, in this order).
"""
from __future__ import annotations

import argparse

import torch
from common import attempt, emit

import mpisync

ROWS, DIM, STEPS, BAD_AT = 50, 4, 4, 2

BAD_IDS = {"out_of_range": lambda: torch.tensor([3, ROWS]),
           "negative": lambda: torch.tensor([-1, 2]),
           "float_ids": lambda: torch.tensor([1.0, 2.0]),
           "int16_ids": lambda: torch.tensor([1, 2], dtype=torch.int16)}
BAD_SET_UP = ("bad_strategy", "zero_dim", "weight_differs")



def build(w: int, case: str | None = None):
    """A table and a scalar; the case's bad arguments, or none (``case=None``)."""
    weight = torch.zeros(ROWS + (w == 1), DIM) if case == "weight_differs" else None
    emb = mpisync.Embedding(ROWS, DIM, weight=weight,
                            partition_strategy="hash" if case == "bad_strategy" else "mod")
    model = torch.nn.Module()
    model.emb = emb
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    partitioner = {"scale": mpisync.fixed_size(2)} if case in ("zero_dim", "retry") else None
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        partitioner=partitioner)
    return model, opt


def train(model, opt, w: int, bad=None) -> None:
    """STEPS steps; at step BAD_AT, ``bad(model)`` first (it raises, or the job ends)."""
    for t in range(STEPS):
        if t == BAD_AT and bad is not None:
            bad(model)
        opt.zero_grad()
        (model.emb(torch.arange(5)).sum() * model.scale).backward()
        opt.step()


def case_bad_ids(w: int) -> list[dict]:
    """Every worker tries each kind of bad id at step BAD_AT, catches it, and trains on."""
    model, opt = build(w)
    errors = {}

    def bad(model):
        for name, ids in BAD_IDS.items():
            errors[name] = attempt(lambda ids=ids: model.emb(ids()))

    train(model, opt, w, bad)
    opt.close()
    return [{"case": name, "error": error, "global_step": opt.global_step}
            for name, error in errors.items()]


def case_set_up(case: str):
    """The set-up refused on every worker; then the optimizer set up as it should be."""
    def run_case(w: int) -> list[dict]:
        error = attempt(lambda: build(w, case))
        model, opt = build(w)
        train(model, opt, w)
        opt.close()
        return [{"case": case, "error": error, "global_step": opt.global_step}]
    return run_case


def case_left_out(w: int) -> list[dict]:
    """A table whose weight the torch optimizer does not hold: its lookup is refused,
    naming it and what to do; then the optimizer set up as it should be, and trains."""
    model = torch.nn.Module()
    model.emb = mpisync.Embedding(ROWS, DIM)
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD([model.scale], lr=0.1),
                                        named_parameters=model.named_parameters())
    error = attempt(lambda: model.emb(torch.arange(5)))
    opt.close()
    model, opt = build(w)
    train(model, opt, w)
    opt.close()
    return [{"case": "left_out", "error": error, "global_step": opt.global_step}]


def case_retry(w: int) -> list[dict]:
    """A worker that catches a set-up error can set up again, without the partitioner."""
    try:
        model, opt = build(w, "retry")
    except mpisync.ConfigError:
        print(f"worker {w}: set up again without the partitioner", flush=True)
        model, opt = build(w)
    train(model, opt, w)
    opt.close()
    print(f"worker {w}: trained to step {opt.global_step}", flush=True)
    return [{"case": "retry", "error": None, "global_step": opt.global_step}]


def case_uncaught(w: int) -> list[dict]:
    """Worker 1's id out of range, not caught: the job ends on every rank."""
    model, opt = build(w)
    train(model, opt, w, (lambda model: model.emb(BAD_IDS["out_of_range"]())) if w == 1
          else None)
    opt.close()
    return [{"case": "uncaught", "error": None, "global_step": opt.global_step}]


CASES = {"bad_ids": case_bad_ids, **{c: case_set_up(c) for c in BAD_SET_UP},
         "left_out": case_left_out, "retry": case_retry, "uncaught": case_uncaught}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cluster = mpisync.init()
    if cluster.is_ps:
        served = cluster.serve()
        served = served if isinstance(served, list) else [served]
        emit(role="ps", ps=cluster.ps_index, steps=[s["global_step"] for s in served])
        return
    w = cluster.worker_index
    for name in args.cases.split(","):
        for record in CASES[name](w):
            emit(role="worker", worker=w, **record)


if __name__ == "__main__":
    main()
