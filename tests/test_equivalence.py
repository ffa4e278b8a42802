"""N workers with batch B equal one process with batch N*B: parameters, state, schedules."""
from __future__ import annotations

import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
import train

WORKERS, BATCH, STEPS = 3, 16, 30


def reference(tmp_path, opt: str, sched: str = "", *extra) -> dict:
    """One process with the workers' batches together, run here (train.py --single)."""
    out = tmp_path / f"single-{opt}-{sched}.pt"
    train.single(train.parse(["--single", str(WORKERS), "--opt", opt, "--steps", str(STEPS),
                              "--batch", str(BATCH), "--sched", sched, "--dump", str(out),
                              *map(str, extra)]))
    return torch.load(out)


def distributed(tmp_path, opt: str, *extra, ps: int = 1, name: str = "dist",
                env: dict | None = None) -> tuple[dict, list]:
    out = tmp_path / f"{name}-{opt}.pt"
    run = run_mpi("train.py", WORKERS, ps, ["--opt", opt, "--steps", STEPS, "--batch", BATCH,
                                            "--dump", out, *extra], env=env)
    return torch.load(out), run.results


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].detach() - b[k].detach()).abs().max().item() for k in a)


@pytest.mark.parametrize("opt,extra", [("sgd", ()), ("adam", ()),
                                       ("adam", ("--zero-in-place",))],
                         ids=["sgd", "adam", "adam-zero-copy-grads"])
@pytest.mark.openmpi
def test_workers_equal_one_big_batch(tmp_path, opt, extra):
    ref = reference(tmp_path, opt)
    dist, results = distributed(tmp_path, opt, *extra)
    assert max_diff(ref["params"], dist["params"]) <= 1e-5
    workers = [r for r in results if r["role"] == "worker"]
    assert len(workers) == WORKERS
    assert {r["global_step"] for r in workers} == {STEPS}
    assert {r["applied"] for r in workers} == {WORKERS * STEPS}
    assert {r["dropped"] for r in workers} == {0}
    # every worker ends with the same parameters
    assert len({r["checksum"] for r in workers}) == 1


def test_state_dict_matches_plain_optimizer(tmp_path):
    """Keys, shapes and values of the consolidated state equal torch's own (Adam moments)."""
    ref = reference(tmp_path, "adam")["state"]
    got = distributed(tmp_path, "adam", "--num-ps", 2, ps=2)[0]["state"]
    assert got["mpisync"]["global_step"] == STEPS
    assert got["param_groups"] == ref["param_groups"]
    assert got["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert got["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert got["state"][i][k].shape == v.shape, (i, k)
            assert torch.allclose(got["state"][i][k], v, atol=1e-5, rtol=0), (i, k)


def test_steplr_on_the_wrapper_follows_single_process(tmp_path):
    ref = reference(tmp_path, "sgd", "steplr")
    dist, results = distributed(tmp_path, "sgd", "--sched", "steplr")
    assert max_diff(ref["params"], dist["params"]) <= 1e-5
    # 30 steps with StepLR(7, 0.5): the lr was halved four times, on every worker
    assert {r["lr"] for r in results if r["role"] == "worker"} == {0.1 * 0.5 ** 4}
    assert dist["state"]["param_groups"][0]["lr"] == ref["state"]["param_groups"][0]["lr"]


def test_deterministic_runs_are_bitwise_identical_with_or_without_staging(tmp_path):
    """Two runs repeat bitwise, the second with the parameters staged through host copies
    (``MPISYNC_STAGE_CPU=1``: the code that moves a GPU worker's parameters)."""
    a, views = distributed(tmp_path, "adam", "--deterministic", "--num-ps", 2, ps=2, name="a")
    b, staged = distributed(tmp_path, "adam", "--deterministic", "--num-ps", 2, ps=2, name="b",
                            env={"MPISYNC_STAGE_CPU": "1"})
    assert {r["staged"] for r in views if r["role"] == "worker"} == {0}
    assert {r["staged"] for r in staged if r["role"] == "worker"} == {len(a["params"])}
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k


def test_checkpoint_restore_continues_the_same_trajectory(tmp_path):
    """15 steps, save params and consolidated state, restore in a new job, 15 more steps."""
    ema = ["--ema", 0.9, "--ema-num-updates"]
    ref = reference(tmp_path, "adam", "", *ema)
    half = tmp_path / "half.pt"
    run_mpi("train.py", WORKERS, 2, ["--opt", "adam", "--steps", STEPS, "--stop", 15,
                                     "--batch", BATCH, "--dump", half, "--num-ps", 2, *ema])
    resumed = tmp_path / "resumed.pt"
    run = run_mpi("train.py", WORKERS, 2, ["--opt", "adam", "--steps", STEPS, "--batch", BATCH,
                                           "--start", 15, "--resume", half, "--dump", resumed,
                                           "--num-ps", 2, *ema])
    assert {r["global_step"] for r in run.results if r["role"] == "worker"} == {STEPS}
    got = torch.load(resumed)
    assert max_diff(ref["params"], got["params"]) <= 1e-5
    assert max_diff(ref["averages"], got["averages"]) <= 1e-5   # the averages came back too
    assert got["state"]["state"][0]["step"] == ref["state"]["state"][0]["step"]


@pytest.mark.parametrize("extra", [(), ("--ema-num-updates",)], ids=["fixed", "num-updates"])
def test_moving_averages_on_the_ps_follow_single_process(tmp_path, extra):
    ref = reference(tmp_path, "adam", "", "--ema", 0.9, *extra)
    dist, results = distributed(tmp_path, "adam", "--ema", 0.9, *extra, "--num-ps", 2, ps=2)
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
