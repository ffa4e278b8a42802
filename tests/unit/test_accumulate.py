"""One-process tests for mpisync.accumulate: the token barrier's bookkeeping and shard sums."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from mpisync.accumulate import REDUCTIONS, Action, ShardAccumulator, StepCoordinator
from mpisync.protocol.wire import Kind


def decide(step, workers, taken):
    return Action(Kind.DECIDE, step, tuple(workers), tuple(taken))


def token(step, workers):
    return Action(Kind.GO, step, tuple(workers))


def reply(step, workers):
    return Action(Kind.REPLY, step, tuple(workers))


def grant(step, worker):
    return Action(Kind.GRANT, step, (worker,))


def stop(step, workers):
    return Action(Kind.STOP, step, tuple(workers))


def shutdown(step):
    return Action(Kind.SHUTDOWN, step)


def load(step, workers):
    return Action(Kind.LOAD, step, tuple(workers))


def started(num_workers, replicas_to_aggregate, num_tokens=0, global_step=0):
    """A coordinator after start(): every worker holds a token for ``global_step``."""
    c = StepCoordinator(num_workers, replicas_to_aggregate, num_tokens, global_step)
    assert c.start() == [reply(global_step, range(num_workers))]
    return c


# -- constructor (the arguments are validated in mpisync.protocol.spec: tests/unit/test_spec.py) ---
@pytest.mark.parametrize("num_workers, replicas_to_aggregate, num_tokens", [
    (2, 4, 2), (2, 4, 5), (3, 3, 0), (5, 3, 0), (1, 1, 0), (1, 3, 2)])
def test_enough_tokens_are_accepted(num_workers, replicas_to_aggregate, num_tokens):
    c = StepCoordinator(num_workers, replicas_to_aggregate, num_tokens)
    assert (c.num_workers, c.replicas_to_aggregate, c.num_tokens) == (
        num_workers, replicas_to_aggregate, num_tokens)
    assert c.global_step == 0 and not c.applying and not c.stopped


# -- strict sync ---------------------------------------------------------------------------
def test_strict_sync_decides_only_after_every_worker_pushed():
    c = started(3, 3)
    for step in range(6):
        order = [(step + i) % 3 for i in range(3)]  # a different arrival order every step
        assert c.push(order[0], step) == []
        assert c.push(order[1], step) == []
        assert not c.applying and c.num_taken == 2
        assert c.push(order[2], step) == [decide(step, (0, 1, 2), (1, 1, 1))]
        assert c.applying and c.global_step == step  # the step counts only once applied
        assert c.applied((0, 1, 2)) == [token(step + 1, (0, 1, 2))]
        assert c.global_step == step + 1 and not c.applying
    stats = c.stats()
    assert stats["global_step"] == stats["steps"] == 6
    assert stats["gradients_applied"] == 18 and stats["gradients_dropped"] == 0
    assert stats["taken_per_worker"] == [6, 6, 6]
    assert stats["dropped_per_worker"] == [0, 0, 0]
    assert [r["step"] for r in stats["per_step"]] == list(range(6))
    assert stats["per_step"][1] == {"step": 1, "taken": [1, 2, 0], "dropped": []}
    assert stats["stopped"] is False


def test_strict_sync_stale_push_is_dropped_and_answered_at_current_step():
    # A worker restored from an older checkpoint pushes a gradient of step 9 at step 10.
    c = started(3, 3, global_step=10)
    assert c.push(1, 9) == [reply(10, (1,))]
    assert c.num_taken == 0 and not c.applying
    assert c.push(0, 10) == []
    assert c.push(1, 10) == []
    assert c.push(2, 10) == [decide(10, (0, 1, 2), (1, 1, 1))]
    assert c.applied((0, 1, 2)) == [token(11, (0, 1, 2))]
    stats = c.stats()
    assert stats["gradients_dropped"] == 1 and stats["dropped_per_worker"] == [0, 1, 0]
    assert stats["per_step"] == [{"step": 9, "taken": [], "dropped": [1]},
                                 {"step": 10, "taken": [0, 1, 2], "dropped": []}]


def test_extra_token_lets_a_fast_worker_make_a_slow_one_stale():
    # num_tokens=1 with W == R: TensorFlow's run-ahead; worker 2 ends up one step behind.
    c = started(3, 3, num_tokens=1)
    assert c.push(0, 0) == [grant(0, 0)]
    assert c.push(0, 0) == []
    assert c.push(1, 0) == [decide(0, (0, 1), (2, 1, 0))]
    assert c.applied((0, 1)) == [token(1, (0, 1))]
    assert c.push(2, 0) == [reply(1, (2,))]  # stale, answered at once with the new step
    stats = c.stats()
    assert stats["dropped_per_worker"] == [0, 0, 1]
    assert stats["per_step"][0] == {"step": 0, "taken": [0, 0, 1], "dropped": [2]}


# -- backup workers ------------------------------------------------------------------------
@pytest.mark.parametrize("laggard", [0, 1, 2, 3])
def test_backup_workers_take_the_first_fresh_gradients(laggard):
    c = started(4, 3)
    fast = [w for w in range(4) if w != laggard]
    taken = tuple(int(w != laggard) for w in range(4))
    assert c.push(fast[2], 0) == []
    assert c.push(fast[0], 0) == []
    assert c.push(fast[1], 0) == [decide(0, fast, taken)]
    # the laggard's push arrives while the step is being applied: no answer yet
    assert c.push(laggard, 0) == []
    assert c.stats()["dropped_per_worker"][laggard] == 1
    # ... it is answered with the new parameters right after the apply
    assert c.applied(tuple(fast)) == [token(1, fast), reply(1, (laggard,))]
    assert c.computing == {0, 1, 2, 3}

    # step 1: the laggard is back in the race; now worker `slow` is late, after the apply
    slow = (laggard + 1) % 4
    others = [w for w in range(4) if w != slow]
    for w in others[:2]:
        assert c.push(w, 1) == []
    assert c.push(others[2], 1) == [decide(1, others, [int(w != slow) for w in range(4)])]
    assert c.applied(tuple(others)) == [token(2, others)]
    assert c.push(slow, 1) == [reply(2, (slow,))]  # older step: answered immediately

    stats = c.stats()
    assert stats["steps"] == 2
    assert stats["gradients_applied"] == 6 and stats["gradients_dropped"] == 2
    assert stats["per_step"] == [
        {"step": 0, "taken": [fast[2], fast[0], fast[1]], "dropped": [laggard]},
        {"step": 1, "taken": others, "dropped": [slow]},
    ]
    expected_dropped = [0] * 4
    expected_dropped[laggard] += 1
    expected_dropped[slow] += 1
    assert stats["dropped_per_worker"] == expected_dropped
    assert stats["taken_per_worker"] == [2 - d for d in expected_dropped]


def test_backup_workers_several_late_pushes_are_answered_together():
    c = started(5, 2)
    assert c.push(3, 0) == []
    assert c.push(1, 0) == [decide(0, (1, 3), (0, 1, 0, 1, 0))]
    assert c.push(4, 0) == []
    assert c.push(0, 0) == []
    assert c.applied((1, 3)) == [token(1, (1, 3)), reply(1, (0, 4))]
    assert c.push(2, 0) == [reply(1, (2,))]
    assert c.stats()["per_step"][0]["dropped"] == [4, 0, 2]


def test_stale_push_while_a_step_holds_gradients_gets_a_reply():
    c = started(3, 2)
    assert c.push(0, 0) == []
    assert c.push(1, 0) == [decide(0, (0, 1), (1, 1, 0))]
    assert c.applied((0, 1)) == [token(1, (0, 1))]
    assert c.push(0, 1) == []               # step 1 holds one gradient
    assert c.push(2, 0) == [reply(1, (2,))]  # worker 2's old gradient does not count
    assert c.num_taken == 1
    assert c.push(2, 1) == [decide(1, (0, 2), (1, 0, 1))]


# -- fewer workers than gradients ----------------------------------------------------------
@pytest.mark.parametrize("order, taken", [
    ((0, 0, 0, 1), (3, 1)),
    ((0, 1, 0, 1), (2, 2)),
    ((1, 0, 0, 1), (2, 2)),
    ((1, 1, 1, 0), (1, 3)),
])
def test_fewer_workers_than_gradients_grants_the_pool(order, taken):
    c = started(2, 4, num_tokens=2)
    for step in range(3):  # the pool is refilled every step
        assert c.push(order[0], step) == [grant(step, order[0])]
        assert c.push(order[1], step) == [grant(step, order[1])]
        assert c.push(order[2], step) == []  # pool used up: wait for the step
        assert not c.applying and c.num_taken == 3
        assert c.push(order[3], step) == [decide(step, (0, 1), taken)]
        assert c.num_taken == 4
        assert c.applied((0, 1)) == [token(step + 1, (0, 1))]
    stats = c.stats()
    assert stats["taken_per_worker"] == [3 * taken[0], 3 * taken[1]]
    assert stats["gradients_applied"] == 12


def test_one_worker_computes_every_gradient_of_a_step():
    c = started(1, 3, num_tokens=2)
    for step in range(3):
        assert c.push(0, step) == [grant(step, 0)]
        assert c.push(0, step) == [grant(step, 0)]
        assert c.push(0, step) == [decide(step, (0,), (3,))]
        assert c.applied((0,)) == [token(step + 1, (0,))]


def test_granted_gradient_that_misses_the_step_is_stale():
    c = started(2, 2, num_tokens=1)
    assert c.push(0, 0) == [grant(0, 0)]
    assert c.push(1, 0) == [decide(0, (1,), (1, 1))]
    assert c.push(0, 0) == []  # computed on the granted token, arrived while applying
    assert c.applied((1,)) == [token(1, (1,)), reply(1, (0,))]
    assert c.stats()["per_step"][0] == {"step": 0, "taken": [0, 1], "dropped": [0]}


# -- protocol errors -----------------------------------------------------------------------
def test_push_without_a_token_raises():
    c = StepCoordinator(2, 2)
    with pytest.raises(RuntimeError, match="worker 0 pushed without holding a token"):
        c.push(0, 0)  # before start()
    c.start()
    assert c.push(0, 0) == []
    with pytest.raises(RuntimeError, match="worker 0 pushed without holding a token"):
        c.push(0, 0)  # still waiting for its token
    with pytest.raises(RuntimeError, match="without holding a token"):
        c.push(7, 0)  # no such worker


def test_push_ahead_of_global_step_raises():
    c = started(2, 2, global_step=4)
    with pytest.raises(RuntimeError, match=r"worker 1 pushed step 5 ahead of global step 4"):
        c.push(1, 5)


def test_rejected_push_leaves_the_coordinator_unchanged():
    c = started(2, 2, global_step=4)
    with pytest.raises(RuntimeError):
        c.push(1, 5)
    assert c.computing == {0, 1}
    assert c.push(1, 4) == []


def test_applied_without_a_decide_raises():
    c = started(2, 2)
    with pytest.raises(RuntimeError, match=r"applied\(\) without a step being applied"):
        c.applied((0, 1))


# -- load: every open worker asks, then every one gets the loaded step -------------------
def test_load_waits_for_every_open_worker_then_replies_at_the_loaded_step():
    c = started(3, 3, global_step=7)
    assert c.load(2) == []
    assert c.load(0) == []
    assert c.computing == {1}             # the loading workers gave up their tokens
    assert c.load(1) == [load(7, (0, 1, 2))]
    assert c.loaded(3) == [reply(3, (0, 1, 2))]
    assert c.global_step == 3 and c.computing == {0, 1, 2}
    for w in range(3):
        c.push(w, 3)
    assert c.applied((0, 1, 2)) == [token(4, (0, 1, 2))]


def test_a_gradient_cannot_reach_a_step_before_every_worker_loaded():
    """The race of the restore pattern: a fast worker pushes before a slow one loads."""
    c = started(2, 2)
    assert c.load(0) == []
    with pytest.raises(RuntimeError, match="worker 0 pushed without holding a token"):
        c.push(0, 0)                       # it has no token until both loaded
    assert c.load(1) == [load(0, (0, 1))]
    assert c.loaded(0) == [reply(0, (0, 1))]
    assert c.push(0, 0) == []


def test_load_is_refused_once_the_step_holds_gradients():
    c = started(2, 2)
    c.push(0, 0)
    with pytest.raises(RuntimeError, match="worker 1 called load_state_dict\\(\\) while step 0"):
        c.load(1)
    c.push(1, 0)  # decides: applying
    with pytest.raises(RuntimeError, match="while step 0 already holds gradients"):
        c.load(0)


def test_a_close_completes_a_load_the_others_wait_in():
    c = started(3, 3)
    assert c.load(0) == [] and c.load(1) == []
    assert c.close(2) == [load(0, (0, 1))]


# -- close, stop and shutdown --------------------------------------------------------------
def test_last_close_shuts_down():
    c = started(3, 3)
    for w in range(3):
        c.push(w, 0)
    c.applied((0, 1, 2))
    assert c.close(1) == []
    assert c.close(0) == []
    assert c.close(2) == [shutdown(1)]
    assert c.stats()["stopped"] is False


def test_shutdown_waits_for_the_step_being_applied():
    c = started(2, 2)
    c.push(0, 0)
    assert c.push(1, 0) == [decide(0, (0, 1), (1, 1))]
    assert c.close(0) == []
    assert c.close(1) == []  # every worker closed, but a step is being applied
    actions = c.applied((0, 1))
    assert actions[-1] == shutdown(1)
    assert actions.count(shutdown(1)) == 1


def test_close_during_apply_by_a_backup_worker():
    c = started(3, 2)
    c.push(0, 0)
    assert c.push(1, 0) == [decide(0, (0, 1), (1, 1, 0))]
    assert c.close(2) == []
    assert c.applied((0, 1)) == [token(1, (0, 1))]
    c.push(0, 1)
    assert c.push(1, 1) == [decide(1, (0, 1), (1, 1, 0))]
    assert c.applied((0, 1)) == [token(2, (0, 1))]
    assert c.close(0) == []
    assert c.close(1) == [shutdown(2)]


def test_stall_stops_the_waiting_workers():
    c = started(3, 3)
    assert c.push(0, 0) == []
    assert c.push(1, 0) == []
    assert c.close(2) == [stop(0, (0, 1))]  # step 0 can never get 3 gradients
    assert c.stopped and c.stats()["stopped"] is True
    assert c.close(0) == []
    assert c.close(1) == [shutdown(0)]


def test_stall_detected_at_the_last_push():
    c = started(3, 3)
    assert c.close(2) == []  # 0 and 1 still hold tokens
    assert not c.stopped
    assert c.push(1, 0) == []
    assert c.push(0, 0) == [stop(0, (0, 1))]
    assert c.close(0) == []
    assert c.close(1) == [shutdown(0)]


def test_no_stall_while_the_pool_lets_one_worker_finish_the_step():
    c = started(2, 2, num_tokens=1)
    assert c.push(0, 0) == [grant(0, 0)]
    assert c.close(1) == []
    assert not c.stopped
    assert c.push(0, 0) == [decide(0, (0,), (2, 0))]


def test_stall_with_grants_outstanding_waits_for_them():
    c = started(2, 4, num_tokens=2)
    assert c.push(0, 0) == [grant(0, 0)]
    assert c.push(1, 0) == [grant(0, 1)]
    assert c.push(0, 0) == []
    assert c.close(1) == [stop(0, (0,))]  # 3 gradients, nobody left to compute a 4th


def test_after_a_stall_no_worker_holds_a_token():
    c = started(3, 3)
    c.push(0, 0)
    c.push(1, 0)
    c.close(2)
    assert c.computing == set()
    for w in range(3):
        with pytest.raises(RuntimeError, match="without holding a token"):
            c.push(w, 0)


def test_push_after_stop_is_answered_with_stop_and_dropped():
    # After a stall no worker holds a token through the public events (see the test
    # above), so this branch of push() is reached here by handing worker 2 a token by hand.
    c = started(4, 4)
    c.push(0, 0)
    c.push(1, 0)
    c.close(3)
    assert c.push(2, 0) == [stop(0, (0, 1, 2))]
    before = c.stats()
    c.computing.add(2)
    assert c.push(2, 0) == [stop(0, (2,))]
    after = c.stats()
    assert after["gradients_dropped"] == before["gradients_dropped"] + 1
    assert after["dropped_per_worker"][2] == before["dropped_per_worker"][2] + 1
    assert after["gradients_applied"] == before["gradients_applied"]
    assert after["per_step"][0]["dropped"][-1] == 2


def test_stopped_step_gradients_are_not_reported_as_applied():
    # W=3, R=3: workers 0 and 1 push step 0, worker 2 closes -> stop. Step 0 never runs,
    # so its two gradients count as dropped, not applied (gradients_applied == R * steps).
    c = started(3, 3)
    c.push(0, 0)
    c.push(1, 0)
    assert c.close(2) == [stop(0, (0, 1))]
    stats = c.stats()
    assert stats["steps"] == 0
    assert stats["gradients_applied"] == 0 and stats["gradients_dropped"] == 2
    assert stats["taken_per_worker"] == [0, 0, 0]
    assert stats["dropped_per_worker"] == [1, 1, 0]
    assert stats["per_step"] == [{"step": 0, "taken": [], "dropped": [0, 1]}]


def test_stopped_step_after_applied_steps_keeps_their_counts():
    c = started(2, 2)
    for step in range(3):
        c.push(0, step)
        c.push(1, step)
        c.applied((0, 1))
    c.push(1, 3)
    assert c.close(0) == [stop(3, (1,))]
    stats = c.stats()
    assert stats["steps"] == 3
    assert stats["gradients_applied"] == 6 and stats["gradients_dropped"] == 1
    assert stats["taken_per_worker"] == [3, 3] and stats["dropped_per_worker"] == [0, 1]
    assert stats["per_step"][3] == {"step": 3, "taken": [], "dropped": [1]}


def test_unfinished_step_gradients_are_not_reported_as_applied_at_shutdown():
    c = started(2, 2, num_tokens=1)
    assert c.push(0, 0) == [grant(0, 0)]
    assert c.close(0) == []
    assert c.close(1) == [shutdown(0)]
    stats = c.stats()
    assert stats["steps"] == 0
    assert stats["gradients_applied"] == 0
    assert stats["gradients_applied"] + stats["gradients_dropped"] == 1
    assert stats["taken_per_worker"] == [0, 0]


# -- randomized simulation -----------------------------------------------------------------
class _Simulation:
    """Workers that hold at most one token, driven at random against a coordinator.

    The model predicts which pushes a step takes (the first R fresh ones) and checks every
    action against what the workers can legitimately receive.
    """

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.W = self.rng.randint(1, 5)
        self.R = self.rng.randint(1, self.W + 2)
        self.num_tokens = max(0, self.R - self.W) + self.rng.choice([0, 0, 1, 2])
        self.target_steps = self.rng.randint(40, 120)
        self.c = StepCoordinator(self.W, self.R, self.num_tokens)
        self.holds: dict[int, int] = {}  # worker -> step of the token it holds
        self.told_to_stop: set[int] = set()
        self.closed: set[int] = set()
        self.step = 0                    # the model's global step
        self.pending = None              # the decide being applied
        self.expected_taken = [0] * self.W
        self.grants = 0
        self.late: set[int] = set()
        self.pushes = 0
        self.applied_steps = 0
        self.stopped = False
        self.shut_down = False
        self.loads = 0
        self.owed = set(range(self.W))   # pushed (or loaded) and not answered yet;
        #                                  start() answers every worker
        self.deliver(self.c.start())

    # -- what the workers receive ----------------------------------------------------------
    def give(self, w: int, step: int) -> None:
        assert w not in self.holds, f"worker {w} got a second token without pushing"
        assert w in self.owed, f"worker {w} got a token it did not ask for"
        assert w not in self.closed
        self.owed.discard(w)
        self.holds[w] = step

    def deliver(self, actions: list) -> None:
        for a in actions:
            assert a.workers == tuple(sorted(set(a.workers))), a
            if a.kind == Kind.DECIDE:
                assert self.pending is None and not self.stopped
                assert a.step == self.step == self.c.global_step
                assert a.taken == tuple(self.expected_taken)
                assert sum(a.taken) == self.R
                if self.num_tokens == 0:
                    assert max(a.taken) <= 1
                assert set(a.workers) <= self.owed
                self.pending = a
            elif a.kind in (Kind.GO, Kind.REPLY):
                assert a.step == self.step == self.c.global_step
                for w in a.workers:
                    self.give(w, a.step)
            elif a.kind == Kind.GRANT:
                assert a.step == self.step and self.pending is None
                self.grants += 1
                assert self.grants <= self.num_tokens
                (w,) = a.workers
                self.give(w, a.step)
            elif a.kind == Kind.STOP:
                # only when no open worker can push again and nothing is being applied
                assert not self.holds and self.pending is None, (self.holds, self.pending)
                self.stopped = True
                for w in a.workers:
                    assert w in self.owed
                    self.owed.discard(w)
                    self.told_to_stop.add(w)
            elif a.kind == Kind.SHUTDOWN:
                assert not self.shut_down
                assert self.closed == set(range(self.W)) and self.pending is None
                self.shut_down = True
            else:
                raise AssertionError(f"unknown action {a}")

    # -- what the workers do ---------------------------------------------------------------
    def push(self, w: int) -> None:
        step = self.holds.pop(w)
        self.owed.add(w)
        self.pushes += 1
        fresh = step == self.step and self.pending is None and not self.stopped
        actions = self.c.push(w, step)
        if fresh:
            self.expected_taken[w] += 1
            if sum(self.expected_taken) == self.R:
                assert [a.kind for a in actions] == [Kind.DECIDE], actions
                assert w in actions[0].workers
            else:
                assert Kind.DECIDE not in [a.kind for a in actions]
                if self.grants < self.num_tokens:
                    assert actions == [grant(self.step, w)]
        elif self.pending is not None:
            assert actions == []  # late: answered after the apply
            self.late.add(w)
        else:
            assert actions == [reply(self.step, (w,))]
        self.deliver(actions)

    def apply(self) -> None:
        decided, self.pending = self.pending, None
        actions = self.c.applied(decided.workers)
        self.applied_steps += 1
        self.step += 1
        self.expected_taken = [0] * self.W
        self.grants = 0
        expected = [token(self.step, decided.workers)]
        if self.late:
            expected.append(reply(self.step, sorted(self.late)))
        self.late = set()
        assert actions[:len(expected)] == expected
        self.deliver(actions)

    def close(self, w: int) -> None:
        self.holds.pop(w, None)
        self.told_to_stop.discard(w)
        self.closed.add(w)
        self.deliver(self.c.close(w))

    def load(self) -> None:
        """Every open worker loads a state at the same point (none has pushed)."""
        open_workers = sorted(set(range(self.W)) - self.closed)
        for i, w in enumerate(open_workers):
            self.holds.pop(w, None)
            self.told_to_stop.discard(w)
            actions = self.c.load(w)
            if i < len(open_workers) - 1:
                assert actions == []
        assert actions == [load(self.step, open_workers)]
        self.loads += 1
        self.owed.update(open_workers)
        self.deliver(self.c.loaded(self.step))

    # -- driving ---------------------------------------------------------------------------
    def run(self) -> None:
        rng = self.rng
        for _ in range(200_000):
            if self.shut_down:
                break
            # never deadlocked: someone can act, or the job is over
            assert self.holds or self.pending is not None or self.told_to_stop, (
                f"deadlock: W={self.W} R={self.R} num_tokens={self.num_tokens} "
                f"step={self.step} owed={self.owed} closed={self.closed}")
            holders = sorted(self.holds)
            ending = self.applied_steps >= self.target_steps
            if self.pending is not None and (not holders or rng.random() < 0.3):
                self.apply()
            elif holders:
                w = rng.choice(holders)
                if ending and rng.random() < 0.3:
                    self.close(w)
                elif (self.pending is None and not any(self.expected_taken)
                      and not self.stopped and len(holders) == self.W - len(self.closed)
                      and rng.random() < 0.02):
                    self.load()
                else:
                    self.push(w)
            else:
                self.close(rng.choice(sorted(self.told_to_stop)))
            self.check_totals()
        assert self.shut_down, "the simulation did not finish"
        assert not self.owed, f"pushes never answered: {self.owed}"
        assert self.applied_steps >= self.target_steps or self.stopped

    def check_totals(self) -> None:
        c = self.c
        assert c.global_step == self.applied_steps == self.step
        assert sum(c.taken_total) + sum(c.dropped_total) == self.pushes

    def check_records(self) -> None:
        stats = self.c.stats()
        assert stats["gradients_applied"] + stats["gradients_dropped"] == self.pushes
        # a step that could not complete applied nothing
        assert stats["gradients_applied"] == self.R * self.applied_steps
        records = {r["step"]: r for r in stats["per_step"]}
        for step in range(self.applied_steps):
            assert len(records[step]["taken"]) == self.R
            if self.num_tokens == 0:
                assert len(set(records[step]["taken"])) == self.R


@pytest.mark.parametrize("seed", range(40))
def test_randomized_simulation_keeps_the_invariants(seed):
    sim = _Simulation(seed)
    sim.run()
    sim.check_records()


def test_randomized_simulation_covers_every_regime():
    sims = list(map(_Simulation, range(40)))
    shapes = {(s.W > s.R, s.W == s.R, s.W < s.R) for s in sims}
    assert shapes == {(True, False, False), (False, True, False), (False, False, True)}
    for sim in sims:
        sim.run()
    assert sum(s.loads for s in sims) > 10      # collective loads happen along the way


# -- ShardAccumulator ----------------------------------------------------------------------
def test_offer_refuses_stale_steps_and_holds_future_ones():
    acc = ShardAccumulator(global_step=3)
    assert acc.offer(0, 2, "old") is False
    assert acc.offer(1, 0, "older") is False
    assert acc.dropped == 2
    assert acc.offer(0, 3, "now") is True
    assert acc.offer(1, 5, "future") is True
    assert acc.dropped == 2
    assert acc.ready(3, (1, 0))
    assert acc.ready(5, (0, 1))
    assert not acc.ready(4, (0, 1))


def test_ready_only_when_every_named_gradient_arrived():
    acc = ShardAccumulator()
    taken = (2, 0, 1)
    assert not acc.ready(0, taken)
    acc.offer(0, 0, "a")
    acc.offer(1, 0, "x")  # not named by taken
    assert not acc.ready(0, taken)
    acc.offer(2, 0, "b")
    assert not acc.ready(0, taken)  # worker 0 owes a second gradient
    acc.offer(0, 1, "next step")  # a later step does not count
    assert not acc.ready(0, taken)
    acc.offer(0, 0, "c")
    assert acc.ready(0, taken)
    assert acc.ready(0, (0, 0, 0))


def test_chosen_is_in_worker_then_arrival_order():
    acc = ShardAccumulator()
    for worker, item in [(2, "w2a"), (0, "w0a"), (3, "w3a"), (0, "w0b"), (2, "w2b"),
                         (0, "w0c"), (1, "w1a")]:
        acc.offer(worker, 7, item)
    assert acc.chosen(7, (2, 0, 1, 1)) == ["w0a", "w0b", "w2a", "w3a"]
    assert acc.chosen(7, (3, 1, 2, 0)) == ["w0a", "w0b", "w0c", "w1a", "w2a", "w2b"]


def test_chosen_does_not_depend_on_arrival_interleaving():
    items = [(w, f"w{w}-{k}") for w in range(4) for k in range(2)]
    taken = (1, 2, 0, 1)
    results = set()
    rng = random.Random(1)
    for _ in range(20):
        acc = ShardAccumulator()
        # interleave workers at random, keeping each worker's own order (as MPI does)
        queues = {w: [i for ww, i in items if ww == w] for w in range(4)}
        seq = []
        while any(queues.values()):
            w = rng.choice([w for w, q in queues.items() if q])
            seq.append((w, queues[w].pop(0)))
        for w, item in seq:
            acc.offer(w, 0, item)
        results.add(tuple(acc.chosen(0, taken)))
    assert results == {("w0-0", "w1-0", "w1-1", "w3-0")}


def test_advance_frees_everything_up_to_the_step():
    acc = ShardAccumulator()
    acc.offer(0, 0, "s0w0")
    acc.offer(1, 0, "s0w1")
    acc.offer(0, 1, "s1w0")
    acc.offer(1, 2, "s2w1")
    freed = acc.advance(1)
    assert sorted(freed) == ["s0w0", "s0w1", "s1w0"]
    assert acc.global_step == 2
    assert acc.offer(0, 1, "late") is False and acc.dropped == 1
    assert acc.ready(2, (0, 1)) and acc.chosen(2, (0, 1)) == ["s2w1"]
    assert acc.advance(2) == ["s2w1"]
    assert acc.advance(3) == []
    assert acc.global_step == 4


def _gradients(n: int, seed: int):
    """n gradients, each two dtype regions (float32 and float64)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(37, generator=g, dtype=torch.float32),
             torch.randn(5, 3, generator=g, dtype=torch.float64)] for _ in range(n)]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reduce_matches_torch_exactly(reduction, n):
    acc = ShardAccumulator(reduction)
    grads = _gradients(n, seed=n)
    originals = [[t.clone() for t in g] for g in grads]
    out = [torch.empty(37, dtype=torch.float32), torch.empty(5, 3, dtype=torch.float64)]
    acc.reduce(out, grads, n)
    for r in range(2):
        stacked = torch.stack([g[r] for g in grads])
        expected = stacked.mean(0) if reduction == "mean" else stacked.sum(0)
        assert torch.equal(out[r], expected), (reduction, n, r)
        assert out[r].dtype == expected.dtype
    for g, o in zip(grads, originals):  # the inputs are the caller's: left untouched
        assert all(torch.equal(a, b) for a, b in zip(g, o))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reduce_many_gradients_sums_in_the_given_order(reduction):
    n = 7
    acc = ShardAccumulator(reduction)
    grads = _gradients(n, seed=11)
    out = [torch.empty(37, dtype=torch.float32), torch.empty(5, 3, dtype=torch.float64)]
    acc.reduce(out, grads, n)
    for r in range(2):
        expected = functools.reduce(torch.add, [g[r] for g in grads])
        if reduction == "mean":
            expected = expected / n
        assert torch.equal(out[r], expected)
        stacked = torch.stack([g[r] for g in grads])
        assert torch.allclose(out[r], stacked.mean(0) if reduction == "mean"
                              else stacked.sum(0))


def test_reduce_mean_divides_by_count():
    acc = ShardAccumulator("mean")
    grads = [[torch.tensor([2.0, 4.0])], [torch.tensor([6.0, 8.0])]]
    out = [torch.empty(2)]
    acc.reduce(out, grads, 4)
    assert torch.equal(out[0], torch.tensor([2.0, 3.0]))
    ShardAccumulator("sum").reduce(out, grads, 4)
    assert torch.equal(out[0], torch.tensor([8.0, 12.0]))


def test_reduce_of_chosen_is_independent_of_offer_order():
    grads = {w: _gradients(2, seed=100 + w) for w in range(3)}
    taken = (2, 1, 1)
    order_in = [g for w in range(3) for g in grads[w][:taken[w]]]
    results = []
    for offer_order in ([(2, 0), (0, 0), (1, 0), (0, 1), (2, 1), (1, 1)],
                        [(1, 0), (1, 1), (0, 0), (2, 0), (2, 1), (0, 1)]):
        acc = ShardAccumulator("mean")
        for w, k in offer_order:
            acc.offer(w, 0, grads[w][k])
        assert acc.ready(0, taken)
        chosen = acc.chosen(0, taken)
        assert all(c is e for c, e in zip(chosen, order_in))
        out = [torch.empty(37), torch.empty(5, 3, dtype=torch.float64)]
        acc.reduce(out, chosen, len(chosen))
        for r in range(2):
            assert torch.equal(out[r], torch.stack([g[r] for g in order_in]).mean(0))
        results.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*results))


# -- asynchronous mode ---------------------------------------------------------------------
def async_started(num_workers, max_staleness=None):
    c = StepCoordinator(num_workers, 1, 0, 0, asynchronous=True, max_staleness=max_staleness)
    assert c.start() == [reply(0, range(num_workers))]
    return c


def one_hot(worker, n):
    return tuple(int(w == worker) for w in range(n))


def test_async_applies_each_gradient_alone_in_arrival_order():
    c = async_started(3)
    assert c.push(2, 0) == [decide(0, [2], one_hot(2, 3))]
    assert c.push(0, 0) == []                     # queued behind the step being applied
    assert c.push(1, 0) == []
    assert c.applied((2,)) == [token(1, [2]), decide(1, [0], one_hot(0, 3))]
    assert c.applied((0,)) == [token(2, [0]), decide(2, [1], one_hot(1, 3))]
    assert c.push(2, 1) == []                     # stale by 2 steps: applied, not dropped
    assert c.applied((1,)) == [token(3, [1]), decide(3, [2], one_hot(2, 3))]
    assert c.applied((2,)) == [token(4, [2])]
    st = c.stats()
    assert [r["taken"] for r in st["per_step"]] == [[2], [0], [1], [2]]
    assert st["gradients_applied"] == 4 and st["gradients_dropped"] == 0
    assert c.computing == {0, 1, 2}


def test_async_bounded_staleness_holds_the_fast_worker_until_the_slowest_catches_up():
    c = async_started(2, max_staleness=1)
    assert c.push(0, 0) == [decide(0, [0], (1, 0))]       # worker 0 is 1 ahead: allowed
    assert c.applied((0,)) == [token(1, [0])]
    assert c.push(0, 1) == [decide(1, [], (1, 0))]        # 2 ahead: no parameters, no token
    assert c.applied(()) == []
    assert c.held == {0} and c.computing == {1}
    assert c.push(1, 0) == [decide(2, [1], (0, 1))]       # the slowest pushes a stale one
    assert c.applied((1,)) == [token(3, [1]), reply(3, [0])]   # 2 - 1 <= 1: released
    assert c.held == set() and c.computing == {0, 1}


def test_async_bound_with_zero_staleness_is_lock_step():
    c = async_started(2, max_staleness=0)
    assert c.push(1, 0) == [decide(0, [], (0, 1))]
    assert c.applied(()) == []
    assert c.push(0, 0) == [decide(1, [0], (1, 0))]
    assert c.applied((0,)) == [token(2, [0]), reply(2, [1])]


def test_async_close_of_the_slowest_releases_the_held():
    c = async_started(2, max_staleness=0)
    c.push(0, 0)
    c.applied(())
    assert c.held == {0}
    assert c.close(1) == [reply(1, [0])]
    c.push(0, 1)
    assert c.applied((0,)) == [token(2, [0])]             # alone now: never held
    assert c.close(0) == [shutdown(2)]


def test_async_accumulator_takes_the_oldest_gradient_of_each_worker():
    acc = ShardAccumulator("mean", global_step=5, asynchronous=True)
    assert acc.offer(1, 2, "w1-old")                       # stale: still held
    assert acc.offer(0, 5, "w0")
    assert acc.offer(1, 5, "w1-new")
    assert not acc.ready(5, (0, 0, 1))
    assert acc.ready(5, (1, 0, 0)) and acc.ready(5, (0, 1, 0))
    assert acc.chosen(5, (0, 1, 0)) == ["w1-old"]
    assert acc.advance(5, (0, 1, 0)) == ["w1-old"]
    assert acc.chosen(6, (0, 1, 0)) == ["w1-new"]
    assert acc.advance(6, (0, 1, 0)) == ["w1-new"]
    assert acc.advance(7, (1, 0, 0)) == ["w0"]
    assert not acc.ready(8, (1, 0, 0))


# -- collectives among the workers: parked workers push nothing ---------------------------
def test_a_step_that_only_parked_workers_could_complete_fails():
    c = started(2, 2)
    assert c.push(1, 0) == []
    assert c.park(0) == [Action(Kind.FAIL, 0, (1,), (0,))]
    assert c.park(0) == []                    # said once


def test_parking_is_harmless_when_every_worker_meets():
    c = started(2, 2)
    assert c.park(0) == [] and c.park(1) == []
    c.unpark(0)
    c.unpark(1)
    assert c.push(0, 0) == [] and c.push(1, 0) == [decide(0, (0, 1), (1, 1))]


def test_backup_workers_complete_steps_while_one_is_parked():
    c = started(3, 2)
    assert c.park(0) == []
    assert c.push(1, 0) == []
    assert c.push(2, 0) == [decide(0, (1, 2), (0, 1, 1))]
    assert c.applied((1, 2)) == [token(1, (1, 2))]
    assert c.push(1, 1) == []
    assert c.park(2) == [Action(Kind.FAIL, 1, (1,), (0, 2))]


def test_a_collective_that_a_departed_worker_can_never_join_fails():
    """Worker 1 closed and left the job (its program ended) while worker 0 is, or later
    goes, into a collective among the workers: that can never complete."""
    c = started(2, 2)
    c.close(1)
    assert c.park(0) == []                     # closed, still here: it may join
    assert c.depart(1) == [Action(Kind.FAIL, 0, (), (0,))]
    assert c.depart(1) == []                   # said once
    c.unpark(0)                                # it was not in it after all
    assert c.park(0) == [Action(Kind.FAIL, 0, (), (0,))]   # any later one fails
    d = started(2, 2)
    d.close(1)
    assert d.depart(1) == [] and d.park(0) == [Action(Kind.FAIL, 0, (), (0,))]
    e = started(2, 2)
    assert e.park(0) == [] and e.park(1) == []          # both in one: they meet
    assert e.depart(1) == []                             # ... itself parked: not departed


def test_a_worker_that_goes_into_a_collective_after_one_told_left_is_told_too():
    """Worker 1 left; worker 2 went into a collective, was told it can never complete and
    left too; worker 0 goes into it later: it is told as well (it used to wait until
    MPISYNC_TIMEOUT, the verdict said once for the job)."""
    c = started(3, 3)
    c.close(1)
    assert c.depart(1) == []
    assert c.park(2) == [Action(Kind.FAIL, 0, (), (2,))]
    c.close(2)
    assert c.depart(2) == []                   # it left with its DeadlockError
    assert c.park(0) == [Action(Kind.FAIL, 0, (), (0,))]
    assert c.park(0) == []                     # said once


def test_a_held_async_worker_waiting_for_a_parked_one_fails():
    c = async_started(2, max_staleness=0)
    c.push(1, 0)
    c.applied(())                              # worker 1 is held: 0 must catch up first
    assert c.held == {1}
    assert c.park(0) == [Action(Kind.FAIL, 1, (1,), (0,))]


# -- sparse rows ----------------------------------------------------------------------------
def _rows(ids, values):
    return torch.tensor(ids), torch.tensor(values, dtype=torch.float64).view(len(ids), 2)


@pytest.mark.parametrize("how", ["mean", "per_row", "sum"])
def test_row_gradients_reduce_as_documented(how):
    from mpisync.accumulate import reduce_rows

    a = _rows([4, 1], [1, 2, 3, 4])          # worker 0: rows 4 and 1
    b = _rows([1, 0], [10, 20, 30, 40])      # worker 1: rows 1 and 0
    got = reduce_rows([a, b], (6, 2), count=3, how=how).to_dense()   # a third had no rows
    dense = torch.zeros(6, 2, dtype=torch.float64)
    for ids, values in (a, b):
        for i, row in zip(ids.tolist(), values):
            dense[i] += row
    divisor = {"mean": torch.full((6, 1), 3.0), "sum": torch.ones(6, 1),
               "per_row": torch.tensor([[1.0], [2], [1], [1], [1], [1]])}[how]
    assert torch.equal(got, dense / divisor)
    assert got[1].tolist() == {"mean": [13 / 3, 24 / 3], "sum": [13, 24],
                               "per_row": [6.5, 12.0]}[how]


def test_row_gradients_of_one_push_are_not_divided():
    from mpisync.accumulate import reduce_rows

    got = reduce_rows([_rows([2], [1, 2])], (3, 2), count=1, how="mean")
    assert got.is_coalesced() and got.to_dense()[2].tolist() == [1, 2]


# -- found by the property tests (tests/unit/test_protocol_properties.py) ------------------
def test_async_gradients_queued_behind_an_apply_count_as_pending():
    c = async_started(3)
    c.push(0, 0)                              # applied alone: DECIDE
    c.push(1, 0)
    c.push(2, 0)                              # both queued behind it
    st = c.stats()
    assert st["gradients_pending"] == 3 and st["gradients_applied"] == 0
    c.applied((0,))
    assert c.stats()["gradients_pending"] == 2
    assert c.stats()["gradients_applied"] == 1


def test_a_load_on_some_workers_only_fails_instead_of_waiting_forever():
    """Worker 0 loads; worker 1 went on and waits inside step() for worker 0's gradient."""
    c = started(2, 2)
    assert c.load(0) == []
    assert c.push(1, 0) == [Action(Kind.FAIL, 0, (0, 1), ())]
    assert c.deadlocked()
    c = started(2, 2)
    assert c.push(1, 0) == []
    with pytest.raises(RuntimeError, match="already holds gradients"):   # the other order
        c.load(0)


def test_a_load_with_a_backup_worker_to_spare_is_no_deadlock():
    c = started(3, 2)
    assert c.load(0) == []
    assert c.push(1, 0) == []
    assert c.push(2, 0) == [decide(0, (1, 2), (0, 1, 1))]     # the step completes
    assert not c.deadlocked()


def test_gradients_a_step_took_before_a_load_completed_are_dropped():
    """A worker computes a granted gradient, then closes, which completes a load."""
    c = started(2, 3, num_tokens=1, global_step=1)
    assert c.load(0) == []
    assert c.push(1, 1) == [grant(1, 1)]
    assert c.close(1) == [load(1, (0,))]
    assert c.loaded(5) == [reply(5, (0,))]
    assert c.num_taken == 0 and c.pool == 1
    st = c.stats()
    assert st["gradients_pending"] == 0 and st["dropped_per_worker"] == [0, 1]
    assert st["per_step"] == [{"step": 1, "taken": [], "dropped": [1]}]


def test_a_step_applied_again_after_a_restore_keeps_its_first_record():
    c = started(1, 2, num_tokens=1)
    c.push(0, 0)
    c.push(0, 0)
    c.applied((0,))                           # step 0 took two gradients
    assert c.load(0) == [load(1, (0,))]
    c.loaded(0)                               # restored to step 0
    c.push(0, 0)                              # granted, then the job ends
    assert c.close(0) == [shutdown(0)]
    assert c.stats()["per_step"] == [{"step": 0, "taken": [0, 0], "dropped": [0]}]


def test_reset_hands_back_everything_held():
    acc = ShardAccumulator(global_step=3)
    for w, step in [(0, 3), (1, 4), (0, 3)]:
        acc.offer(w, step, (w, step))
    assert sorted(acc.reset(1)) == [(0, 3), (0, 3), (1, 4)]
    assert acc.global_step == 1 and not acc.ready(3, (1, 0))
    fifo = ShardAccumulator(asynchronous=True)
    fifo.offer(1, 0, "a")
    assert fifo.reset(0) == ["a"] and fifo.chosen(0, (0, 1)) == []


def test_after_a_fail_the_loading_hold_their_tokens_and_the_others_get_nothing_more():
    c = started(2, 2)
    c.load(0)
    c.push(1, 0)                               # FAIL: worker 0's load cannot complete
    c.fail_sent()
    assert c.computing == {0} and not c.loading and not c.waiting
    assert c.close(0) == []                    # no STOP for worker 1: FAIL answered it
    assert c.close(1) == [shutdown(0)]
    assert c.stats()["dropped_per_worker"] == [0, 1]
