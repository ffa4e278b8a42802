"""Bad input and failures: a clear message naming the rank, a non-zero exit, never a hang."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from mpi_helpers import SCRIPTS, assert_every_rank_says, failing, labels, mpi_flavor, run_mpi

from mpisync.launch import run_job


def failed(case: str, workers: int = 2, ps: int = 1, *args, env=None) -> str:
    return failing("errors.py", workers, ps, ["--case", case, *args], env=env).output


EVERY_RANK = labels(2, 1)


def test_num_ps_out_of_range_fails_on_every_rank():
    # the values themselves are checked in one process: test_inprocess.py
    out = failed("world", 1, 1, "--num-ps", 2)
    errors = re.findall(r"WorldTooSmallError: rank (\d): num_ps=(-?\d+)", out)
    assert {r for r, _ in errors} == {"0", "1"}, out
    assert {n for _, n in errors} == {"2"}
    assert "found 2 MPI ranks" in out


def test_replicas_to_aggregate_below_one_fails_on_every_rank():
    run = failing("errors.py", 2, 1, ["--case", "replicas0"])
    assert_every_rank_says(run, r"ConfigError.*replicas_to_aggregate must be >= 1, got 0",
                           EVERY_RANK)


@pytest.mark.parametrize("case, message", [
    ("async_replicas", "asynchronous mode applies each gradient alone: "
                       + "replicas_to_aggregate must be 1 (or unset), got 2"),
    ("staleness_without_async", "max_staleness bounds asynchronous training"),
])
def test_async_arguments_fail_on_every_rank(case, message):
    run = failing("errors.py", 2, 1, ["--case", case])
    assert_every_rank_says(run, r"ConfigError.*" + re.escape(message), EVERY_RANK)


def test_ema_decay_out_of_range_fails_on_every_rank():
    run = failing("errors.py", 2, 1, ["--case", "ema_bad"])
    assert_every_rank_says(run, r"ConfigError.*ema_decay must be in \[0, 1\), got 1\.0",
                           EVERY_RANK)


def test_averages_without_ema_decay_ends_the_job_naming_the_rank():
    # raised on one worker only: the others must not wait for it
    out = failed("averages_without_ema")
    assert re.search(r"worker 1 \(rank 1[^)]*\): ConfigError: .*averages\(\) needs a "
                     r"SyncReplicasOptimizer created with ema_decay", out), out


def test_step_inside_averaged_is_a_clear_error():
    out = failed("step_in_averaged")
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


@pytest.mark.openmpi
def test_workers_with_different_models_fail_on_every_rank():
    run = failing("errors.py", 2, 1, ["--case", "mismatch"])
    msg = "worker 1 (rank 1) has parameter #0 = '0.weight' shape [33, 10]"
    assert_every_rank_says(run, r"ModelMismatchError: .*" + re.escape(msg), EVERY_RANK)
    assert "shape [32, 10]" in run.output


def test_a_placement_that_differs_between_workers_fails_on_every_rank():
    run = failing("errors.py", 2, 2, ["--case", "placement_differs", "--num-ps", 2])
    assert_every_rank_says(
        run, r"ConfigError: .*set up the optimizer differently from worker 0: worker 1 "
             r"\(rank 1\); worker 1 has placement of '2.weight' = ps 1 where worker 0 has "
             r"ps 0", labels(2, 2))


@pytest.mark.parametrize("case, differs", [
    ("optimizer_differs", (r"optimizer class = torch\.optim\.adam\.Adam where worker 0 has "
                          r"torch\.optim\.sgd\.SGD")),
    ("lr_differs", r"optimizer kwargs = .*'lr': 0\.2.* where worker 0 has .*'lr': 0\.1"),
])
def test_different_optimizers_on_workers_fail_on_every_rank(case, differs):
    run = failing("errors.py", 2, 1, ["--case", case])
    assert_every_rank_says(run, r"ConfigError: .*worker 1 \(rank 1\); worker 1 has " + differs,
                           EVERY_RANK)


def test_an_optimizer_that_needs_a_closure_is_refused_on_every_rank():
    run = failing("errors.py", 2, 1, ["--case", "lbfgs"])
    assert_every_rank_says(run, r"ConfigError: .*torch\.optim\.lbfgs\.LBFGS\.step requires a "
                                r"closure.*use a first-order optimizer", EVERY_RANK)


def test_sparse_adam_over_dense_parameters_is_refused_on_every_rank():
    run = failing("errors.py", 2, 1, ["--case", "sparseadam"])
    assert_every_rank_says(run, r"ConfigError: .*SparseAdam takes sparse gradients only, and "
                                r"parameter '0\.weight' gets a dense one", EVERY_RANK)


def test_an_optimizer_class_only_the_workers_define_is_named_on_the_ps():
    run = failing("errors.py", 2, 1, ["--case", "class_on_workers_only"])
    assert re.search(r"ps 0 \(rank 2[^)]*\): ConfigError: .*cannot rebuild the workers' "
                     r"optimizer here: .*WorkersOnlySGD.*Define the optimizer class where every "
                     r"rank runs it", run.output), run.describe()


def test_an_attribute_changed_after_wrapping_is_refused_at_the_next_step():
    run = failing("errors.py", 2, 1, ["--case", "attribute_changed"])
    assert re.search(r"worker \d \(rank \d[^)]*\): ConfigError: .*ScaledSGD's attribute "
                     r"'scale' changed from 0\.5 to 10\.0 after the SyncReplicasOptimizer was "
                     r"created.*param_groups", run.output), run.describe()


def test_a_grad_scaler_is_refused_on_every_worker():
    run = failing("errors.py", 2, 1, ["--case", "grad_scaler"])
    assert_every_rank_says(run, r"ConfigError: .*torch\.amp\.GradScaler is not supported yet",
                           labels(2, 0))


def test_add_param_group_after_wrapping_is_refused_on_every_worker():
    run = failing("errors.py", 2, 1, ["--case", "add_param_group"])
    assert_every_rank_says(run, r"ConfigError: .*add_param_group\(\) after the "
                                r"SyncReplicasOptimizer was created", labels(2, 0))


def test_sparse_gradients_end_the_job_naming_the_parameter():
    run = failing("errors.py", 2, 1, ["--case", "sparse"])
    cause = r"TypeError: .*parameter 'emb\.weight' has a sparse gradient.*not the weight of an "
    assert re.search(r"worker \d \(rank \d[^)]*\): " + cause, run.output), run.describe()
    # the others name the cause too: their own error, or the failing rank's notice
    assert_every_rank_says(run, r"(TypeError|stopping because worker \d \(rank \d on [^)]*\) "
                                r"failed: TypeError): .*'emb\.weight' has a sparse gradient",
                           EVERY_RANK)
    assert "Cannot access data pointer" not in run.output


@pytest.mark.parametrize("case, workers, blocked, parked, why", [
    # backup workers: worker 2 still needs a gradient from one of 0, 1
    ("collective_deadlock", 3, [2], [0, 1], ("with backup workers, num_tokens or asynchronous "
                                            "updates the workers do not meet at the same step")),
    # strict sync: worker 1 has one batch more (on worker_comm, and on one made from it)
    ("collective_uneven", 2, [1], [0], "the workers ran different numbers of steps"),
    ("collective_uneven_split", 2, [1], [0], "the workers ran different numbers of steps"),
])
@pytest.mark.openmpi
def test_a_collective_that_a_step_waits_for_fails_fast_on_every_worker(case, workers,
                                                                      blocked, parked, why):
    run = failing("errors.py", workers, 1, ["--case", case])
    reason = (rf"DeadlockError: .*workers {re.escape(str(blocked))} wait inside step\(\) for "
              rf"global step \d+, which needs gradients from workers "
              rf"{re.escape(str(parked))}, who are in a collective on worker_comm: "
              rf"{re.escape(why)}.*opt\.close\(\) on every worker")
    assert_every_rank_says(run, reason, labels(workers, 0))
    assert re.search(r"this worker is in worker_comm\.allreduce\(\)", run.output)


def test_a_metric_collective_after_every_step_in_strict_sync_is_fine():
    run = run_mpi("errors.py", 2, 1, ["--case", "metric_every_step"], timeout=120)
    assert {r["global_step"] for r in run.by_worker().values()} == {60}


def test_a_collective_no_step_waits_for_just_waits_for_the_others():
    run = run_mpi("errors.py", 3, 1, ["--case", "collective_early_but_safe"], timeout=60)
    assert re.search(r"gathered while open: \[\d+, \d+, \d+\]", run.output), run.describe()


def test_collectives_after_close_are_the_safe_end_of_training():
    run = run_mpi("errors.py", 3, 1, ["--case", "collective_after_close"], timeout=60)
    assert re.search(r"gathered after close: \[\d+, \d+, \d+\]", run.output), run.describe()


def test_a_write_dropped_with_a_late_gradient_is_not_dropped_silently():
    run = run_mpi("errors.py", 3, 1, ["--case", "dropped_write"], timeout=60)
    assert re.search(r"RuntimeWarning: worker 2 \(rank 2[^)]*\): the step did not take this "
                     r"worker's gradient \(it came too late\), so the writes to \['0\.bias'\] "
                     r"that travelled with it were dropped too", run.output), run.describe()


@pytest.mark.openmpi
def test_a_nonfinite_gradient_ends_the_job_naming_the_parameter_and_worker():
    run = failing("errors.py", 2, 1, ["--case", "nonfinite"])
    assert_every_rank_says(run, r"NonFiniteError: .*the gradient of parameter '2\.weight' for "
                                r"global step 3 holds NaN or Inf, from workers \[1\] \(ranks "
                                r"\[1\]\); the step is not applied", EVERY_RANK)


def test_step_after_close_is_a_clear_error():
    out = failed("step_after_close")
    assert "worker 1 (rank 1" in out
    assert "ClosedError" in out and "step() called after close()" in out


@pytest.mark.openmpi
def test_exception_in_user_code_ends_the_whole_job():
    run = failing("errors.py", 3, 1, ["--case", "raise"])
    assert re.search(r"worker 1 \(rank 1 on [^)]*\): ValueError: boom on purpose", run.output)
    # the ranks waiting meanwhile say why they stop before the abort ends them
    assert_every_rank_says(run, r"(ValueError|stopping because worker 1 \(rank 1 on [^)]*\) "
                                r"failed: ValueError): boom on purpose", labels(3, 1))


@pytest.mark.openmpi
def test_exception_on_a_ps_rank_ends_the_whole_job():
    out = failed("raise_ps", 2, 1)
    assert re.search(r"ps 0 \(rank 2 on [^)]*\): RuntimeError: boom on purpose", out), out


@pytest.mark.openmpi
def test_chief_that_finishes_first_does_not_leave_the_others_waiting():
    run = run_mpi("errors.py", 3, 1, ["--case", "chief_first"], timeout=60)
    workers = run.by_worker()
    assert workers[0]["global_step"] == 5 and not workers[0]["stopped"]
    for w in (1, 2):
        assert workers[w]["stopped"] and workers[w]["global_step"] == 5
    assert run.ps()[0]["global_step"] == 5


@pytest.mark.openmpi
def test_worker_that_exits_without_close_still_ends_cleanly():
    run = run_mpi("errors.py", 2, 2, ["--case", "exit_without_close", "--num-ps", 2],
                  timeout=60)
    assert {r["global_step"] for r in run.ps()} == {20}


@pytest.mark.openmpi
def test_a_stalled_worker_ends_the_job_with_a_message_naming_it():
    out = failed("stall", env={"MPISYNC_TIMEOUT": "5", "MPISYNC_STALL_WARNING": "2"})
    assert re.search(r"ps 0 \(rank 2[^)]*\): nothing arrived for \d+ s; .*computing: \[1\]",
                     out), out
    assert re.search(r"ps 0 \(rank 2[^)]*\): StallError: .*no message for 5 s", out), out
    assert "workers still computing: [1]" in out, out


@pytest.mark.parametrize("case", ["killed", "killed_ps"])
@pytest.mark.openmpi
def test_a_rank_that_dies_ends_the_whole_job(case):
    # SIGKILL leaves no excepthook and no MPI_Abort: the launcher must end the others,
    # and mpisync's launcher says what the status means; the shared memory between the
    # workers and the ps ranks goes with them. MPICH cannot survive a lost worker even when
    # asked (Open MPI can: test_survive.py)
    before = set(os.listdir("/dev/shm"))
    survive = ["--survive-worker-loss"] if case == "killed" and mpi_flavor() == "mpich" else []
    job = run_job([sys.executable, "-m", "mpisync.launch", *survive, "--workers", "2", "--ps",
                   "2", "--timeout", "30", "--", sys.executable, str(SCRIPTS / "errors.py"),
                   "--case", case, "--num-ps", "2"], timeout=60, capture=True,
                  env=dict(os.environ, MPISYNC_TIMEOUT="60", OMP_NUM_THREADS="1"))
    assert job.returncode not in (0, 124), job.output
    assert re.search(r"signal 9|Killed", job.output), job.output
    assert re.search(r"mpisync\.launch: the job failed with exit status \d+: a rank ended by "
                     r"SIGKILL \(signal 9\) or without finishing MPI", job.output), job.output
    if survive:
        assert re.search(r"\[mpisync\] survive_worker_loss: this MPI \(MPICH.*\) cannot "
                         r"survive a lost rank \(only Open MPI with ULFM can\)",
                         job.output), job.output
    assert not {f for f in set(os.listdir("/dev/shm")) - before if "mpisync" in f}


ABORT_THAT_NEVER_RETURNS = "#include <unistd.h>\nint MPI_Abort(void *c, int e) { for (;;) sleep(100); }\n"


def test_an_abort_that_never_returns_still_ends_the_rank(tmp_path):
    """The abort that ends a failing job lets go of the GIL while it waits, so the timer
    that ends a rank whose abort waits for good (seen with Open MPI's ULFM, once ranks had
    died) runs: here ``MPI_Abort`` itself never returns (a library preloaded in its place)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    (tmp_path / "abort.c").write_text(ABORT_THAT_NEVER_RETURNS)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "abort.so"),
                    str(tmp_path / "abort.c")], check=True, timeout=120)
    start = time.monotonic()
    probe = "from mpi4py import MPI\nfrom mpisync.ps_ranks import abort_within\nabort_within(2, 7)"
    run = subprocess.run([sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, LD_PRELOAD=str(tmp_path / "abort.so")))
    assert run.returncode == 7, run.stderr[-2000:]
    assert time.monotonic() - start < 100
