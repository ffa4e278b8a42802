"""N workers with batch B equal one process with batch N*B: parameters, state, schedules.

The trainings run as cases of a few jobs (train.py ``--case``): one with 1 ps rank, one
with 2, and one more with 2 that resumes from a checkpoint the second wrote.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
import train
from training_cases import case

WORKERS, BATCH, STEPS = 3, 16, 30
EMA = ("--ema", 0.9, "--ema-num-updates")

#: name: (options) of each training of the job with 1 ps rank, then of the job with 2
ONE_PS = {"sgd": ("--opt", "sgd"), "adam": ("--opt", "adam"),
          "adam-zero-copy-grads": ("--opt", "adam", "--zero-in-place"),
          "steplr": ("--opt", "sgd", "--sched", "steplr")}
TWO_PS = {"state-dict": ("--opt", "adam"),
          "deterministic": ("--opt", "adam", "--deterministic"),
          "deterministic-staged": ("--opt", "adam", "--deterministic", "--stage-cpu"),
          "ema-fixed": ("--opt", "adam", "--ema", 0.9),
          "ema-num-updates": ("--opt", "adam", "--ema", 0.9, "--ema-num-updates"),
          "half": ("--opt", "adam", "--stop", 15, *EMA)}     # the checkpoint, resumed below


def reference(tmp_path, opt: str, sched: str = "", *extra) -> dict:
    """One process with the workers' batches together, run here (train.py --single)."""
    out = tmp_path / f"single-{opt}-{sched}.pt"
    train.single(train.parse(["--single", str(WORKERS), "--opt", opt, "--steps", str(STEPS),
                              "--batch", str(BATCH), "--sched", sched, "--dump", str(out),
                              *map(str, extra)]))
    return torch.load(out)


class Job:
    """One job of several trainings: each case's dump and worker records."""

    def __init__(self, out, num_ps: int, trainings: dict[str, tuple], timeout_each: int = 30):
        self.out = out
        specs = [case(name, "--steps", STEPS, "--batch", BATCH, "--dump", self.dump(name),
                      *options) for name, options in trainings.items()]
        self.run = run_mpi("train.py", WORKERS, num_ps,
                           ["--num-ps", num_ps, *(a for s in specs for a in ("--case", s))],
                           timeout=120 + timeout_each * len(specs))
        self.by_case = self.run.assert_every_case_ran(trainings, WORKERS, lambda name: None)

    def dump(self, name: str):
        return self.out / f"{name}.pt"

    def __getitem__(self, name: str) -> tuple[dict, list]:
        """The case's dump and its workers' records (as one job of it gave them)."""
        return torch.load(self.dump(name)), list(self.by_case[name].values())


@pytest.fixture(scope="module")
def one_ps(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("one-ps"), 1, ONE_PS)


@pytest.fixture(scope="module")
def two_ps(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("two-ps"), 2, TWO_PS)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, two_ps):
    """A new job: 15 more steps from the checkpoint of case ``half``."""
    return Job(tmp_path_factory.mktemp("resumed"), 2, {
        "resumed": ("--opt", "adam", "--start", 15, "--resume", two_ps.dump("half"), *EMA)})


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].detach() - b[k].detach()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["sgd", "adam", "adam-zero-copy-grads"])
@pytest.mark.openmpi
def test_workers_equal_one_big_batch(tmp_path, one_ps, name):
    ref = reference(tmp_path, ONE_PS[name][1])
    dist, workers = one_ps[name]
    assert max_diff(ref["params"], dist["params"]) <= 1e-5
    assert len(workers) == WORKERS
    assert {r["global_step"] for r in workers} == {STEPS}
    assert {r["applied"] for r in workers} == {WORKERS * STEPS}
    assert {r["dropped"] for r in workers} == {0}
    # every worker ends with the same parameters
    assert len({r["checksum"] for r in workers}) == 1
    # the ps rank stepped torch's optimizers without importing torch._dynamo for them
    # (mpisync.native.torchstep)
    assert [r["dynamo"] for r in one_ps.run.ps()] == [False] * len(ONE_PS)
    # glibc's heap kept: every block on a serving ps rank, a step's temporaries on a worker
    # while its optimizer is open
    if os.confstr("CS_GNU_LIBC_VERSION"):
        assert {r["heap"] for r in one_ps.run.ps()} == {"kept"}
        assert {(r["heap"], r["heap_after"]) for r in workers} == {("steps", None)}


def test_state_dict_matches_plain_optimizer(tmp_path, two_ps):
    """Keys, shapes and values of the consolidated state equal torch's own (Adam moments)."""
    ref = reference(tmp_path, "adam")["state"]
    got = two_ps["state-dict"][0]["state"]
    assert got["mpisync"]["global_step"] == STEPS
    assert got["param_groups"] == ref["param_groups"]
    assert got["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert got["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert got["state"][i][k].shape == v.shape, (i, k)
            assert torch.allclose(got["state"][i][k], v, atol=1e-5, rtol=0), (i, k)


def test_steplr_on_the_wrapper_follows_single_process(tmp_path, one_ps):
    ref = reference(tmp_path, "sgd", "steplr")
    dist, results = one_ps["steplr"]
    assert max_diff(ref["params"], dist["params"]) <= 1e-5
    # 30 steps with StepLR(7, 0.5): the lr was halved four times, on every worker
    assert {r["lr"] for r in results if r["role"] == "worker"} == {0.1 * 0.5 ** 4}
    assert dist["state"]["param_groups"][0]["lr"] == ref["state"]["param_groups"][0]["lr"]


def test_deterministic_runs_are_bitwise_identical_with_or_without_staging(two_ps):
    """Two runs repeat bitwise, the second with the parameters staged through host copies
    (``MPISYNC_STAGE_CPU=1``: the code that moves a GPU worker's parameters)."""
    a, views = two_ps["deterministic"]
    b, staged = two_ps["deterministic-staged"]
    assert {r["staged"] for r in views if r["role"] == "worker"} == {0}
    assert {r["staged"] for r in staged if r["role"] == "worker"} == {len(a["params"])}
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k


def test_checkpoint_restore_continues_the_same_trajectory(tmp_path, two_ps, resumed):
    """15 steps, save params and consolidated state, restore in a new job, 15 more steps."""
    ref = reference(tmp_path, "adam", "", *EMA)
    assert {r["global_step"] for r in two_ps["half"][1]} == {15}
    got, workers = resumed["resumed"]
    assert {r["global_step"] for r in workers if r["role"] == "worker"} == {STEPS}
    assert max_diff(ref["params"], got["params"]) <= 1e-5
    assert max_diff(ref["averages"], got["averages"]) <= 1e-5   # the averages came back too
    assert got["state"]["state"][0]["step"] == ref["state"]["state"][0]["step"]


@pytest.mark.parametrize("name", ["ema-fixed", "ema-num-updates"], ids=["fixed", "num-updates"])
def test_moving_averages_on_the_ps_follow_single_process(tmp_path, two_ps, name):
    ref = reference(tmp_path, "adam", "", *TWO_PS[name][2:])
    dist, results = two_ps[name]
    assert max_diff(ref["averages"], dist["averages"]) <= 1e-5
    # the averages are not the parameters: they lag behind them
    assert max_diff(dist["params"], dist["averages"]) > 1e-3
    assert dist["state"]["mpisync"]["averages"].keys() == ref["averages"].keys()
    assert max_diff(dist["state"]["mpisync"]["averages"], dist["averages"]) == 0
    (chief,) = [r for r in results if r.get("worker") == 0]
    assert chief["averaged_ok"] is True    # averaged() swapped them in, then restored


@pytest.mark.openmpi
def test_restore_pattern_never_races_with_four_workers():
    """load_state_dict() on every worker, then training; one worker late at random."""
    rounds = 12
    run = run_mpi("restore.py", 4, 1, ["--rounds", rounds], timeout=180)
    workers = run.by_worker()
    assert sorted(workers) == [0, 1, 2, 3]
    for r in range(rounds):
        results = [workers[w]["rounds"][r] for w in range(4)]
        assert {res[0] for res in results} == {3}                # 3 steps from the load
        assert len({res[1] for res in results}) == 1             # the same parameters
        assert all(res[2] == [5] * len(res[2]) for res in results)   # Adam: 2 + 3 steps
