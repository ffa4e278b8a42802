"""Backup workers, fewer workers than gradients, and clean ends with a laggard mid-step."""
from __future__ import annotations

import re

import pytest
from mpi_helpers import run_mpi

# also run under Open MPI (make test-openmpi)
pytestmark = pytest.mark.openmpi


def per_step(run) -> dict[int, dict]:
    (ps,) = run.ps()
    return {r["step"]: r for r in ps["stats"]["per_step"]}


@pytest.mark.parametrize("laggard", [0, 2], ids=["chief-sleeps", "worker-sleeps"])
def test_backup_workers_leave_a_laggard_behind_without_waiting(laggard):
    # the chief also reads the consolidated state while the others keep stepping
    run = run_mpi("backup.py", 4, 1, ["--replicas", 3, "--laggard", laggard,
                                      "--sleep-at", 3, "--sleep", 2.0, "--after", 10,
                                      "--state-every", 2])
    workers = run.by_worker()
    assert sorted(workers) == [0, 1, 2, 3]
    steps = per_step(run)
    slow = workers[laggard]["pushes"]
    computed_at, answered_with = slow[3]      # the push made after sleeping
    # the others kept completing steps while it slept, without its gradient
    assert answered_with > computed_at + 1
    for s in range(computed_at + 1, answered_with):
        assert laggard not in steps[s]["taken"], s
        assert len(steps[s]["taken"]) == 3
    # its late gradient was dropped and counted, nothing was lost silently
    assert laggard in steps[computed_at]["dropped"]
    (ps,) = run.ps()
    assert ps["stats"]["dropped_per_worker"][laggard] >= 1
    # it did not stay behind: the next gradient was computed at the step it was handed
    assert slow[4][0] == answered_with
    assert all(later[0] >= answered_with for later in slow[4:])
    # every step took exactly replicas_to_aggregate gradients from distinct workers
    for rec in steps.values():
        if rec["step"] < ps["stats"]["global_step"]:
            assert len(rec["taken"]) == 3 and len(set(rec["taken"])) == 3
    # taken + dropped accounts for every push of every worker
    pushes = sum(len(w["pushes"]) for w in workers.values())
    st = ps["stats"]
    assert st["gradients_applied"] + st["gradients_dropped"] == pushes
    assert st["gradients_applied"] == 3 * st["global_step"]
    # while training, only the gradients of applied steps count as applied
    for w in workers.values():
        for applied, global_step, pending in w["seen_stats"]:
            assert applied == 3 * global_step and 0 <= pending <= 3
    # after close every worker holds the job's final statistics, as ps 0 reports them
    for w in workers.values():
        assert w["final"] == {k: v for k, v in st.items() if k != "per_step"}


def test_fewer_workers_than_gradients_with_enough_tokens():
    run = run_mpi("backup.py", 2, 1, ["--replicas", 4, "--num-tokens", 2, "--steps", 15])
    (ps,) = run.ps()
    applied = [r for r in ps["stats"]["per_step"] if r["step"] < ps["stats"]["global_step"]]
    assert len(applied) >= 15
    for rec in applied:
        assert len(rec["taken"]) == 4, rec      # each step averaged 4 gradients
        assert set(rec["taken"]) <= {0, 1}
    # both workers computed several batches on the same parameters
    for w in run.by_worker().values():
        assert sum(1 for before, after in w["pushes"] if before == after) > 0


def test_too_few_tokens_is_a_clear_error_on_every_rank():
    run = run_mpi("backup.py", 2, 1, ["--replicas", 4, "--num-tokens", 1], timeout=60,
                  expect_ok=False)
    assert run.returncode != 0
    for who in ("worker 0 (rank 0", "worker 1 (rank 1", "ps 0 (rank 2"):
        assert re.search(re.escape(who) + r".*ConfigError: .*num_tokens=1 is too few", run.output), (
            who, run.output)
