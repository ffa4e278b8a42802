"""Every training loop of tests/scripts/cases.py gives under mpisync what plain torch gives.

One job (2 workers, 2 ps ranks) runs every case, one optimizer after another; this
process runs each case in plain torch and compares parameters, buffers, optimizer state,
the hyper-parameters each ps applied at the last step (values and types) and the
workers' param groups. The same job then runs every case again with ``dense="allreduce"``
(dense parameters averaged among the workers and updated there, the partitioned ones
still on the ps ranks), and last the cases that reach every part of the staging code
(``mpisync.worker.devices``: how a GPU worker's parameters travel) with the CPU parameters
staged through host copies. A second job runs the partitioned cases on 3 ps ranks.
"""
from __future__ import annotations

import math
import sys

import pytest
from mpi_helpers import SCRIPTS, Run, run_mpi

sys.path.insert(0, str(SCRIPTS))
from cases import BY_NAME, CASES, WORKERS, reference
from training_cases import ps_by_case

TOLERANCE = 1e-6     # float64 models: the sums' order differs, nothing else may

#: zeroed gradients, frozen and integer parameters, every kind of write, buffers, shards
STAGED = ["multiplicative", "untouched-zeros-first", "untouched-none-last",
          "load-state-after-wrapping", "restore-model-then-optimizer", "clamp-through-data",
          "assign-data", "write-integer-parameter", "buffers-broadcast",
          "partitioned-zeros-clamp", "partitioned-assign"]
#: the job's cases as exact.py takes them: ``[MODE:]NAME``, each mode in turn
GIVEN = ([c.name for c in CASES] + [f"allreduce:{c.name}" for c in CASES]
         + [f"staged:{name}" for name in STAGED])


@pytest.fixture(scope="module")
def launch() -> Run:
    return run_mpi("exact.py", WORKERS, 2, GIVEN, timeout=120 + 4 * len(GIVEN))


def of_mode(run: Run, mode: str) -> Run:
    """The job as if it had run only this mode's cases: their worker records (named by
    case) and the ps ranks' records of their optimizers."""
    ps, by_case, results = ps_by_case(run.ps(), GIVEN), run.by_case(), []
    for given in GIVEN:
        given_mode, _, name = given.rpartition(":")
        if (given_mode or "ps") == mode:
            results += [dict(r, case=name) for r in by_case.get(given, {}).values()]
            results += ps[given]
    return Run(run.returncode, run.stdout, run.stderr, results, run.command)


@pytest.fixture(scope="module", params=["ps", "allreduce"])
def job(request, launch):
    run = of_mode(launch, request.param)
    return run, run.by_case()


@pytest.fixture(scope="module")
def staged_job(launch):
    run = of_mode(launch, "staged")
    return run, run.assert_every_case_ran(STAGED, WORKERS, lambda name: BY_NAME[name].steps)


def max_diff(a, b) -> float:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        return max((max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, bool) or a is None or isinstance(a, str):
        assert a == b
        return 0.0
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(a - b)


def test_every_case_ran_on_every_worker(job):
    run, _ = job
    by_case = run.assert_every_case_ran(BY_NAME, WORKERS, lambda name: BY_NAME[name].steps)
    for workers in by_case.values():
        assert {w["dropped"] for w in workers.values()} == {0}
    assert len(run.ps()) == 2 * len(CASES)          # each ps served every optimizer


#: gradients given by hand after backward that dense="allreduce" does not take yet
NOT_YET_ALLREDUCE = {"regrad-zeros", "regrad-none-last", "regrad-partitioned",
                     "regrad-shared-zeros", "regrad-shared-data-zeros"}


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case_matches_plain_torch(request, job, name):
    if request.node.callspec.params["job"] == "allreduce" and name in NOT_YET_ALLREDUCE:
        with pytest.raises(AssertionError):
            assert_matches_plain_torch(job[1], name)
        pytest.xfail("dense='allreduce' does not take these gradients given by hand yet")
    assert_matches_plain_torch(job[1], name)


@pytest.mark.parametrize("name", STAGED)
def test_staged_parameters_match_plain_torch(staged_job, name):
    run, by_case = staged_job
    assert {w["staged"] > 0 for w in by_case[name].values()} == {True}, run.describe()
    assert_matches_plain_torch(by_case, name)


def assert_matches_plain_torch(by_case: dict, name: str) -> None:
    case, ref = BY_NAME[name], reference(BY_NAME[name])
    for w, got in by_case[name].items():
        assert max_diff(got["params"], ref["params"]) <= TOLERANCE, (w, "params")
        assert max_diff(got["state"], ref["state"]) <= TOLERANCE, (w, "optimizer state")
        # the workers' groups: the same keys, values and types as plain torch's
        assert got["groups"] == ref["groups"], (w, got["groups"], ref["groups"])
        if case.replicas:
            want = ref["buffers_per_worker"][w]
            assert max_diff(got["buffers"], want) <= TOLERANCE, (w, "buffers")
        else:
            assert max_diff(got["buffers"], ref["buffers"]) <= TOLERANCE, (w, "buffers")
    # what each ps applied at the last step: exactly what torch applied, with its type
    applied = ref.get("applied") or by_case[name][0]["applied"]
    for ps_groups in by_case[name][0]["ps_groups"]:
        if not ps_groups:
            continue                                 # this ps holds none of the parameters
        assert len(ps_groups) == len(applied)
        for mine, want in zip(ps_groups, applied):
            for key, value in mine.items():
                assert value == want[key], (key, value, want[key])


def test_the_cases_would_catch_the_old_mistakes(job):
    """The cases are not vacuous: their schedules and writes change what torch computes."""
    onecycle = reference(BY_NAME["onecycle-int-momentum"])["applied"][0]
    assert onecycle["momentum"][0] == "float" and onecycle["momentum"][1] > 0.5
    stepped = reference(BY_NAME["lambda-int-lr"])["applied"][0]
    assert stepped["lr"] == ["float", 0.5 ** 7]
    tensor_lr = reference(BY_NAME["linear-tensor-lr"])["applied"][0]["lr"]
    assert tensor_lr[0] == "tensor:torch.float32" and tensor_lr[1] != 0.025
    clamped = reference(BY_NAME["clamp-through-data"])["params"]
    assert max(abs(v) for row in clamped["0.weight"] for v in row) <= 0.2
    frozen = reference(BY_NAME["untouched-zeros-first"])["params"]
    assert frozen["frozen"] == [1.0, 1.0, 1.0] and frozen["counts"] == [0, 1, 2, 3]
    local = reference(BY_NAME["buffers-local"])["buffers_per_worker"]
    assert local[0] != local[1]


def test_a_parameter_partitioned_over_three_ps_trains_as_unpartitioned():
    """The same cases on 3 ps ranks: each shard placed on its own, the result unchanged."""
    names = ["partitioned-adam", "partitioned-restore"]
    run = run_mpi("exact.py", WORKERS, 3, names, timeout=300)
    for r in run.results:
        if r.get("role") != "worker":
            continue
        ref = reference(BY_NAME[r["case"]])
        assert max_diff(r["params"], ref["params"]) <= TOLERANCE, (r["case"], "params")
        assert max_diff(r["state"], ref["state"]) <= TOLERANCE, (r["case"], "state")
        # every ps holds some shard and applied the step's hyper-parameters
        assert all(groups for groups in r["ps_groups"]), r["ps_groups"]
