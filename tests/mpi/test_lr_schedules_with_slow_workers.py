"""Schedules follow the global step with backup workers and in asynchronous mode.

A schedule of "lr 0.1 for 5 global steps, then 0" applies exactly 5 steps of 0.1, even
when the slow worker's own count of step() calls lags behind (TensorFlow: the learning
rate is a function of the global step when the update is applied). One job (3 workers,
1 ps rank) trains every case, one optimizer after another.
"""
from __future__ import annotations

import sys

import pytest
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
from training_cases import case

MODES = [("backup", 0), ("backup", 2), ("async", 0)]


def name_of(mode: str, slow: int) -> str:
    return f"{mode}-slow-{slow}"


@pytest.fixture(scope="module")
def job() -> dict[str, dict[int, dict]]:
    """``{case: {worker: record}}``."""
    specs = [case(name_of(mode, slow), "--mode", mode, "--slow", slow) for mode, slow in MODES]
    run = run_mpi("schedule_lag.py", 3, 1, [a for s in specs for a in ("--case", s)],
                  timeout=120 + 40 * len(specs))
    return run.assert_every_case_ran([name_of(*m) for m in MODES], 3, lambda name: None)


@pytest.mark.parametrize("mode, slow", MODES)
def test_lr_for_five_global_steps_applies_exactly_five_steps(job, mode, slow):
    workers = job[name_of(mode, slow)]
    by_step: dict[int, list] = {}
    for w in workers.values():
        for step, params in w["seen"]:
            by_step.setdefault(step, []).append(params)
        # every worker's schedule stands at the global step it holds
        for step, lr in w["lrs"]:
            assert lr == (0.1 if step < 5 else 0.0), (step, lr)
    # whoever held the parameters of one global step held the same ones
    for step, copies in by_step.items():
        assert all(c == copies[0] for c in copies), step
    final = by_step[max(by_step)][0]
    assert 5 in by_step and 4 in by_step, sorted(by_step)
    assert by_step[5][0] == final                  # nothing moved after the 5th step ...
    assert by_step[4][0] != by_step[5][0]          # ... and the 5th step did move them
    for step, copies in by_step.items():
        assert (copies[0] == final) == (step >= 5), step
    if mode == "backup":
        assert sum(w["dropped"] for w in workers.values()) > 0 or slow == 2
    assert max(by_step) >= 10
