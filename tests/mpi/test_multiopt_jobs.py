"""Several torch optimizers in one SyncReplicasOptimizer equal them stepped in one process.

One job (2 workers, 2 ps ranks) runs every case of tests/scripts/multiopt.py: Adam and SGD
with momentum over two dense layers, and Adam over a head with ``torch.optim.Adagrad`` or
``mpisync.RowWiseAdagrad`` over an ``mpisync.EmbeddingBag`` table, a StepLR scheduler on
Adam and a LambdaLR on the other. Parameters, the table, the optimizer state and the scheduled learning rates equal
plain torch over the concatenated batches, and a job resumed from a checkpoint saved
midway reaches the same values. Before them, one worker's optimizers leave a parameter
out: the set-up is refused on every worker, naming it, and the job goes on.
"""
from __future__ import annotations

import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
from multiopt import CASES, STEPS, WORKERS, build, late_scheduler_warnings, reference

from mpisync.protocol.multi import join_state_dicts

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multiopt")
    run = run_mpi("multiopt.py", WORKERS, 2, [directory, *CASES], timeout=240)
    return run.by_case()


def close(got, want) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float64),
                          torch.as_tensor(want, dtype=torch.float64), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", CASES)
def test_equals_plain_torch(job, name):
    want = reference(name)
    assert sorted(job[name]) == list(range(WORKERS)), job.keys()
    for w, got in job[name].items():
        assert got["values"].keys() == want["values"].keys()
        for key, value in want["values"].items():
            assert close(got["values"][key], value), (name, w, key)
        assert got["lrs"] == [0.05 * 0.5 ** ((t + 1) // 2) for t in range(STEPS)]
        assert got["counts"] == [len(sd["param_groups"]) for sd in want["state"]]
        assert got["scheduler_warnings"] == [], (name, w)   # each optimizer's step() ran
        assert got["reloaded"], (name, w)
        assert got["reloaded_apart"], (name, w)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_holds_every_optimizer(job, name):
    """The dense parameters' state (the tables' is in the "mpisync" entry)."""
    joined = join_state_dicts(reference(name)["state"])
    got = job[name][0]
    assert [g["lr"] for g in got["groups"]] == [g["lr"] for g in joined["param_groups"]]
    assert [g["params"] for g in got["groups"]] == [g["params"] for g in joined["param_groups"]]
    dense = {i: s for i, s in joined["state"].items()
             if name == "adam+sgd" or i < len(joined["param_groups"][0]["params"])}
    assert sorted(got["state"]) == sorted(map(str, dense))
    for i, s in dense.items():
        for key, value in s.items():
            assert close(got["state"][str(i)][key], value), (name, i, key)


@pytest.mark.parametrize("name", CASES)
def test_resumed_from_checkpoint(job, name):
    """With the schedulers of each inner optimizer: saved as ``extra`` (adam+sgd), or by
    the Checkpointer, which holds the schedulers built over the joined optimizers."""
    want = reference(name)["values"]
    for w, got in job[name].items():
        assert got["resumed_step"] == STEPS
        assert got["resumed_lrs"] == pytest.approx(reference(name)["lrs"], abs=1e-15), w
        for key, value in want.items():
            assert close(got["resumed"][key], value), (name, w, key)


def test_a_parameter_no_optimizer_holds_is_refused_on_every_worker(job):
    for w, got in job["refused"].items():
        assert got["error"] is not None, w
        assert got["error"].startswith(f"ConfigError: worker {w} "), got["error"]
        assert "worker 1 (rank 1): parameter 'second.weight' of named_parameters is in " \
               "no optimizer of the list (1 given)" in got["error"], (w, got["error"])
    assert sorted(job["refused"]) == list(range(WORKERS))


def test_a_scheduler_stepped_before_the_optimizer_warns_as_in_torch(job):
    """Built late over one joined optimizer: torch's warning once, when stepped before
    the next ``opt.step()``; none after it (the same counts as in one process)."""
    _, opts = build("adam+sgd", plain=True)

    def step(t):
        for o in opts:
            o.step()

    want = late_scheduler_warnings(opts[1], step)
    assert want == [1, 0]
    for w, got in job["late"].items():
        assert got["warned"] == want, w
    assert sorted(job["late"]) == list(range(WORKERS))
