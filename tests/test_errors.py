"""Bad input and failures: a clear message naming the rank, a non-zero exit, never a hang."""
from __future__ import annotations

import re

import pytest
from mpi_helpers import run_mpi


def failing(case: str, workers: int = 2, ps: int = 1, *args, env=None) -> str:
    run = run_mpi("errors.py", workers, ps, ["--case", case, *args], timeout=30,
                  expect_ok=False, env=env)
    assert run.returncode != 0, run.output
    return run.output


@pytest.mark.parametrize("num_ps", [2, 3, 0, -1])
def test_num_ps_out_of_range_fails_on_every_rank(num_ps):
    out = failing("world", 1, 1, "--num-ps", num_ps)
    errors = re.findall(r"WorldTooSmallError: rank (\d): num_ps=(-?\d+)", out)
    assert {r for r, _ in errors} == {"0", "1"}, out
    assert {n for _, n in errors} == {str(num_ps)}
    assert "found 2 MPI ranks" in out


def test_replicas_to_aggregate_below_one_fails_on_every_rank():
    out = failing("replicas0")
    for who in ("worker 0 (rank 0", "worker 1 (rank 1", "ps 0 (rank 2"):
        assert re.search(re.escape(who) + r".*ConfigError.*replicas_to_aggregate must be >= 1, "
                         r"got 0", out), (who, out)


@pytest.mark.parametrize("case, message", [
    ("async_replicas", "asynchronous mode applies each gradient alone: "
                       + "replicas_to_aggregate must be 1 (or unset), got 2"),
    ("staleness_without_async", "max_staleness bounds asynchronous training"),
])
def test_async_arguments_fail_on_every_rank(case, message):
    out = failing(case)
    for who in ("worker 0 (rank 0", "worker 1 (rank 1", "ps 0 (rank 2"):
        assert re.search(re.escape(who) + r".*ConfigError.*" + re.escape(message), out), (
            who, out)


def test_ema_decay_out_of_range_fails_on_every_rank():
    out = failing("ema_bad")
    for who in ("worker 0 (rank 0", "worker 1 (rank 1", "ps 0 (rank 2"):
        assert re.search(re.escape(who) + r".*ConfigError.*ema_decay must be in \[0, 1\), "
                         r"got 1\.0", out), (who, out)


def test_averages_without_ema_decay_ends_the_job_naming_the_rank():
    # raised on one worker only: the others must not wait for it
    out = failing("averages_without_ema")
    assert re.search(r"worker 1 \(rank 1[^)]*\): ConfigError: .*averages\(\) needs a "
                     r"SyncReplicasOptimizer created with ema_decay", out), out


def test_step_inside_averaged_is_a_clear_error():
    out = failing("step_in_averaged")
    assert re.search(r"worker 0 \(rank 0[^)]*\): RuntimeError: .*step\(\) inside "
                     r"averaged\(\)", out), out


def test_a_state_that_does_not_fit_is_refused_and_loses_nothing():
    run = run_mpi("errors.py", 2, 1, ["--case", "bad_state"], timeout=60)
    for w in (0, 1):
        assert re.search(rf"caught: worker {w} \(rank {w}[^)]*\): load_state_dict\(\): state "
                         r"'momentum_buffer' of parameter #0 \('0.weight'\) has shape \[3, 3\], "
                         r"the parameter \[32, 10\]", run.output), run.output
    assert {r["global_step"] for r in run.by_worker().values()} == {25}
    assert run.ps()[0]["global_step"] == 25


def test_workers_with_different_models_fail_on_every_rank():
    out = failing("mismatch")
    msg = "worker 1 (rank 1) has parameter #0 = '0.weight' shape [33, 10]"
    for who in ("worker 0 (rank 0", "worker 1 (rank 1", "ps 0 (rank 2"):
        assert re.search(re.escape(who) + r".*ModelMismatchError: .*" + re.escape(msg), out), (
            who, out)
    assert "shape [32, 10]" in out


def test_step_after_close_is_a_clear_error():
    out = failing("step_after_close")
    assert "worker 1 (rank 1" in out
    assert "ClosedError" in out and "step() called after close()" in out


def test_exception_in_user_code_ends_the_whole_job():
    out = failing("raise", 3, 1)
    assert re.search(r"worker 1 \(rank 1 on [^)]*\): ValueError: boom on purpose", out), out
    # (ranks waiting at that moment also print why they stop: best effort, not asserted,
    # since the abort may end them first on a loaded machine)


def test_exception_on_a_ps_rank_ends_the_whole_job():
    out = failing("raise_ps", 2, 1)
    assert re.search(r"ps 0 \(rank 2 on [^)]*\): RuntimeError: boom on purpose", out), out


def test_chief_that_finishes_first_does_not_leave_the_others_waiting():
    run = run_mpi("errors.py", 3, 1, ["--case", "chief_first"], timeout=60)
    workers = run.by_worker()
    assert workers[0]["global_step"] == 5 and not workers[0]["stopped"]
    for w in (1, 2):
        assert workers[w]["stopped"] and workers[w]["global_step"] == 5
    assert run.ps()[0]["global_step"] == 5


def test_worker_that_exits_without_close_still_ends_cleanly():
    run = run_mpi("errors.py", 2, 2, ["--case", "exit_without_close", "--num-ps", 2],
                  timeout=60)
    assert {r["global_step"] for r in run.ps()} == {20}


def test_a_stalled_worker_ends_the_job_with_a_message_naming_it():
    out = failing("stall", env={"MPISYNC_TIMEOUT": "5", "MPISYNC_STALL_WARNING": "2"})
    assert re.search(r"ps 0 \(rank 2[^)]*\): nothing arrived for \d+ s; .*computing: \[1\]",
                     out), out
    assert re.search(r"ps 0 \(rank 2[^)]*\): StallError: .*no message for 5 s", out), out
    assert "workers still computing: [1]" in out, out


@pytest.mark.parametrize("case", ["killed", "killed_ps"])
def test_a_rank_that_dies_ends_the_whole_job(case):
    # SIGKILL leaves no excepthook and no MPI_Abort: the launcher must end the others
    out = failing(case, 2, 2, "--num-ps", 2)
    assert re.search(r"signal 9|Killed", out), out
