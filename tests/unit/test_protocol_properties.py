"""Property tests of the step protocol (no MPI): the coordinator and the shard accumulators
driven through any interleaving of pushes, applies, closes, loads, collectives and state
requests by W workers, against a small reference model of TensorFlow's rules.

The reference (``sync_replicas_optimizer.py`` and ``conditional_accumulator_base.cc``): a
gradient computed at the accumulator's global step is taken, one computed at an older step
is dropped (``local_step < global_step``); a step takes ``replicas_to_aggregate``
gradients, is applied once, and only then the global step moves on and every waiting
worker gets its token. mpisync adds what DESIGN.md and README.md document: the first
``replicas_to_aggregate`` fresh gradients in arrival order, from distinct workers unless
``num_tokens`` lets one worker compute more; a gradient arriving while its step is applied
is dropped too; asynchronous mode applies every gradient alone in arrival order, with
``max_staleness`` bounding how far a worker runs ahead of the slowest open one.
"""
from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpisync.accumulate import REDUCTIONS, ShardAccumulator, StepCoordinator

CASES = settings(max_examples=1000, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# what a worker is doing, as the driver sees it
COMPUTING, WAITING, LOADING, PARKED, STOPPED, CLOSED = (
    "computing", "waiting", "loading", "parked", "stopped", "closed")


@dataclass(frozen=True)
class Job:
    """One configuration: W workers, R gradients a step, extra tokens or asynchronous mode."""

    W: int
    R: int
    num_tokens: int = 0
    asynchronous: bool = False
    max_staleness: int | None = None
    start: int = 0


@st.composite
def jobs(draw) -> Job:
    W = draw(st.integers(1, 5))
    start = draw(st.integers(0, 3))
    regime = draw(st.sampled_from(["strict", "backup", "fewer", "extra", "async"]))
    if regime == "async":
        return Job(W, 1, 0, True, draw(st.one_of(st.none(), st.integers(0, 3))), start)
    if regime == "strict" or (regime == "backup" and W == 1):
        return Job(W, W, 0, start=start)
    if regime == "backup":
        return Job(W, draw(st.integers(1, W - 1)), 0, start=start)
    if regime == "fewer":
        R = draw(st.integers(W + 1, W + 3))
        return Job(W, R, R - W + draw(st.integers(0, 2)), start=start)
    return Job(W, draw(st.integers(1, W)), draw(st.integers(1, 2)), start=start)


@dataclass(eq=False)
class Push:
    """One gradient: who computed it, at which step, and what became of it."""

    worker: int
    step: int
    fate: str = "pending"        # then "taken" or "dropped", exactly once


@dataclass
class Driver:
    """Workers acting on a StepCoordinator and a ShardAccumulator, checked at every event.

    The model: the global step, the open step's fresh gradients (taken in arrival order
    until R), the step being applied, each worker's state. Every action the coordinator
    returns is checked against what the model allows, and every push's fate against the
    model's rules; the ShardAccumulator must hand back exactly the gradients taken.
    """

    job: Job
    c: StepCoordinator = None
    acc: ShardAccumulator = None
    state: dict = field(default_factory=dict)      # worker -> (status, step held)
    owed: set = field(default_factory=set)         # pushed or loading: a token is owed
    pushes: list = field(default_factory=list)
    step: int = 0                                  # the model's global step
    open_pushes: list = field(default_factory=list)   # fresh pushes the open step took
    grants: int = 0
    applying: tuple | None = None      # (step, pushes, workers) of the DECIDE in flight
    applied_steps: list = field(default_factory=list)
    queue: list = field(default_factory=list)      # async: pushes waiting for their apply
    stopped: bool = False
    shut_down: bool = False
    failed: bool = False
    loads: int = 0
    refused_loads: int = 0
    load_at: int = 0
    last_step: int = 0

    def __post_init__(self):
        j = self.job
        self.c = StepCoordinator(j.W, j.R, j.num_tokens, j.start, j.asynchronous,
                                 j.max_staleness)
        self.acc = ShardAccumulator("mean", j.start, j.asynchronous)
        self.step = j.start
        self.state = {w: (WAITING, None) for w in range(j.W)}
        self.owed = set(range(j.W))
        self.deliver(self.c.start())

    # -- what the coordinator sends ----------------------------------------------------
    def give(self, w: int, step: int, status: str = COMPUTING) -> None:
        assert w in self.owed, f"worker {w} got a token it was not owed"
        assert self.state[w][0] in (WAITING, LOADING), (w, self.state[w])
        self.owed.discard(w)
        self.state[w] = (status, step)

    def deliver(self, actions) -> None:
        for a in actions:
            assert list(a.workers) == sorted(set(a.workers)), a
            handler = getattr(self, f"_on_{a.kind.name.lower()}")
            handler(a)

    def _on_decide(self, a) -> None:
        assert self.applying is None and not self.stopped, a
        assert a.step == self.step, (a, self.step)
        if self.job.asynchronous:
            push = self.queue.pop(0)             # arrival order, whatever step it saw
            taken = [push]
            assert a.taken == tuple(int(w == push.worker) for w in range(self.job.W)), a
        else:
            taken = self.open_pushes
            counts = Counter(p.worker for p in taken)
            assert a.taken == tuple(counts[w] for w in range(self.job.W)), (a, counts)
            assert sum(a.taken) == self.job.R
            if self.job.num_tokens == 0:
                assert max(a.taken) == 1, "a step took two gradients of one worker"
            if self.job.num_tokens == 0 and self.job.R == self.job.W:
                assert a.taken == (1,) * self.job.W, "strict sync takes one from each"
        assert all(p.step == a.step or self.job.asynchronous for p in taken)
        assert set(a.workers) <= self.owed
        self.applying = (a.step, taken, a.workers)
        self.open_pushes = []

    def _on_go(self, a) -> None:
        assert a.step == self.step and self.applying is None, (a, self.step)
        for w in a.workers:
            self.give(w, a.step)
            self._check_bound(w)

    _on_reply = _on_go

    def _on_grant(self, a) -> None:
        assert not self.job.asynchronous and a.step == self.step and self.applying is None
        self.grants += 1
        assert self.grants <= self.job.num_tokens, "more extra gradients than num_tokens"
        (w,) = a.workers
        self.give(w, a.step)

    def _on_stop(self, a) -> None:
        # only when no open worker can ever complete the step and nothing is applied
        assert self.applying is None and not self.job.asynchronous
        assert not self.free_workers() and not self.parked(), "STOP while a worker may push"
        self.stopped = True
        for p in self.open_pushes:
            p.fate = "dropped"
        self.open_pushes = []
        for w in a.workers:
            self.give(w, a.step, STOPPED)

    def _on_load(self, a) -> None:
        open_workers = [w for w in range(self.job.W) if self.state[w][0] != CLOSED]
        assert list(a.workers) == open_workers, (a, self.state)
        assert all(self.state[w][0] == LOADING for w in open_workers)
        self.step = self.load_at                    # every ps loaded the state saved there
        freed = {id(p) for p in self.acc.reset(self.load_at)}
        for p in self.open_pushes:           # computed before the load: dropped
            assert id(p) in freed
            p.fate = "dropped"
        self.open_pushes = []
        self.grants = 0
        self.loads += 1
        self.applied_steps.append("load")
        self.deliver(self.c.loaded(self.load_at))

    def _on_fail(self, a) -> None:
        """No step can complete: the blocked workers wait for workers in a collective."""
        assert self.applying is None and not self.queue
        assert not self.free_workers(), "FAIL while a worker outside the collective is free"
        blocked = {w for w in range(self.job.W) if self.state[w][0] in (WAITING, LOADING)}
        assert set(a.workers) == blocked and blocked, (a, self.state)
        assert set(a.taken) == self.parked(), (a, self.state)
        self.failed = True                 # every worker involved raises DeadlockError

    def _on_shutdown(self, a) -> None:
        assert not self.shut_down and self.applying is None
        assert all(s == CLOSED for s, _ in self.state.values())
        for p in self.open_pushes:
            p.fate = "dropped"
        self.open_pushes = []
        self.shut_down = True

    # -- what the workers do -----------------------------------------------------------
    def free_workers(self) -> list[int]:
        return [w for w, (s, _) in self.state.items() if s == COMPUTING]

    def parked(self) -> set[int]:
        return {w for w, (s, _) in self.state.items() if s == PARKED}

    def push(self, w: int) -> None:
        _, step = self.state[w]
        push = Push(w, step)
        self.pushes.append(push)
        self.state[w] = (WAITING, None)
        self.owed.add(w)
        j = self.job
        fresh = step == self.step and self.applying is None and not self.stopped
        if j.asynchronous:
            self.queue.append(push)
        elif fresh:
            self.open_pushes.append(push)
        else:                                # stale, too late, or after the stop
            push.fate = "dropped"
        item_held = self.acc.offer(w, step, push)
        assert item_held == (j.asynchronous or step >= self.acc.global_step)
        applying = self.applying is not None
        self.deliver(self.c.push(w, step))
        if j.asynchronous and self.applying is None:
            assert not self.queue, "an async gradient waits while nothing is applied"
        if not j.asynchronous and not fresh:
            # a stale gradient never blocks its worker: answered at once with the newest
            # step, or right after the step being applied
            assert (w in self.owed) == applying, (w, self.owed, applying)

    def apply(self) -> None:
        """Every ps applied the step: the accumulator must hold exactly its gradients."""
        step, taken, workers = self.applying
        counts = tuple(sum(p.worker == w for p in taken) for w in range(self.job.W))
        assert self.acc.ready(step, counts)
        chosen = self.acc.chosen(step, counts)
        assert sorted(map(id, chosen)) == sorted(map(id, taken)), "other gradients reduced"
        assert [p.worker for p in chosen] == sorted(p.worker for p in taken)
        freed = self.acc.advance(step, counts)
        ids = {id(p) for p in taken}
        assert ids <= {id(p) for p in freed}
        assert all(p.fate == "dropped" for p in freed if id(p) not in ids)
        for p in taken:
            assert p.fate == "pending", "a gradient taken twice, or taken and dropped"
            p.fate = "taken"
        assert step not in [s for s in self.applied_steps[self._since_load():]], (
            f"step {step} applied twice")
        self.applied_steps.append(step)
        self.applying = None
        self.step = step + 1
        self.grants = 0
        self.deliver(self.c.applied(workers))

    def close(self, w: int) -> None:
        self.state[w] = (CLOSED, None)
        self.deliver(self.c.close(w))

    def load(self, w: int, at: int) -> None:
        try:
            actions = self.c.load(w)
        except RuntimeError as exc:          # the step holds gradients: refused, unchanged
            assert self.open_pushes or self.applying is not None, exc
            self.refused_loads += 1
            return
        assert not self.open_pushes and self.applying is None
        if not any(s == LOADING for s, _ in self.state.values()):
            self.load_at = at
        self.state[w] = (LOADING, None)
        self.owed.add(w)
        self.deliver(actions)

    def park(self, w: int) -> None:
        self.state[w] = (PARKED, self.state[w][1])
        self.deliver(self.c.park(w))

    def collective_done(self) -> None:
        """Every open worker reached the collective: each leaves it."""
        for w in sorted(self.parked()):
            self.state[w] = (COMPUTING, self.state[w][1])
            self.c.unpark(w)

    def _since_load(self) -> int:
        marks = [i for i, s in enumerate(self.applied_steps) if s == "load"]
        return marks[-1] + 1 if marks else 0

    def _check_bound(self, w: int) -> None:
        """Asynchronous with max_staleness=k: no worker computes more than k gradients
        ahead of the slowest open worker."""
        k = self.job.max_staleness
        if k is None:
            return
        taken = Counter(p.worker for p in self.pushes if p.fate == "taken")
        open_workers = [v for v in range(self.job.W) if self.state[v][0] != CLOSED]
        assert taken[w] - min(taken[v] for v in open_workers) <= k, (w, taken)

    # -- checks --------------------------------------------------------------------------
    def check(self) -> None:
        """The invariants after every event; stats() is also what a state request reads."""
        c, stats = self.c, self.c.stats()
        assert c.global_step == self.step
        if self.applied_steps[-1:] != ["load"]:      # only a load moves it back
            assert c.global_step >= self.last_step, "the global step went back"
        self.last_step = c.global_step
        fates = {w: Counter(p.fate for p in self.pushes if p.worker == w)
                 for w in range(self.job.W)}
        for w, f in fates.items():
            assert stats["taken_per_worker"][w] == f["taken"], (w, stats, f)
            assert stats["dropped_per_worker"][w] == f["dropped"], (w, stats, f)
            assert f["taken"] + f["dropped"] + f["pending"] == sum(f.values())
        assert stats["gradients_pending"] == sum(f["pending"] for f in fates.values()), (
            stats, fates)
        assert stats["gradients_applied"] + stats["gradients_dropped"] + \
            stats["gradients_pending"] == len(self.pushes)
        self.check_records(stats)

    def check_records(self, stats: dict) -> None:
        """The per-step records: every push counted once, as taken or as dropped."""
        recorded: Counter = Counter()
        for r in stats["per_step"]:
            for w in r["taken"]:
                recorded[(w, r["step"], "taken")] += 1
            for w in r["dropped"]:
                recorded[(w, r["step"], "dropped")] += 1
        if self.job.asynchronous:
            # each gradient is recorded under the step that applies it, once decided
            assert not any(k[2] == "dropped" for k in recorded)
            assert sum(recorded.values()) == len(self.pushes) - len(self.queue)
            return
        expected = Counter((p.worker, p.step, "dropped" if p.fate == "dropped" else "taken")
                           for p in self.pushes)     # pending ones are recorded as taken
        assert recorded == expected, (recorded, expected)

    def events(self) -> list:
        """What can happen next, given what every worker is doing."""
        out = []
        if self.applying is not None:
            out += [("apply",)] * 4
        open_workers = [w for w, (s, _) in self.state.items() if s != CLOSED]
        parked = self.parked()
        if parked and all(self.state[w][0] == PARKED for w in open_workers):
            out += [("collective",)] * 4
        for w, (s, _) in sorted(self.state.items()):
            if s == COMPUTING:         # mostly pushes; now and then anything else
                out += [("push", w)] * 12 + [("close", w), ("park", w), ("load", w)]
            elif s == STOPPED:
                out.append(("close", w))
        return out

    def run(self, choices: list[int], seed: int = 0, more: int = 0) -> None:
        """``choices`` pick the first events, then ``more`` are picked at random by ``seed``,
        then the job is driven to its end."""
        rng = random.Random(seed)
        for choice in itertools.chain(choices, (rng.randrange(1 << 16) for _ in range(more))):
            if self.shut_down or self.failed:
                return
            events = self.events()
            assert events, self.hang()
            self.act(events[choice % len(events)], choice)
            self.check()
        self.drain()

    def act(self, event: tuple, choice: int) -> None:
        name, *args = event
        if name == "load":
            args.append(choice % (self.step + 2))
        getattr(self, {"collective": "collective_done"}.get(name, name))(*args)

    def drain(self) -> None:
        """End the job: apply, leave collectives, close every worker that can."""
        for _ in range(10_000):
            if self.shut_down or self.failed:
                break
            events = self.events()
            assert events, self.hang()
            kinds = [e[0] for e in events]
            for preferred in ("apply", "collective", "close"):
                if preferred in kinds:
                    self.act(events[kinds.index(preferred)], 0)
                    break
            else:
                self.act(events[0], 0)
            self.check()
        assert self.shut_down or self.failed
        if self.shut_down:
            assert not self.owed, f"pushes never answered: {self.owed}"
            assert all(p.fate in ("taken", "dropped") for p in self.pushes)
            stats = self.c.stats()
            assert stats["gradients_pending"] == 0
            assert stats["gradients_applied"] + stats["gradients_dropped"] == len(self.pushes)
            if not self.job.asynchronous:
                applied = [s for s in self.applied_steps if s != "load"]
                assert stats["gradients_applied"] == self.job.R * len(applied)

    def hang(self) -> str:
        return (f"nothing can happen and the job is not over: {self.job}, global step "
                f"{self.step}, workers {self.state}, owed tokens {sorted(self.owed)}")


@CASES
@given(jobs(), st.lists(st.integers(0, 1 << 16), max_size=50), st.integers(0, 1 << 32),
       st.integers(0, 400))
def test_any_interleaving_keeps_the_protocol(job, choices, seed, more):
    Driver(job).run(choices, seed, more)


# -- a shard accumulator alone: offers at any step, in any order ---------------------------
@st.composite
def offers(draw):
    """Offers by up to 4 workers at steps around the accumulator's, with applies between."""
    events = draw(st.lists(st.one_of(
        st.tuples(st.just("offer"), st.integers(0, 3), st.integers(-2, 3)),
        st.tuples(st.just("apply"), st.lists(st.integers(0, 2), min_size=4, max_size=4))),
        max_size=60))
    return draw(st.integers(0, 5)), events


@CASES
@given(offers())
def test_an_accumulator_hands_back_exactly_what_a_step_names(case):
    """Stale offers are refused and counted; a step reduces the gradients it names, in
    worker order then arrival order; every held gradient is handed back exactly once."""
    start, events = case
    acc = ShardAccumulator("mean", start)
    held: dict[int, dict[int, list]] = {}      # the model: step -> worker -> items in order
    refused, handed_back, step = [], [], start
    for n, event in enumerate(events):
        if event[0] == "offer":
            _, w, delta = event
            item = ("g", n)
            if acc.offer(w, step + delta, item):
                assert delta >= 0, "a stale gradient was held"
                held.setdefault(step + delta, {}).setdefault(w, []).append(item)
            else:
                assert delta < 0
                refused.append(item)
            assert acc.dropped == len(refused)
            continue
        wanted = tuple(event[1])
        mine = held.get(step, {})
        ready = all(len(mine.get(w, [])) >= k for w, k in enumerate(wanted))
        assert acc.ready(step, wanted) == ready
        if not ready:
            continue
        expected = [i for w, k in enumerate(wanted) for i in mine.get(w, [])[:k]]
        assert acc.chosen(step, wanted) == expected
        freed = acc.advance(step, wanted)
        assert sorted(freed) == sorted(i for s_ in held if s_ <= step
                                       for items in held[s_].values() for i in items)
        handed_back += freed
        held = {s_: v for s_, v in held.items() if s_ > step}
        step += 1
        assert acc.global_step == step
    handed_back += acc.reset(step)
    everything = [("g", n) for n, e in enumerate(events) if e[0] == "offer"]
    assert sorted(handed_back + refused) == sorted(everything), "a gradient lost or doubled"


@CASES
@given(st.integers(1, 6), st.sampled_from(REDUCTIONS),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers(0, 1 << 30))
def test_a_reduction_is_the_sum_in_the_given_order(n, reduction, dtype, shape, seed):
    """MEAN and SUM of the chosen gradients, bitwise those of adding them one by one in the
    order given (worker order), then dividing by their number."""
    g = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(shape, generator=g).to(dtype)] for _ in range(n)]
    kept = [[t.clone() for t in grad] for grad in grads]
    out = [torch.empty(shape, dtype=dtype)]
    ShardAccumulator(reduction).reduce(out, grads, n)
    expected = functools.reduce(torch.add, [grad[0] for grad in grads])
    if reduction == "mean" and n > 1:
        expected = expected / n
    assert torch.equal(out[0], expected)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(grads, kept)), "inputs changed"
