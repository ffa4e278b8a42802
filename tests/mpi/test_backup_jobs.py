"""Backup workers, fewer workers than gradients, and clean ends with a laggard mid-step.

Two jobs: 4 workers with 3 replicas to aggregate, the chief asleep for 2 s in one case and
another worker in the next; 2 workers with 4 gradients a step, with enough tokens and then
with too few (refused on every rank, the job goes on; its message is tested in one
process: tests/unit/test_backup.py).
"""
from __future__ import annotations

import re
import sys

import pytest
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
from training_cases import case, ps_by_case

# also run under Open MPI (make test-openmpi)
pytestmark = pytest.mark.openmpi

#: laggard: the worker that sleeps 2 s before its 4th push
LAGGARDS = {"chief-sleeps": 0, "worker-sleeps": 2}
TOO_FEW = "ConfigError: .*num_tokens=1 is too few"


def run_cases(workers: int, specs: list[str], refused: int = 0, timeout_each: float = 30):
    """The job of these cases, the last ``refused`` of them refused at set-up (the ps rank
    serves no optimizer for them): its run, ``{case: {worker: record}}``, ``{case: [ps
    record]}``."""
    run = run_mpi("backup.py", workers, 1, [a for s in specs for a in ("--case", s)],
                  timeout=120 + timeout_each * len(specs))
    names = [s.partition(":")[0] for s in specs]
    return run, run.assert_every_case_ran(names, workers, lambda name: None), ps_by_case(
        run.ps(), names[:len(names) - refused])


@pytest.fixture(scope="module")
def laggards():
    """``{case: (workers' records, ps record)}`` of the job of 4 workers."""
    # the chief also reads the consolidated state while the others keep stepping
    _, workers, ps = run_cases(4, [
        case(name, "--replicas", 3, "--laggard", laggard, "--sleep-at", 3, "--sleep", 2.0,
             "--after", 10, "--state-every", 2) for name, laggard in LAGGARDS.items()])
    return {name: (workers[name], ps[name][0]) for name in LAGGARDS}


@pytest.fixture(scope="module")
def two_workers():
    """The job of 2 workers, 4 gradients a step: 2 tokens, then 1 (too few)."""
    return run_cases(2, [case("kbatch", "--replicas", 4, "--num-tokens", 2, "--steps", 15),
                         case("too-few-tokens", "--replicas", 4, "--num-tokens", 1)],
                     refused=1)


def per_step(ps: dict) -> dict[int, dict]:
    return {r["step"]: r for r in ps["stats"]["per_step"]}


@pytest.mark.parametrize("name", list(LAGGARDS), ids=["chief-sleeps", "worker-sleeps"])
def test_backup_workers_leave_a_laggard_behind_without_waiting(laggards, name):
    laggard = LAGGARDS[name]
    workers, ps = laggards[name]
    assert sorted(workers) == [0, 1, 2, 3]
    steps = per_step(ps)
    slow = workers[laggard]["pushes"]
    computed_at, answered_with = slow[3]      # the push made after sleeping
    # the others kept completing steps while it slept, without its gradient
    assert answered_with > computed_at + 1
    for s in range(computed_at + 1, answered_with):
        assert laggard not in steps[s]["taken"], s
        assert len(steps[s]["taken"]) == 3
    # its late gradient was dropped and counted, nothing was lost silently
    assert laggard in steps[computed_at]["dropped"]
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


def test_fewer_workers_than_gradients_with_enough_tokens(two_workers):
    _, workers, ps = two_workers
    (ps,) = ps["kbatch"]
    applied = [r for r in ps["stats"]["per_step"] if r["step"] < ps["stats"]["global_step"]]
    assert len(applied) >= 15
    for rec in applied:
        assert len(rec["taken"]) == 4, rec      # each step averaged 4 gradients
        assert set(rec["taken"]) <= {0, 1}
    # both workers computed several batches on the same parameters
    for w in workers["kbatch"].values():
        assert sum(1 for before, after in w["pushes"] if before == after) > 0


def test_too_few_tokens_is_a_clear_error_on_every_rank(two_workers):
    """Refused on every worker, naming it; the ps rank says why and serves on."""
    run, workers, _ = two_workers
    for w, record in workers["too-few-tokens"].items():
        who = f"worker {w} (rank {w}"
        assert re.match(re.escape(f"ConfigError: {who}") + r"[^)]*\): .*num_tokens=1 is too few",
                        record["error"]), (who, record)
    who = "ps 0 (rank 2"
    assert re.search(re.escape(who) + r".*" + TOO_FEW + r".*\(serving on", run.output), (
        who, run.describe())
