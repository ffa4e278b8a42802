"""dense="allreduce": the dense parameters averaged among the workers, against plain torch.

One job (2 workers, 1 ps rank) runs every case of tests/scripts/allreduce.py; this process
trains each in plain torch on the combined batch and compares the dense parameters, their
optimizer state, the table (kept on the ps rank), the moving averages, and what
``backward()`` left in ``.grad`` (already the mean over the workers); that the cases
differ at all is tested in one process (tests/unit/test_allreduce.py). With horovod
installed the cases run again with ``allreduce_backend="horovod"``.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
from mpi_helpers import SCRIPTS, failing, run_mpi
from shared_allreduce import max_diff

sys.path.insert(0, str(SCRIPTS))
from allreduce import BY_NAME, CASES, WORKERS, Net, data, dense_params, micro_losses, reference

TOLERANCE = 1e-5
HOROVOD = importlib.util.find_spec("horovod") is not None


# also run under Open MPI (make test-openmpi)
pytestmark = pytest.mark.openmpi


def _backends():
    """Both backends; ``ALLREDUCE_BACKENDS=horovod`` (make test-openmpi) picks one."""
    chosen = os.environ.get("ALLREDUCE_BACKENDS", "mpi,horovod").split(",")
    if "mpi" in chosen:
        yield "mpi"
    if "horovod" in chosen:
        yield pytest.param("horovod", marks=pytest.mark.skipif(
            not HOROVOD, reason="horovod is not installed here (make horovod installs it into "
                                "the Open MPI virtualenv, where make test-openmpi runs this file)"))


@pytest.fixture(scope="module", params=list(_backends()))
def job(request):
    args = [f"--backend={request.param}"] + [c.name for c in CASES]
    run = run_mpi("allreduce.py", WORKERS, 1, args, timeout=300)
    return run, run.by_case()


def test_every_case_ran_on_every_worker(job):
    run, _ = job
    run.assert_every_case_ran(BY_NAME, WORKERS, lambda name: BY_NAME[name].steps)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case_matches_plain_torch(job, name):
    _, by_case = job
    ref = reference(BY_NAME[name])
    for w, got in by_case[name].items():
        assert max_diff(got["params"], ref["params"]) <= TOLERANCE, (w, "params")
        assert max_diff(got["state"], ref["state"]) <= TOLERANCE, (w, "optimizer state")
        assert max_diff(got["table"], ref["table"]) <= TOLERANCE, (w, "table")
        if "averages" in ref:
            assert max_diff(got["averages"], ref["averages"]) <= TOLERANCE, (w, "averages")


def test_backward_leaves_the_mean_over_the_workers_in_grad(job):
    """After loss.backward() at step 0, .grad is what one process gets on both batches."""
    _, by_case = job
    for name in ("adam", "branch-on-one-worker", "accumulate-two-backwards"):
        case = BY_NAME[name]
        m = Net(case.model, plain=True)
        x, y, ids = data(case.steps)
        for w in range(WORKERS):
            for loss in micro_losses(case, m, w, 0, x, y, ids):
                (loss / WORKERS).backward()
        want = [p.grad.tolist() if p.grad is not None else None for p in dense_params(m)]
        for w, got in by_case[name].items():
            for a, b in zip(got["grads_after_backward"], want):
                assert max_diff(a, b) <= 1e-9, (name, w)


def test_the_ps_holds_the_table_and_nothing_dense(job):
    _, by_case = job
    plan = by_case["table-adam"][0]["plan"]
    assert "emb.weight/part_0" in plan and "emb.weight/part_1" in plan, plan
    assert "head.weight" not in plan and "body.weight" not in plan, plan
    assert "head.weight" not in by_case["adam"][0]["plan"]


# What dense="allreduce" refuses (its options, a model converted after wrapping, two open
# optimizers over one parameter) is tested in one process in tests/unit/test_refusals.py and
# on every rank in tests/mpi/test_errors_reach_every_rank.py's one job of refusals.


def test_a_worker_that_fails_ends_the_job_while_the_others_wait_in_the_allreduce():
    run = failing("errors.py", 3, 1, ["--case", "allreduce_raise"])
    assert re.search(r"worker 1 \(rank 1 on [^)]*\): ValueError: boom on purpose", run.output)
    assert re.search(r"stopping because worker 1 \(rank 1 on [^)]*\) failed", run.output), \
        run.output


#: MPISYNC_TIMEOUT of the stall tests: well above a first step on a loaded machine (5 s was
#: not), well below the stalled worker's 30 s sleep (tests/scripts/errors.py)
STALL_S = 12


def test_a_stalled_worker_ends_the_job_while_the_others_wait_in_the_allreduce():
    run = failing("errors.py", 2, 1, ["--case", "allreduce_stall"], timeout=90,
                  env={"MPISYNC_TIMEOUT": str(STALL_S), "MPISYNC_STALL_WARNING": "2"})
    # the ps (no message for 12 s) and worker 0 (no token for 12 s) watch the same time: on
    # a loaded machine either may see it first, and either ends the job
    assert re.search(rf"ps 0 \(rank 2[^)]*\): StallError: .*no message for {STALL_S} s"
                     rf"|worker 0 \(rank 0[^)]*\): StallError: .*did not arrive within {STALL_S} s",
                     run.output), run.output
    # the ps's warnings name the worker that stalls
    assert "global step 5 has 1 of 2 gradients; workers still computing: [1]" in run.output, \
        run.output
