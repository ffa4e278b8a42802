"""Pushes in buckets under every mode give what the steps ps 0 records should give.

The cases of ``tests/scripts/buckets.py`` train with buckets of 64 bytes (2 workers, 2 ps
ranks) over three transports: the workers and ps ranks paired through shared memory, MPI
messages between every pair (the first buckets of each push sent from gradient hooks while
backward runs, as between machines), and a mix of both. Two jobs carry them: one with
shared memory on every rank, one with it off on worker 1 and ps 1 (the mix), where each
case runs again with it off on every worker (messages). This process replays every case:
each step's taken pushes (ps 0's record) reduced
as the ps ranks reduce them (in worker order, in float32 from the wire's dtype) and
applied with plain torch; each push's gradient computed as its worker computed it, at the
parameters of the step it was computed at (rounded to the wire's dtype when the wire has
one). The ps ranks' parameters and every worker's must be the replay's.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
from buckets import CASES, Net, gradient, optimizer
from training_cases import ps_by_case

TOLERANCE = 1e-6
#: How far a wire dtype takes the parameters from float32's after the case's 10 steps,
#: relative to the largest parameter (measured 1.2e-3 and 1.8e-4; README)
WIRE_ERROR = {torch.bfloat16: 5e-3, torch.float16: 1e-3}


def launch(env: dict[str, str], transports: list[str]) -> dict[str, tuple[dict, dict]]:
    """One job of every case over each transport: ``{"TRANSPORT:CASE": (workers' records,
    ps 0's statistics)}``."""
    given = [f"{transport}:{case}" for transport in transports for case in CASES]
    before = shm_files()
    run = run_mpi("buckets.py", 2, 2, given, timeout=120 + 20 * len(given), env=env)
    assert shm_files() <= before          # shared memory leaves no file behind
    by_case, ps = run.by_case(), ps_by_case(run.ps(), given)
    return {name: (by_case[name], ps[name][0]["stats"]) for name in given}


@pytest.fixture(scope="module")
def shared_memory_job():
    """Workers and ps ranks paired through shared memory where they can (the default on
    one machine)."""
    return launch({}, ["shared-memory"])


@pytest.fixture(scope="module")
def split_job():
    """``MPISYNC_SHARED_MEMORY=0`` on worker 1 and ps 1 only (ranks 1 and 3): worker 0 and
    ps 0 share memory, every other pair exchanges messages (``mixed``); then each case
    again with it off on worker 0 too, so that every pair exchanges messages."""
    return launch({"SHM_OFF_ON_RANKS": "1,3"}, ["mixed", "messages"])


@pytest.fixture(scope="module", params=["shared-memory", "messages", "mixed"])
def job(request):
    """The cases of one transport: ``{case: (workers' records, ps 0's statistics)}``."""
    launched = request.getfixturevalue(
        "shared_memory_job" if request.param == "shared-memory" else "split_job")
    out = {name: launched[f"{request.param}:{name}"] for name in CASES}
    out["transport"] = request.param
    return out


def shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if "mpisync" in f} if os.path.isdir(
        "/dev/shm") else set()


def wire_of(case: str):
    w = CASES[case].get("wire_dtype")
    return {"fp16": torch.float16}.get(w, w)


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


class Worker:
    """One worker's gradients, computed in push order with its .grad carried across."""

    def __init__(self, case: str, w: int, pushes: list[int]):
        self.case, self.w, self.pushes = case, w, pushes
        self.net = Net()
        self.grads: list[list[torch.Tensor | None]] = []

    def compute_until(self, step: int, history: dict[int, torch.Tensor], wire) -> None:
        while len(self.grads) < len(self.pushes) and self.pushes[len(self.grads)] <= step:
            k = len(self.grads)
            values = history[self.pushes[k]]
            if wire is not None:
                values = values.to(wire).to(values.dtype)
            torch.nn.utils.vector_to_parameters(values, self.net.parameters())
            self.net.zero_grad(set_to_none=not (self.case == "strict-unused" and k % 4 == 3))
            gradient(self.case, self.net, self.w, k)
            self.grads.append([None if p.grad is None else p.grad.clone()
                               for p in self.net.parameters()])


def reduce(grads: list[torch.Tensor | None], like: torch.Tensor, wire) -> torch.Tensor:
    """The mean of the taken gradients as a ps rank computes it (absent ones as zeros)."""
    ins = [torch.zeros_like(like) if g is None else g for g in grads]
    if wire is not None:
        out = ins[0].to(wire).to(like.dtype)
        for g in ins[1:]:
            out.add_(g.to(wire))
    elif len(ins) == 1:
        out = ins[0].clone()
    else:
        out = torch.add(ins[0], ins[1])
        for g in ins[2:]:
            out.add_(g)
    n = len(ins)
    return out.mul_(1.0 / n) if n & (n - 1) == 0 else out.div_(n)


def replay(case: str, records: dict, stats: dict) -> dict[int, torch.Tensor]:
    """The parameters after every global step, replayed from ps 0's record."""
    torch.set_num_threads(1)
    wire = wire_of(case)
    net = Net()
    opt = optimizer(net.parameters())
    history = {0: flat(net)}
    workers = {w: Worker(case, w, r["pushes"]) for w, r in records.items()}
    fifo = dict.fromkeys(workers, 0)              # asynchronous: the next push applied
    for rec in stats["per_step"]:
        s = rec["step"]
        if s >= stats["global_step"]:
            break
        for worker in workers.values():
            worker.compute_until(s, history, wire)
        taken = []
        for w in sorted(set(rec["taken"])):
            n = rec["taken"].count(w)
            if CASES[case].get("asynchronous"):
                taken += [workers[w].grads[k] for k in range(fifo[w], fifo[w] + n)]
                fifo[w] += n
            else:
                at_s = [k for k, at in enumerate(workers[w].pushes) if at == s]
                taken += [workers[w].grads[k] for k in at_s[:n]]
        for i, p in enumerate(net.parameters()):
            grads = [g[i] for g in taken]
            p.grad = None if all(g is None for g in grads) else reduce(grads, p.detach(), wire)
        opt.step()
        history[s + 1] = flat(net)
    return history


def assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item()
    assert err <= TOLERANCE * max(1.0, want.abs().max().item()), (what, err)


@pytest.mark.parametrize("case", list(CASES))
def test_bucketed_pushes_give_the_replayed_steps(job, case):
    records, stats = job[case]
    assert sorted(records) == [0, 1], (case, sorted(records))
    wire = wire_of(case)
    history = replay(case, records, stats)
    steps = stats["global_step"]
    assert steps >= 10 and len(history) > steps
    chief = records[0]
    master = torch.cat([torch.tensor(chief["master"]["values"][n]).reshape(-1)
                        for n, _ in Net().named_parameters()])
    assert_close(master, history[chief["master"]["step"]], (case, "ps ranks"))
    for w, r in records.items():
        held = torch.cat([torch.tensor(v).reshape(-1) for v in r["held"].values()])
        want = history[r["global_step"]]
        if wire is not None:
            want = want.to(wire).to(want.dtype)          # the workers hold the wire's values
        assert_close(held, want, (case, "worker", w))


def test_buckets_went_from_hooks_and_again_when_changed(job):
    """Messages: hooks sent buckets while backward ran; a bucket changed after (clipping,
    a second backward) went again, and a second backward per step is then waited for.
    Shared memory: no bucket travels at all, except where a 16-bit wire or extra tokens
    keep the pair on messages, and no gradient hook is placed where every ps rank is in
    shared memory (a worker with one of its two ps ranks there hooks the other's buckets)."""
    if job["transport"] == "mixed":
        for case in CASES:
            messages = case in ("kbatch", "bf16", "fp16")
            shared = [job[case][0][w]["counts"]["shared"] for w in (0, 1)]
            assert shared == ([0, 0] if messages else [1, 0]), (case, shared)
            assert all(job[case][0][w]["counts"]["hooks"] > 0 for w in (0, 1)), case
        return
    if job["transport"] == "shared-memory":
        for case in CASES:
            counts = job[case][0][0]["counts"]
            messages = case in ("kbatch", "bf16", "fp16")
            assert (counts["buckets"] > 0) == messages, (case, counts)
            assert counts["shared"] == (0 if messages else 2), (case, counts)
            assert (counts["hooks"] > 0) == messages, (case, counts)
        return
    for case in CASES:
        counts = job[case][0][0]["counts"]
        assert counts["from_hooks"] > 0 and counts["shared"] == 0, (case, counts)
        if case in ("strict-clip", "strict-accumulate"):
            assert counts["resent"] >= 1, (case, counts)
        else:
            assert counts["resent"] == 0, (case, counts)
    accumulate = job["strict-accumulate"][0][0]["counts"]
    assert accumulate["resent"] == 1, accumulate     # the first step only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_wire_stays_within_its_documented_error(job, dtype):
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    exact = replay("strict", *job["strict"])
    rounded = replay(name, *job[name])
    last = min(max(exact), max(rounded))
    err = (rounded[last] - exact[last]).abs().max().item() / exact[last].abs().max().item()
    assert 0 < err <= WIRE_ERROR[dtype], (name, err)
