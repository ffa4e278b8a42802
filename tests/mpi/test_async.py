"""Asynchronous mode: each gradient applied alone in arrival order, optionally bounded.

One job (3 workers, 2 ps ranks) trains every case, one optimizer after another: SGD and
Adam with a slow worker, replayed here in arrival order, then a slower worker without a
bound on staleness and with one.
"""
from __future__ import annotations

import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
from async_train import batch
from common import make_optimizer, model
from training_cases import case, ps_by_case

STEPS = 20
#: name: options of each case of the job
CASES = {"sgd": ("--slow", 2, "--opt", "sgd"), "adam": ("--slow", 2, "--opt", "adam"),
         "unbounded": ("--slow", 2, "--sleep", 0.05),
         "bound-1": ("--slow", 2, "--sleep", 0.05, "--max-staleness", 1)}


@pytest.fixture(scope="module")
def job() -> dict[str, tuple[dict, dict]]:
    """``{case: (its workers' records, ps 0's statistics)}``."""
    specs = [case(name, "--steps", STEPS, *options) for name, options in CASES.items()]
    run = run_mpi("async_train.py", 3, 2, [a for s in specs for a in ("--case", s)],
                  env={"MPISYNC_NUM_PS": "2"}, timeout=120 + 30 * len(specs))
    workers = run.assert_every_case_ran(CASES, 3, lambda name: None)
    ps = ps_by_case(run.ps(), list(CASES))
    return {name: (workers[name], ps[name][0]["stats"]) for name in CASES}


def replay(order: list[int], pushes: dict[int, list[int]], opt_name: str) -> dict:
    """One process applies the same gradients in the same order, each computed from the
    parameters of the step that the worker had when it computed it."""
    net = model()
    opt = make_optimizer(opt_name, net.parameters())
    history = [{n: p.detach().clone() for n, p in net.named_parameters()}]
    scratch = model()
    count = dict.fromkeys(pushes, 0)
    for g, w in enumerate(order):
        i = count[w]
        count[w] += 1
        computed_at = pushes[w][i]
        with torch.no_grad():
            for n, p in scratch.named_parameters():
                p.copy_(history[computed_at][n])
        scratch.zero_grad()
        x, y = batch(w, i, STEPS)
        torch.nn.functional.cross_entropy(scratch(x), y).backward()
        for (_, p), (_, q) in zip(net.named_parameters(), scratch.named_parameters()):
            p.grad = q.grad.clone()
        opt.step()
        history.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return history


def order_of(stats: dict) -> list[int]:
    """The workers whose gradients ps 0 (the coordinator) applied, in order."""
    assert stats["gradients_dropped"] == 0
    steps = stats["per_step"]
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert all(len(r["taken"]) == 1 and not r["dropped"] for r in steps)
    return [r["taken"][0] for r in steps]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_async_equals_applying_each_gradient_in_arrival_order(job, opt):
    workers, stats = job[opt]
    order = order_of(stats)
    assert len(order) == 3 * STEPS
    pushes = {w: r["pushes"] for w, r in workers.items()}
    # the slow worker's gradients were stale when applied, and were applied anyway
    applied_at = [g for g, w in enumerate(order) if w == 2]
    assert any(g > s for g, s in zip(applied_at, pushes[2]))
    # every gradient was computed from parameters the worker was handed, never ahead
    for w, steps in pushes.items():
        mine = [g for g, v in enumerate(order) if v == w]
        assert steps[0] == 0 and all(s == g + 1 for s, g in zip(steps[1:], mine)), w
    history = replay(order, pushes, opt)
    # each worker ends holding the parameters of the step after its last gradient
    assert max(r["global_step"] for r in workers.values()) == 3 * STEPS
    for w, r in workers.items():
        for name, value in r["params"].items():
            assert torch.allclose(torch.tensor(value), history[r["global_step"]][name],
                                  atol=1e-5, rtol=0), (w, name)


def max_lead(order: list[int], workers: int) -> int:
    """The largest lead, over every prefix of ``order``, of one worker over the slowest."""
    counts, lead = [0] * workers, 0
    for w in order:
        counts[w] += 1
        lead = max(lead, max(counts) - min(counts))
    return lead


@pytest.mark.parametrize("bound", [None, 1])
def test_bounded_staleness_keeps_fast_workers_near_the_slowest(job, bound):
    order = order_of(job["unbounded" if bound is None else f"bound-{bound}"][1])
    assert sorted(order) == sorted(list(range(3)) * STEPS)
    if bound is None:
        assert max_lead(order, 3) > 2          # unbounded: the fast workers run far ahead
    else:
        # a worker is handed its next token only within the bound, so its next applied
        # gradient can lead the slowest by at most bound + 1
        assert max_lead(order, 3) <= bound + 1
