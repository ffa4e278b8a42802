"""Bad input, case by case: a clear error naming what was wrong and the rank, on every rank
it reaches, no hang, and nothing already done lost.

Most cases run in one MPI job (tests/scripts/bad_input.py, 2 workers and 1 ps rank, at
MPI_THREAD_SINGLE) in which every worker catches the error and goes on; the ones that end a
job have their own; what needs no second rank runs in one process
(tests/unit/test_bad_input.py).
"""
from __future__ import annotations

import re

import pytest
from mpi4py import MPI
from mpi_helpers import assert_every_rank_says, failing, labels, run_mpi

import mpisync
from mpisync.protocol.wire import WIRE_VERSION
from mpisync.worker import devices

WORKERS = (0, 1)


@pytest.fixture(scope="module")
def job():
    """The one job of many cases: {case: {rank: record}}, and its output."""
    run = run_mpi("bad_input.py", 2, 1, ["--thread-level", "single"], timeout=240)
    cases: dict[str, dict[int, dict]] = {}
    for r in run.results:
        cases.setdefault(r["case"], {})[r["rank"]] = r
    return cases, run


def errors_of(job, case: str, ranks=WORKERS) -> dict[int, str]:
    cases, run = job
    assert sorted(cases.get(case, {})) == sorted(ranks), (case, run.describe())
    return {r: cases[case][r]["error"] for r in ranks}


def assert_refused_everywhere(job, case: str, pattern: str, kind: str = "ConfigError"):
    """Every worker raised ``kind`` naming itself and the cause; the ps said why set-up
    failed and served on."""
    for w, error in errors_of(job, case).items():
        assert error is not None, (case, w)
        assert re.match(rf"{kind}: worker {w} \(rank {w} on [^)]*\): .*{pattern}", error), error
    assert re.search(rf"ps 0 \(rank 2 on [^)]*\): {kind}: setup failed on the workers: .*"
                     rf"{pattern}.*\(serving on", job[1].output), (case, job[1].describe())


def assert_refused_at_step(job, case: str, pattern: str, kind: str):
    """Every worker raised ``kind`` in step(), before sending anything: the ps ranks still
    hold the parameters of before, and two more steps after the repair count."""
    assert sorted(job[0].get(case, {})) == list(WORKERS), (case, job[1].describe())
    for w, record in job[0][case].items():
        assert re.match(rf"{kind}: worker {w} \(rank {w} on [^)]*\): .*{pattern}",
                        record["error"]), record
        assert record["unchanged"] is True, record
        assert (record["step_at_error"], record["global_step"]) == (2, 4), record


# -- init and the world --------------------------------------------------------------------
def test_ranks_that_run_different_mpisync_versions_are_refused_naming_both(job):
    for rank, error in errors_of(job, "version_differs", (0, 1, 2)).items():
        assert error == (f"ConfigError: rank {rank}: every rank must run the same mpisync: "
                         f"rank 1 runs mpisync 0.0.1 (wire format {WIRE_VERSION}) where rank 0 "
                         f"runs mpisync {mpisync.__version__} (wire format {WIRE_VERSION})")


def test_ranks_with_different_wire_formats_are_refused_naming_both(job):
    for rank, error in errors_of(job, "wire_differs", (0, 1, 2)).items():
        assert re.fullmatch(rf"ConfigError: rank {rank}: every rank must run the same mpisync: "
                            rf"rank 2 runs mpisync \S+ \(wire format {WIRE_VERSION + 1}\) where "
                            rf"rank 0 runs mpisync \S+ \(wire format {WIRE_VERSION}\)",
                            error), error


def test_init_twice_is_refused_on_every_rank(job):
    for rank, error in errors_of(job, "init_twice", (0, 1, 2)).items():
        who = f"worker {rank}" if rank < 2 else "ps 0"
        assert re.fullmatch(rf"RuntimeError: {who} \(rank {rank} on [^)]*\): mpisync\.init\(\) "
                            r"was called already on this rank; .*", error), error


def test_cuda_aware_required_of_an_mpi_without_cuda_is_refused_on_every_rank(job):
    supported, how = devices.cuda_support(MPI.COMM_SELF)
    if supported:
        pytest.skip(f"this MPI takes CUDA buffers ({how})")
    library = re.escape(devices.mpi_library())
    for rank, error in errors_of(job, "cuda_aware_required", (0, 1, 2)).items():
        assert re.fullmatch(rf"ConfigError: rank {rank}: cuda_aware=True but the MPI library "
                            rf"'{library}' is not CUDA-aware on this rank \(.*\); the MPI wheels "
                            r"from PyPI never are\. .*", error), error


# -- set-up refused on every worker, said on the ps rank -----------------------------------
def test_replicas_to_aggregate_that_is_not_an_int_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "replicas_not_int",
                              r"replicas_to_aggregate must be an int, got '2'")


def test_total_num_replicas_other_than_the_workers_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "total_not_workers",
                              r"total_num_replicas=5 but the job has 2 worker ranks")


def test_parameters_without_names_are_refused_on_every_rank(job):
    assert_refused_everywhere(job, "named_parameters_not_pairs",
                              r"named_parameters must yield \(name, tensor\) pairs.*item #0 is "
                              r"a Parameter \(model\.parameters\(\) where "
                              r"model\.named_parameters\(\) belongs\?\)")


def test_a_named_parameter_that_is_not_a_tensor_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "named_not_tensor",
                              r"named_parameters item 'temperature' is a float, not a tensor")


def test_duplicate_names_are_refused_on_every_rank(job):
    assert_refused_everywhere(job, "duplicate_names", r"name 'w' appears twice")


def test_a_parameter_on_the_meta_device_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "meta_parameter",
                              r"'0\.weight' is on the meta device \(shapes only, no values\); "
                              r"materialise the model on its device")


def test_an_empty_model_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "empty_model", r"named_parameters is empty")


def test_horovod_without_mpi_thread_multiple_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "horovod_without_threads",
                              r"allreduce_backend='horovod' needs MPI initialised with "
                              r"MPI_THREAD_MULTIPLE .* but MPI runs with MPI_THREAD_SINGLE")


def test_a_second_optimizer_over_an_open_ones_parameter_is_refused_the_first_goes_on(job):
    assert_refused_everywhere(job, "shared_parameter",
                              r"parameter '0\.weight' is held by SyncReplicasOptimizer #\d+ "
                              r"too, which is open")
    assert {r["global_step"] for r in job[0]["shared_parameter"].values()} == {4}


def test_optimizers_created_in_different_orders_are_refused_on_every_rank(job):
    assert_refused_everywhere(job, "orders_differ",
                              r"worker 1 \(rank 1\) has parameter #0 = '0\.weight' shape "
                              r"\[16, 10\] torch\.float32 but worker 0 has '0\.weight' shape "
                              r"\[32, 10\]", kind="ModelMismatchError")
    for record in job[0]["orders_differ"].values():
        assert record["second"].startswith("ModelMismatchError"), record


# -- refused at step(), before anything is sent ---------------------------------------------
@pytest.mark.parametrize("case, kind, pattern", [
    pytest.param("groups_appended", "ConfigError", r"the param groups changed after the "
                 r"SyncReplicasOptimizer was created \('a parameter not in named_parameters' "
                 r"added\)", id="a parameter appended to a param group"),
    pytest.param("groups_removed", "ConfigError", r"the param groups changed .*\('2\.bias' "
                 r"removed\)", id="a parameter removed from a param group"),
    pytest.param("dtype_changed", "TypeError", r"parameter '0\.weight' became a "
                 r"torch\.float64 tensor of shape \[32, 10\] on cpu",
                 id="p.data = p.data.double()"),
    pytest.param("model_half", "TypeError", r"parameter '0\.weight' became a torch\.float16 "
                 r"tensor", id="model.half(), then back to float"),
    pytest.param("model_to_meta", "ConfigError", r"the model no longer holds parameters "
                 r"\['0\.weight', '0\.bias', '2\.weight', '2\.bias'\] of this "
                 r"SyncReplicasOptimizer: they were replaced", id="model.to('meta')"),
])
def test_a_model_changed_under_the_optimizer_is_refused_at_step(job, case, kind, pattern):
    assert_refused_at_step(job, case, pattern, kind)


def test_a_gradient_of_the_wrong_shape_is_refused_at_step(job):
    assert_refused_at_step(job, "grad_shape", r"the gradient of parameter '0\.weight' is "
                           r"torch\.float32 \[10\], the parameter torch\.float32 \[32, 10\]",
                           "ValueError")


def test_an_unknown_nonfinite_policy_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "nonfinite_unknown",
                              r"nonfinite must be one of \('raise', 'skip'\), got 'ignore'")


def test_a_nonfinite_gradient_with_skip_drops_the_step_and_training_goes_on(job):
    for record in job[0]["nonfinite_skip"].values():
        assert record["error"] is None and record["skipped"] == [2], record
        assert record["global_step"] == 5 and record["matches"] is True, record


def test_a_nonfinite_allreduced_gradient_raises_on_every_worker_and_training_goes_on(job):
    assert sorted(job[0].get("nonfinite_allreduce", {})) == list(WORKERS), job[1].describe()
    for w, record in job[0]["nonfinite_allreduce"].items():
        assert re.fullmatch(rf"NonFiniteError: worker {w} \(rank {w} on [^)]*\): the gradient of "
                            r"parameter '2.weight' for global step 2, averaged over the workers "
                            r"\(dense='allreduce'\), holds NaN or Inf; the step is not applied "
                            r"\(nonfinite='raise'\)", record["error"]), record
        assert record["unchanged"] is True and record["global_step"] == 4, record


def test_nonfinite_skip_with_allreduce_is_refused_on_every_rank(job):
    assert_refused_everywhere(job, "nonfinite_skip_allreduce",
                              r"nonfinite='skip' needs dense='ps': with dense='allreduce'")


# -- accepted, as torch accepts it ---------------------------------------------------------
def test_step_before_any_backward_updates_nothing_as_torch(job):
    for record in job[0]["step_before_backward"].values():
        assert record["error"] is None and record["unchanged"] is True, record
        assert record["state"] == 0 and record["global_step"] == 3, record   # no momentum yet


def test_close_twice_is_harmless(job):
    for record in job[0]["close_twice"].values():
        assert record["error"] is None and record["same_stats"] is True, record
        assert record["global_step"] == 3


def test_state_dict_zero_grad_and_load_after_close_are_clear_errors(job):
    for w, record in job[0]["used_after_close"].items():
        for key, call in (("error", "state_dict"), ("zero_grad", "zero_grad"),
                          ("load", "load_state_dict")):
            assert re.fullmatch(rf"ClosedError: worker {w} \(rank {w} on [^)]*\): {call}\(\) "
                                r"called after close\(\)", record[key]), record


def test_state_dict_on_one_worker_only_reads_the_state_without_holding_anyone_up(job):
    records = job[0]["state_dict_on_one_worker"]
    assert records[0]["read_at"] == 2                  # its own step, the one it had
    assert {r["global_step"] for r in records.values()} == {5}


def test_load_state_dict_on_one_worker_only_fails_on_both_instead_of_hanging(job):
    for record in job[0]["load_on_one_worker"].values():
        assert re.fullmatch(
            r"DeadlockError: ps 0 \(rank 2 on [^)]*\): " + re.escape(
                "workers [0] wait in load_state_dict() for every open worker to call it, but "
                "workers [1] wait inside step() for global step 2: call load_state_dict() on "
                "every worker at the same point, before training or between two steps"),
            record["error"]), record


def test_the_job_ends_cleanly_after_every_case(job):
    """cluster.close() frees the communicators with nothing left unread, on every rank."""
    assert errors_of(job, "cluster_close", (0, 1, 2)) == {0: None, 1: None, 2: None}
    (served,) = job[0]["served"].values()
    # every optimizer that was set up, in order, with the global step it ended at
    assert served["steps"] == [4, 4, 4, 4, 4, 4, 4, 5, 4, 3, 3, 1, 5, 2]


# -- the ps side ---------------------------------------------------------------------------
def test_a_message_too_large_for_a_ps_rank_ends_the_job_with_a_protocol_error():
    run = failing("malformed.py", 2, 1, timeout=90)
    cause = (r"ProtocolError: ps 0 \(rank 2 on [^)]*\): worker 0 sent a message larger than "
             r"a gradient header of \d+ bytes; every rank must run the same mpisync")
    assert re.search(r"ps 0 \(rank 2 on [^)]*\): " + cause, run.output), run.describe()
    assert_every_rank_says(run, r"(stopping because ps 0 \(rank 2 on [^)]*\) failed: )?"
                                + cause, labels(2, 1))
