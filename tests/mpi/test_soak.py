"""Soak: 2,000 global steps of the digits model on 3 workers and 1 ps rank, one worker
sleeping at random, with a backup worker and asynchronously. Everything adds up exactly:
the global step, the gradients each worker pushed (taken + dropped), each rank's memory,
and the parameters, which a replay of the recorded steps in one process reproduces bitwise.
"""
from __future__ import annotations

import sys
from collections import Counter, deque
from pathlib import Path

import pytest
import torch
from mpi_helpers import run_mpi

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from digits import load_data, make_model
from soak import LR

STEPS = 2000
WORKERS = 3
MAX_STALENESS = 2
#: resident memory a rank may gain after warm-up (200 steps) until the end: what the
#: step records of 2,000 steps take, with room for the allocator; a buffer leaked per step
#: (69 KB of gradients here) would take 130 MiB
GROWTH_BYTES = 16 << 20

pytestmark = pytest.mark.slow


def soak(mode: str):
    run = run_mpi("soak.py", WORKERS, 1, ["--mode", mode], timeout=240)
    workers = run.by_worker()
    assert sorted(workers) == list(range(WORKERS)), run.describe()
    saved = {w: torch.load(r["saved"], weights_only=True) for w, r in workers.items()}
    (ps,) = run.ps()
    per_step = torch.load(ps["saved"], weights_only=True)["per_step"]
    return run, workers, saved, ps, per_step


def check_memory(workers: dict, ps: dict) -> dict:
    """Sampled at the start, after warm-up (the ps: its first sample once every worker was
    past warm-up; its first optimizer step imports much of torch) and at the end."""
    grown = {f"worker {w}": r["memory"]["end"] - r["memory"]["warm"] for w, r in workers.items()}
    warm_at = max(r["memory"]["warm_at"] for r in workers.values())
    samples = ps["memory"]
    warm = next(rss for t, rss in samples if t >= warm_at)
    grown["ps 0"] = samples[-1][1] - warm
    assert all(g <= GROWTH_BYTES for g in grown.values()), grown
    return grown


def check_nothing_pickled(workers: dict, ps: dict) -> None:
    """The step's path pickles nothing: no object crossed mpi4py's pickle hooks on a worker
    during its 2,000 steps; on the ps only the set-up (with the shared-memory handshake:
    each worker's machine, the offer, the answer), the workers leaving and the final
    statistics did (a few per worker, whatever the number of steps)."""
    for w, r in workers.items():
        assert r["pickled"] == [0, 0], (w, r["pickled"])
    assert sum(ps["pickled"]) <= 6 * WORKERS, ps["pickled"]


def check_totals(workers: dict, saved: dict, ps: dict) -> None:
    """Per worker: taken + dropped = pushed; every worker's final statistics are ps 0's."""
    stats = ps["stats"]
    for w in range(WORKERS):
        pushed = len(saved[w]["pushes"])
        assert stats["taken_per_worker"][w] + stats["dropped_per_worker"][w] == pushed, (
            w, stats, pushed)
        mine = {k: v for k, v in workers[w]["stats"].items() if k in stats}
        assert mine == stats, (w, mine, stats)
    assert stats["gradients_pending"] == 0 and not stats["stopped"]
    assert stats["gradients_applied"] + stats["gradients_dropped"] == sum(
        len(s["pushes"]) for s in saved.values())


def grads_at(net, params, idx, x, y) -> list[torch.Tensor]:
    """The gradient a worker computed on batch ``idx`` with ``params``, as it did."""
    with torch.no_grad():
        for p, v in zip(net.parameters(), params):
            p.copy_(v)
    net.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
    return [p.grad for p in net.parameters()]


def replay(per_step: list[dict], pushes: dict[int, list], asynchronous: bool,
           wanted: set[int]) -> dict[int, list[torch.Tensor]]:
    """Apply the recorded steps in one process; the parameters at each step in ``wanted``.

    A step reduces the gradients it took as ps 0 does (summed in worker order, MEAN by
    multiplying with 1/2); asynchronous steps take each worker's pushes in order, each
    computed at the step it recorded.
    """
    x, y, _, _ = load_data(0)
    torch.manual_seed(0)
    model = make_model()                       # the parameters the ps ranks apply to
    worker_net = make_model()                  # where the workers' gradients are computed
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    params = list(model.parameters())
    queues = {w: deque(p) for w, p in pushes.items()}
    by_step = {w: {p[0]: p[1:] for p in ps} for w, ps in pushes.items()}
    uses = Counter(p[0] for ps in pushes.values() for p in ps) if asynchronous else Counter()
    seen, out = {}, {}
    applied = [r for r in per_step if r["taken"]]
    for t, rec in enumerate(applied):
        assert rec["step"] == t, rec
        now = [p.detach().clone() for p in params]
        if t in wanted:
            out[t] = now
        if uses[t]:
            seen[t] = now
        if asynchronous:
            (w,) = rec["taken"]
            at, *idx = queues[w].popleft()
            grads = grads_at(worker_net, seen[at], idx, x, y)
            uses[at] -= 1
            if not uses[at]:
                del seen[at]
            total = [g.clone() for g in grads]
        else:
            taken = sorted(rec["taken"])
            assert len(taken) == WORKERS - 1 == len(set(taken)), rec
            grads = [[g.clone() for g in grads_at(worker_net, now, by_step[w][t], x, y)]
                     for w in taken]
            total = [torch.add(a, b).mul_(1.0 / len(taken)) for a, b in zip(*grads)]
        for p, g in zip(params, total):
            p.grad = g
        opt.step()
    out[len(applied)] = [p.detach().clone() for p in params]
    return out


def check_replay(per_step, saved, workers, asynchronous: bool) -> None:
    finals = {w: r["global_step"] for w, r in workers.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                   # as the ranks ran (OMP_NUM_THREADS=1)
    try:
        at = replay(per_step, {w: s["pushes"] for w, s in saved.items()}, asynchronous,
                    set(finals.values()))
    finally:
        torch.set_num_threads(threads)
    for w, step in finals.items():
        mine = list(saved[w]["params"].values())
        assert all(torch.equal(a, b) for a, b in zip(mine, at[step])), (
            f"worker {w}'s parameters at global step {step} differ from the replay's")


def test_two_thousand_steps_with_a_backup_worker_add_up_exactly():
    run, workers, saved, ps, per_step = soak("backup")
    assert {r["global_step"] for r in workers.values()} == {STEPS}, run.describe()
    assert ps["stats"]["global_step"] == STEPS
    check_totals(workers, saved, ps)
    for t, rec in enumerate(per_step[:STEPS]):  # each step: 2 of the 3 workers, once each
        assert rec["step"] == t and len(rec["taken"]) == len(set(rec["taken"])) == 2, rec
    records = Counter((w, r["step"]) for r in per_step for w in r["taken"] + r["dropped"])
    pushes = Counter((w, p[0]) for w, s in saved.items() for p in s["pushes"])
    assert records == pushes, "a push recorded twice, or not at all"
    assert ps["stats"]["dropped_per_worker"][1] > 0   # the sleeper's gradients came late
    check_nothing_pickled(workers, ps)
    check_memory(workers, ps)
    check_replay(per_step, saved, workers, asynchronous=False)


def test_two_thousand_asynchronous_steps_add_up_exactly():
    _, workers, saved, ps, per_step = soak("async")
    stats = ps["stats"]
    assert stats["gradients_dropped"] == 0
    assert stats["global_step"] == sum(len(s["pushes"]) for s in saved.values()) >= STEPS
    assert all(r["global_step"] >= STEPS for r in workers.values())
    check_totals(workers, saved, ps)
    # max_staleness: while every worker trains, none gets more than k + 1 gradients applied
    # beyond the slowest (its token is held after the (k + 1)-th)
    counts, last = Counter(), {w: len(s["pushes"]) for w, s in saved.items()}
    for rec in per_step:
        (w,) = rec["taken"]
        counts[w] += 1
        if any(counts[v] == last[v] for v in last):
            break
        assert counts[w] - min(counts[v] for v in range(WORKERS)) <= MAX_STALENESS + 1, rec
    check_nothing_pickled(workers, ps)
    check_memory(workers, ps)
    check_replay(per_step, saved, workers, asynchronous=True)
