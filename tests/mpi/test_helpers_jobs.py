"""The distribution helpers: ``cluster.reduce``/``batch_reduce``/``broadcast``, metrics,
``colocate=``, ``opt.update`` and ``cluster.sampler``.

One job of 3 workers and 2 ps ranks (tests/scripts/helpers.py) runs every multi-rank check
and prints a record for each; the tests below read them, and train the ``opt.update``
model in one process here to compare. The rest runs in one process
(tests/unit/test_helpers.py): the reductions' rules on a communicator of one rank, metrics
read locally, the sampler's shares, the checks of functions given to ``opt.update``.
"""
from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, assert_every_rank_says, failing, labels, run_mpi

from mpisync.runtime import collectives

sys.path.insert(0, str(SCRIPTS))
import helpers as script

W = script.W


@pytest.fixture(scope="module")
def job():
    return run_mpi("helpers.py", W, 2, timeout=240)


def records(job, case: str) -> dict[int, dict]:
    got = {r["worker"]: r for r in job.results if r.get("case") == case}
    assert sorted(got) == list(range(W)) or case == "ps_reduce", (case, job.describe())
    return got


def test_every_worker_got_through_the_job(job):
    assert sorted(records(job, "done")) == list(range(W)), job.describe()


# -- reductions among the workers --------------------------------------------------------
@pytest.mark.parametrize("op", collectives.OPS)
@pytest.mark.parametrize("round_", range(3))
def test_reduce_equals_mpi_allreduce_of_the_same_values(job, op, round_):
    """Every dtype (f16, bf16, f32, f64, int, uint8, bool), 0-dim and empty tensors,
    Python and NumPy numbers, nests: MPI's own result, the same on every worker. Python
    ints beyond int64 are exact (as mpi4py's reduction of Python objects), the mean of
    int64 values whose sum wraps does not wrap, and NaN wins max and min (rounds 1 and 2:
    with the agreement and by MPI's Allreduce)."""
    for w, rec in records(job, f"reduce_{op}_{round_}").items():
        assert rec["bad"] == [], (w, rec["bad"])


@pytest.mark.parametrize("round_", range(3))
def test_batch_reduce_and_broadcast_between_steps(job, round_):
    for case in ("batch_reduce", "broadcast"):
        for w, rec in records(job, f"{case}_{round_}").items():
            assert rec["bad"] == [], (case, w, rec["bad"])
    for rec in records(job, "steps_between").values():
        assert rec["same_step"] and rec["global_step"] == 4 and rec["stats"] == [4, 4], rec


BAD = {  # case: (error, what its message must say)
    "shape": ("MismatchError", (r"workers \[1\] differ from worker 0 in the structure "
                               r"\(worker 1: tensor:float32\[4\]; worker 0: tensor:float32\[3\]")),
    "structure": ("MismatchError", r"workers \[2\] differ from worker 0 in the structure"),
    "dtype": ("MismatchError", r"workers \[1, 2\] .* tensor:float64\[3\]"),
    "op_differs": ("MismatchError", r"in the operation \(worker 1: 'mean'; worker 0: 'sum'\)"),
    "op_unknown": ("ConfigError", r"op must be one of .*got 'prod'"),
    "leaf": ("ConfigError", r"worker 2: value\[1\] is a str"),
    "complex_max": ("ConfigError", r"op='max' is not defined for complex"),
    "batch_not_a_list": ("ConfigError", r"values must be a list or tuple"),
    "big_structure": ("MismatchError", (r"workers \[2\] differ from worker 0 in the structure "
                                       r"\(worker 2: 41 parts, digest .* First difference: "
                                       r"part 18 of the structure is tensor:float32\[4\] on "
                                       r"worker 2, tensor:float32\[3\] on worker 0")),
    "src_range": ("ConfigError", r"src must be a worker index in range\(3\), got 3"),
    "src_differs": ("MismatchError", r"in src \(worker 1: 1; worker 0: 0\)"),
    "unpicklable": ("ConfigError", r"worker 1: its value cannot be broadcast"),
    "meta_on_one": ("ConfigError", (r"reduce\(\): worker 1: its value cannot be reduced: "
                                    r"NotImplementedError")),
    "meta_broadcast": ("ConfigError", (r"worker 1: its value cannot be broadcast: "
                                       r"NotImplementedError")),
    "uint64": ("ConfigError", r"value is of dtype uint64, which does not fit int64"),
    "other_collective": ("MismatchError", (r"the workers met for different collectives \(worker "
                                           r"0 in cluster\.reduce\(\), worker 1 in "
                                           r"worker_comm\.bcast\(\), worker 2 in "
                                           r"worker_comm\.bcast\(\)\)")),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_the_same_error_on_every_worker(job, case):
    error, pattern = BAD[case]
    for w, rec in records(job, f"bad_{case}").items():
        assert rec["error"] == error, (w, rec)
        assert re.search(pattern, rec["message"]), (w, rec["message"])


def test_the_same_collective_under_another_name_meets(job):
    got = records(job, "barrier_either_spelling")
    assert len(got) == 3 and all(rec["error"] is None for rec in got.values()), got


def test_after_bad_input_the_helpers_and_training_go_on(job):
    for rec in records(job, "after_bad").values():
        assert rec["bad"] == [], rec


def test_a_reduction_that_a_step_waits_for_fails_fast_on_every_worker():
    """Strict sync, worker 1 runs one step more while worker 0 reduces: the reduction meets
    the workers first, as worker_comm's collectives do, so both get a DeadlockError."""
    run = failing("errors.py", 2, 1, ["--case", "reduce_uneven"])
    assert_every_rank_says(run, r"DeadlockError: .*workers \[1\] wait inside step\(\) for "
                                r"global step \d+, which needs gradients from workers \[0\]",
                           labels(2, 0))
    assert "this worker is in cluster.reduce()" in run.output, run.describe()


def test_an_update_and_a_load_that_wait_for_each_other_fail_fast_on_every_worker():
    """Worker 0 registers a function (its workers meet first) while worker 1 loads a
    state: each waits for the other; both get a DeadlockError naming both calls."""
    run = failing("errors.py", 2, 1, ["--case", "update_vs_load"])
    assert_every_rank_says(run, r"DeadlockError: .*workers \[1\] wait in load_state_dict\(\) "
                                r"for every open worker to call it, but workers \[0\] are in a "
                                r"collective", labels(2, 0))
    assert "(this worker is in opt.update())" in run.output, run.describe()
    assert "TypeError" not in run.output, run.describe()


def test_a_ps_rank_is_refused(job):
    got = [r for r in job.results if r.get("case") == "ps_reduce"]
    assert len(got) == 2 and all(r["error"] == "RuntimeError" for r in got), got
    assert all("a collective among the workers" in r["message"] for r in got), got


# -- metrics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rnd", range(2))
def test_metrics_read_the_aggregate_of_every_workers_records(job, rnd):
    recs = [script.metric_records(w, rnd) for w in range(W)]
    losses = [x for r in recs for x in r["losses"]]
    values = torch.cat([r["values"] for r in recs]).double()
    weights = torch.cat([r["weights"] for r in recs]).double()
    correct = sum(int((r["scores"].argmax(1) == r["labels"]).sum()) for r in recs)
    expected = {"loss": sum(losses) / len(losses),              # not a mean of the means
                "weighted": float((values * weights).sum() / weights.sum()),
                "sum": sum(losses),
                "accuracy": correct / sum(len(r["labels"]) for r in recs)}
    mean_of_means = sum(sum(r["losses"]) / len(r["losses"]) for r in recs) / W
    assert not math.isclose(expected["loss"], mean_of_means)
    for w, rec in records(job, f"metric_{rnd}").items():
        for key, value in expected.items():
            assert rec[key] == pytest.approx(value, rel=1e-12), (w, key)
        mine = recs[w]["losses"]
        assert rec["local_loss"] == pytest.approx(sum(mine) / len(mine)), w


def test_metrics_without_records_and_bad_updates(job):
    for rec in records(job, "metric_empty").values():
        assert rec["mean"] == "nan" and rec["sum"] == 0.0, rec
    for case, error in (("metric_bad_weight", "ValueError"), ("metric_bad_value", "TypeError"),
                        ("metric_bad_shapes", "ValueError")):
        for rec in records(job, case).values():
            assert rec["error"] == error, rec


# -- colocation ------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["round_robin", "greedy", "greedy_sorted", "owner_is_odd"])
def test_a_group_shares_its_owner_under_every_strategy(job, strategy):
    for rec in records(job, f"colocate_{strategy}").values():
        assert len(set(rec["owners"])) == 1, rec["plan"]
        assert "colocated groups" in rec["plan"], rec["plan"]


def test_tables_and_partitioned_parameters_are_colocated_shard_by_shard(job):
    for rec in records(job, "colocated").values():
        assert rec["groups"] == [["emb_dense", "lin.weight", "lin.bias"],
                                 ["table.weight/part_0", "sparse.weight/part_0"],
                                 ["table.weight/part_1", "sparse.weight/part_1"]], rec
        assert all(len(set(owners)) == 1 for owners in rec["owners"]), rec


@pytest.mark.parametrize("case, message", [
    ("unknown", "no parameter or buffer is named 'nope'"),
    ("twice", "'0.bias' is in colocate groups 0 and 1"),
    ("shards", "'0.weight' is in 2 shards and '2.bias' whole"),
    ("differs", "worker 1 has colocate = "),
    ("not_a_list", "colocate group 0 must be a list of names"),
])
def test_an_impossible_colocation_fails_on_every_worker(job, case, message):
    for rec in records(job, f"colocate_{case}").values():
        assert rec["error"] == "ConfigError" and message in rec["message"], rec
    assert "setup failed on the workers" in job.output      # the ps ranks serve on


# -- opt.update ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process():
    return script.reference()


@pytest.mark.parametrize("dense", ["ps", "allreduce"])
def test_update_equals_one_process_applying_the_constraints_after_each_step(job, one_process,
                                                                            dense):
    """Max-norm on a dense embedding-like parameter, a partitioned one, a table (rows
    touched, after a first pass) and a sparse nn.Embedding; a clip registered between
    steps and removed later; the moving averages after the constraints. With
    ``dense="allreduce"`` the workers run the functions of the parameters they update."""
    for w, rec in records(job, f"update_{dense}").items():
        assert rec["global_step"] == script.STEPS
        for name, ref in one_process["params"].items():
            diff = (torch.tensor(rec["params"][name]) - torch.tensor(ref)).abs().max().item()
            assert diff <= 1e-6, (w, name, diff)
        assert sorted(rec["averages"]) == sorted(one_process["averages"])
        for name, ref in one_process["averages"].items():
            diff = (torch.tensor(rec["averages"][name]) - torch.tensor(ref)).abs().max().item()
            assert diff <= 1e-6, (w, "average", name, diff)


def test_the_constraints_hold_in_the_workers_copies(job):
    limits = {"emb_dense": 1.0, "part": 0.8, "table.weight": 0.7, "sparse.weight": 0.9}
    for rec in records(job, "update_ps").values():
        for name, limit in limits.items():
            norms = torch.tensor(rec["params"][name]).norm(dim=1)
            assert norms.max().item() <= limit + 1e-6, (name, norms.max())


def test_rows_touched_after_a_load_see_every_loaded_row_first(job):
    """A state loaded between steps brings back rows over the limit that the next step
    does not touch: the function of rows="touched" passes over every row once again."""
    for w, rec in records(job, "update_after_load").items():
        assert rec["norm"] <= 0.7 + 1e-6, (w, rec)


def test_a_function_applies_from_its_registration_until_its_removal(job):
    """The clip of "lin.*" ran after steps 2 and 3 only: neither never nor to the end."""
    got = torch.tensor(records(job, "update_ps")[0]["params"]["lin.weight"])
    for clip in ((0, 0), (script.CLIP_FROM, script.STEPS), (0, script.CLIP_UNTIL)):
        other = torch.tensor(script.reference(clip)["params"]["lin.weight"])
        assert (got - other).abs().max().item() > 1e-3, clip


UPDATE_BAD = {
    "update_lambda": ("ConfigError", "fn is a lambda"),
    "update_partial_of_lambda": ("ConfigError", ("fn partial(bad_updates.<locals>.<lambda>) "
                                                 "is defined inside a function")),
    "update_closure": ("ConfigError", "is defined inside a function"),
    "update_unknown_name": ("ConfigError", "'nope*' names none of the optimizer's parameters"),
    "update_frozen": ("ConfigError", "'frozen' is in no param group"),
    "update_rows": ("ConfigError", "rows must be one of"),
    "update_fails_on_stand_in": ("ConfigError", "fn raised ValueError: wanted a vector"),
    "update_differs": ("MismatchError", ("workers [1, 2] differ from worker 0 in registration 6 "
                                         "(worker 1: 'part' -> Clip")),
    "update_only_on_workers": ("ConfigError", ("the ps ranks cannot load a function given to "
                                              "opt.update(): AttributeError")),
}


@pytest.mark.parametrize("case", UPDATE_BAD)
def test_a_bad_update_is_refused_on_every_worker(job, case):
    error, message = UPDATE_BAD[case]
    for w, rec in records(job, case).items():
        assert rec["error"] == error and message in rec["message"], (w, rec)


# -- the sampler -----------------------------------------------------------------------------
def test_the_workers_share_every_epoch_exactly_once(job):
    recs = records(job, "sampler")
    epochs = [sorted(i for r in recs.values() for i in r["epochs"][e]) for e in range(2)]
    assert epochs == [list(range(10))] * 2
    assert [recs[w]["epochs"][0] for w in range(W)] != [recs[w]["epochs"][1] for w in range(W)]
    assert [recs[w]["length"] for w in range(W)] == [4, 3, 3]
    even = [recs[w]["even"] for w in range(W)]
    assert [len(e) for e in even] == [3, 3, 3] and len({i for e in even for i in e}) == 9
