"""Errors reach every rank: a set-up refused on each of them, a failure that ends the whole
job; a clear message naming the rank, a non-zero exit, never a hang.

The refusals run in one job (``refusals``: tests/scripts/refusals.py, 2 workers and 2 ps
ranks), in which every worker catches each error, says it as mpisync's exception hook
would, and goes on to the next case; their exact messages are tested in one process in
tests/unit/test_refusals.py. The cases that end normally share another job (``completed``);
each case that ends its job (a raise that aborts it, a rank killed, a stall, a deadlock)
has its own. The abort that ends a rank is tested in one process in
tests/unit/test_abort_within.py.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import torch
from mpi_helpers import (
    SCRIPTS,
    assert_every_rank_says,
    failing,
    labels,
    mpi_flavor,
    rank_python,
    run_mpi,
)

from mpisync.launch import run_job


def failed(case: str, workers: int = 2, ps: int = 1, *args, env=None) -> str:
    return failing("errors.py", workers, ps, ["--case", case, *args], env=env).output


EVERY_RANK = labels(2, 1)
WORKERS = [0, 1]
HOROVOD = importlib.util.find_spec("horovod") is not None


@pytest.fixture(scope="module")
def refusals():
    """The one job of many refusals: ``({case: {rank: record}}, run)``."""
    run = run_mpi("refusals.py", 2, 2, timeout=300)
    cases: dict[str, dict[int, dict]] = {}
    for r in run.results:
        cases.setdefault(r["case"], {})[r["rank"]] = r
    return cases, run


def records_of(refusals, case: str, ranks=WORKERS) -> dict[int, dict]:
    cases, run = refusals
    assert sorted(cases.get(case, {})) == sorted(ranks), (case, run.describe())
    return cases[case]


def assert_refused(refusals, case: str, pattern: str, ranks: list[str]) -> None:
    """Every worker caught the error of ``case`` and said, after its name, what matches
    ``pattern``; every rank in ``ranks`` said so in the job's output (a ps rank: why the
    set-up failed on the workers)."""
    for w, record in records_of(refusals, case).items():
        assert record["said"] is not None and re.search(
            rf"worker {w} \(rank {w}[^)]*\)[:,]? .*" + pattern, record["said"]), (case, record)
    assert_every_rank_says(refusals[1], pattern, ranks)


@pytest.fixture(scope="module")
def completed():
    """The cases that end normally, one after another in one job of 3 workers and 1 ps."""
    names = ["metric_every_step", "collective_early_but_safe", "collective_after_close",
             "dropped_write"]
    run = run_mpi("errors.py", 3, 1, ["--cases", ",".join(names)], timeout=300)
    run.assert_every_case_ran(names, 3, lambda name: None)
    return run


def test_num_ps_out_of_range_fails_on_every_rank(refusals):
    # the values themselves are checked in one process: tests/unit/test_inprocess.py; here num_ps=2
    # on each rank of a world of 2 (ranks 0 and 1 of the job)
    out = "\n".join(r["error"] for r in records_of(refusals, "world", [0, 1, 2, 3]).values()
                    if r["error"] is not None)
    errors = re.findall(r"WorldTooSmallError: rank (\d): num_ps=(-?\d+)", out)
    assert {r for r, _ in errors} == {"0", "1"}, out
    assert {n for _, n in errors} == {"2"}
    assert "found 2 MPI ranks" in out


def test_num_ps_beside_a_launcher_count_that_differs_fails_on_every_rank(refusals):
    # the decision is tested in one process (tests/unit/test_bad_input.py); here init(num_ps=1) on
    # every rank of a job launched for 2 ps ranks (MPISYNC_NUM_PS=2)
    records = records_of(refusals, "world", [0, 1, 2, 3])
    for rank, r in records.items():
        assert r["num_ps_differs"] is not None and r["num_ps_differs"].startswith(
            f"ConfigError: rank {rank}: init(num_ps=1) but MPISYNC_NUM_PS=2: the job was "
            f"launched for 2 ps ranks"), (rank, r)
        assert r["num_ps_differs_collective"] is True, (rank, r)


def test_replicas_to_aggregate_below_one_fails_on_every_rank(refusals):
    assert_refused(refusals, "replicas0",
                   r"ConfigError.*replicas_to_aggregate must be >= 1, got 0", EVERY_RANK)


@pytest.mark.parametrize("case, message", [
    ("async_replicas", "asynchronous mode applies each gradient alone: "
                       + "replicas_to_aggregate must be 1 (or unset), got 2"),
    ("staleness_without_async", "max_staleness bounds asynchronous training"),
])
def test_async_arguments_fail_on_every_rank(refusals, case, message):
    assert_refused(refusals, case, r"ConfigError.*" + re.escape(message), EVERY_RANK)


def test_ema_decay_out_of_range_fails_on_every_rank(refusals):
    assert_refused(refusals, "ema_bad", r"ConfigError.*ema_decay must be in \[0, 1\), got 1\.0",
                   EVERY_RANK)


def test_averages_without_ema_decay_is_a_clear_error_on_that_worker(refusals):
    # raised on worker 1 only, before anything is sent: not collective, the others train on
    # (uncaught, such an error ends the job as a user's exception does: the "raise" case)
    records = records_of(refusals, "averages_without_ema")
    assert re.search(r"worker 1 \(rank 1[^)]*\): ConfigError: .*averages\(\) needs a "
                     r"SyncReplicasOptimizer created with ema_decay", records[1]["said"]), records
    assert records[1]["collective"] is False and records[0]["error"] is None, records
    assert {r["global_step"] for r in records.values()} == {3}


def test_step_inside_averaged_is_a_clear_error(refusals):
    # worker 0 alone: not collective, so uncaught it ends the job (as averages() above)
    records = records_of(refusals, "step_in_averaged")
    assert re.search(r"worker 0 \(rank 0[^)]*\): RuntimeError: .*step\(\) inside "
                     r"averaged\(\)", records[0]["said"]), records
    assert records[0]["collective"] is False and records[1]["error"] is None, records
    assert {r["global_step"] for r in records.values()} == {3}


def test_a_state_that_does_not_fit_is_refused_and_loses_nothing(refusals):
    records = records_of(refusals, "bad_state")
    for w in (0, 1):
        assert re.search(rf"worker {w} \(rank {w}[^)]*\): load_state_dict\(\): state "
                         r"'momentum_buffer' of parameter #0 \('0.weight'\) has shape \[3, 3\], "
                         r"the parameter \[32, 10\]", records[w]["error"]), records[w]
    assert {r["global_step"] for r in records.values()} == {25}
    (opt_id,) = {r["opt_id"] for r in records.values()}
    assert records_of(refusals, "served", [2, 3])[2]["steps"][opt_id] == 25   # ps 0's


@pytest.mark.openmpi
def test_workers_with_different_models_fail_on_every_rank(refusals):
    msg = "worker 1 (rank 1) has parameter #0 = '0.weight' shape [33, 10]"
    assert_refused(refusals, "mismatch", r"ModelMismatchError: .*" + re.escape(msg),
                   EVERY_RANK)
    assert all("shape [32, 10]" in r["said"] for r in records_of(refusals, "mismatch").values())


def test_a_placement_that_differs_between_workers_fails_on_every_rank(refusals):
    assert_refused(
        refusals, "placement_differs",
        r"ConfigError: .*set up the optimizer differently from worker 0: worker 1 "
        r"\(rank 1\); worker 1 has placement of '2.weight' = ps 1 where worker 0 has "
        r"ps 0", labels(2, 2))


@pytest.mark.parametrize("case, differs", [
    ("optimizer_differs", (r"optimizer class = torch\.optim\.adam\.Adam where worker 0 has "
                          r"torch\.optim\.sgd\.SGD")),
    ("lr_differs", r"optimizer kwargs = .*'lr': 0\.2.* where worker 0 has .*'lr': 0\.1"),
])
def test_different_optimizers_on_workers_fail_on_every_rank(refusals, case, differs):
    assert_refused(refusals, case, r"ConfigError: .*worker 1 \(rank 1\); worker 1 has " + differs,
                   EVERY_RANK)


def test_an_optimizer_that_needs_a_closure_is_refused_on_every_rank(refusals):
    assert_refused(refusals, "lbfgs", r"ConfigError: .*torch\.optim\.lbfgs\.LBFGS\.step "
                                      r"requires a closure.*use a first-order optimizer",
                   EVERY_RANK)


def test_sparse_adam_over_dense_parameters_is_refused_on_every_rank(refusals):
    assert_refused(refusals, "sparseadam", r"ConfigError: .*SparseAdam takes sparse gradients "
                                           r"only, and parameter '0\.weight' gets a dense one",
                   EVERY_RANK)


def test_an_optimizer_class_only_the_workers_define_is_named_on_the_ps():
    run = failing("errors.py", 2, 1, ["--case", "class_on_workers_only"])
    assert re.search(r"ps 0 \(rank 2[^)]*\): ConfigError: .*cannot rebuild the workers' "
                     r"optimizer here: .*WorkersOnlySGD.*Define the optimizer class where every "
                     r"rank runs it", run.output), run.describe()


def test_an_attribute_changed_after_wrapping_is_refused_at_the_next_step(refusals):
    records = records_of(refusals, "attribute_changed")
    for record in records.values():          # each worker changed it, each is refused
        assert re.search(r"worker \d \(rank \d[^)]*\): ConfigError: .*ScaledSGD's attribute "
                         r"'scale' changed from 0\.5 to 10\.0 after the SyncReplicasOptimizer "
                         r"was created.*param_groups", record["said"]), record
        assert (record["step_at_error"], record["global_step"]) == (2, 4), record


def test_a_grad_scaler_is_refused_on_every_worker(refusals):
    assert_refused(refusals, "grad_scaler",
                   r"ConfigError: .*torch\.amp\.GradScaler is not supported yet", labels(2, 0))
    for record in records_of(refusals, "grad_scaler").values():   # before anything was sent
        assert (record["step_at_error"], record["global_step"]) == (1, 3), record


def test_add_param_group_after_wrapping_is_refused_on_every_worker(refusals):
    assert_refused(refusals, "add_param_group", r"ConfigError: .*add_param_group\(\) after the "
                                                r"SyncReplicasOptimizer was created", labels(2, 0))


# -- what dense="allreduce" cannot do (moved here from the allreduce tests) ----------------
@pytest.mark.parametrize("case, cause", [
    pytest.param("allreduce_replicas", (r"backup workers do not apply: replicas_to_aggregate "
                                        r"must be the number of workers \(2\)"),
                 id="replicas_to_aggregate=1"),
    pytest.param("allreduce_async", r"it cannot train asynchronously", id="asynchronous=True"),
    pytest.param("allreduce_tokens", r"num_tokens must be 0 or unset, got 1", id="num_tokens=1"),
    pytest.param("allreduce_nccl", (r"allreduce_backend='nccl' needs CUDA and a torch built "
                                    r"with NCCL"), id="allreduce_backend='nccl'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    pytest.param("allreduce_bucket_bytes", r"bucket_bytes must be >= 1, got 0",
                 id="bucket_bytes=0"),
    pytest.param("allreduce_horovod", r"allreduce_backend='horovod' needs horovod",
                 id="allreduce_backend='horovod'",
                 marks=pytest.mark.skipif(HOROVOD, reason="horovod is installed here")),
])
@pytest.mark.openmpi
def test_what_allreduce_cannot_do_is_refused_on_every_worker(refusals, case, cause):
    for w, record in records_of(refusals, case).items():
        assert re.search(rf"worker {w} \(rank {w} on .*\).*ConfigError.*{cause}",
                         record["said"]), record
    assert_every_rank_says(refusals[1], r"ConfigError.*" + cause, EVERY_RANK)


@pytest.mark.openmpi
def test_a_model_converted_after_wrapping_is_refused_naming_the_parameter(refusals):
    for record in records_of(refusals, "allreduce_convert").values():
        assert re.search(r"worker \d \(rank \d on [^)]*\): TypeError: .*parameter "
                         r"'\d\.(weight|bias)' became a torch\.float64 tensor",
                         record["said"]), record
        assert record["global_step"] == 4, record        # and training went on


@pytest.mark.openmpi
def test_two_open_optimizers_over_one_parameter_are_refused(refusals):
    for w, record in records_of(refusals, "shared_two_opts").items():
        assert re.search(rf"worker {w} \(rank {w} on [^)]*\).*ConfigError.*parameter "
                         r"'0\.weight' is held by SyncReplicasOptimizer #0 too",
                         record["said"]), record
        assert record["global_step"] == 2, record        # the first trained on


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


@pytest.mark.openmpi
def test_a_worker_whose_program_ends_mid_training_ends_the_job_not_a_wait():
    """Worker 1 calls sys.exit(3) after global step 5 (no exception, so no hook: only its
    exit, which closes its optimizer and leaves the job) while worker 0 meets it in its
    Checkpointer's maybe_save(): worker 0 is told at once, not after MPISYNC_TIMEOUT."""
    run = failing("errors.py", 2, 1, ["--case", "exit_mid_training"])
    assert re.search(r"worker 0 \(rank 0 on [^)]*\): DeadlockError: ps 0 \(rank 2 on [^)]*\): "
                     r"workers \[0\] are in a collective on worker_comm that workers \[1\] "
                     r"can never join: they left the job at global step 5 \(they closed, or their "
                     r"program ended: sys\.exit\(\).*\(this worker is in worker_comm\.allgather\(\)\)",
                     run.output), run.describe()
    assert "MPISYNC_TIMEOUT" not in run.output and "Stall" not in run.output, run.describe()


def test_a_metric_collective_after_every_step_in_strict_sync_is_fine(completed):
    records = completed.by_case()["metric_every_step"]
    assert {r["global_step"] for r in records.values()} == {60}


def test_a_collective_no_step_waits_for_just_waits_for_the_others(completed):
    assert re.search(r"gathered while open: \[\d+, \d+, \d+\]", completed.output), \
        completed.describe()


def test_collectives_after_close_are_the_safe_end_of_training(completed):
    assert re.search(r"gathered after close: \[\d+, \d+, \d+\]", completed.output), \
        completed.describe()


def test_a_write_dropped_with_a_late_gradient_is_not_dropped_silently(completed):
    run = completed
    assert re.search(r"RuntimeWarning: worker 2 \(rank 2[^)]*\): the step did not take this "
                     r"worker's gradient \(it came too late\), so the writes to \['0\.bias'\] "
                     r"that travelled with it were dropped too", run.output), run.describe()


@pytest.mark.openmpi
def test_a_nonfinite_gradient_ends_the_job_naming_the_parameter_and_worker():
    run = failing("errors.py", 2, 1, ["--case", "nonfinite"])
    assert_every_rank_says(run, r"NonFiniteError: .*the gradient of parameter '2\.weight' for "
                                r"global step 3 holds NaN or Inf, from workers \[1\] \(ranks "
                                r"\[1\]\); the step is not applied", EVERY_RANK)


def test_step_after_close_is_a_clear_error(refusals):
    records = records_of(refusals, "step_after_close")
    assert re.search(r"worker 1 \(rank 1[^)]*\): ClosedError: .*step\(\) called after "
                     r"close\(\)", records[1]["said"]), records
    assert records[1]["collective"] is False and records[0]["error"] is None, records
    assert {r["global_step"] for r in records.values()} == {3}


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
def test_worker_that_exits_without_close_still_ends_cleanly(refusals):
    # the refusals job's last case: its workers leave without close() (the job exited 0)
    (opt_id,) = {r["opt_id"] for r in records_of(refusals, "exit_without_close").values()}
    served = records_of(refusals, "served", [2, 3])
    assert {r["steps"][opt_id] for r in served.values()} == {20}
    assert all(len(r["steps"]) == opt_id + 1 for r in served.values())   # the last served


@pytest.mark.openmpi
def test_a_stalled_worker_ends_the_job_with_a_message_naming_it():
    # a timeout well above a first step on a loaded machine, below the stall's 30 s
    out = failed("stall", env={"MPISYNC_TIMEOUT": "12", "MPISYNC_STALL_WARNING": "2"})
    assert re.search(r"ps 0 \(rank 2[^)]*\): nothing arrived for \d+ s; .*computing: \[1\]",
                     out), out
    # the ps (no message) and worker 0 (no token) watch the same 12 s; either ends the job
    assert re.search(r"ps 0 \(rank 2[^)]*\): StallError: .*no message for 12 s"
                     r"|worker 0 \(rank 0[^)]*\): StallError: .*did not arrive within 12 s",
                     out), out
    assert "workers still computing: [1]" in out, out


@pytest.mark.parametrize("case", ["killed", "killed_ps"])
@pytest.mark.openmpi
def test_a_rank_that_dies_ends_the_whole_job(case):
    # SIGKILL leaves no excepthook and no MPI_Abort: the launcher must end the others,
    # and mpisync's launcher says what the status means; the shared memory between the
    # workers and the ps ranks goes with them. MPICH cannot survive a lost worker even when
    # asked (Open MPI can: tests/mpi/test_survive.py)
    before = set(os.listdir("/dev/shm"))
    survive = ["--survive-worker-loss"] if case == "killed" and mpi_flavor() == "mpich" else []
    env = dict(os.environ, MPISYNC_TIMEOUT="120", OMP_NUM_THREADS="1")
    job = run_job([sys.executable, "-m", "mpisync.launch", *survive, "--workers", "2", "--ps",
                   "2", "--timeout", "90", "--", *rank_python(4, env), str(SCRIPTS / "errors.py"),
                   "--case", case, "--num-ps", "2"], timeout=150, capture=True, env=env)
    assert job.returncode not in (0, 124), job.output
    assert re.search(r"signal 9|Killed", job.output), job.output
    assert re.search(r"mpisync\.launch: the job failed with exit status \d+: a rank ended by "
                     r"SIGKILL \(signal 9\) or without finishing MPI", job.output), job.output
    if survive:
        assert re.search(r"\[mpisync\] survive_worker_loss: this MPI \(MPICH.*\) cannot "
                         r"survive a lost rank \(only Open MPI with ULFM can\)",
                         job.output), job.output
    assert not {f for f in set(os.listdir("/dev/shm")) - before if "mpisync" in f}
