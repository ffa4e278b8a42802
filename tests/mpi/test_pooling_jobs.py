"""EmbeddingBag as torch takes it, bags pooled where the rows live, several tables at once.

One-process tests (tests/unit/test_pooling.py) check the bags and the pooled messages
against ``nn.EmbeddingBag(sparse=True)``, and every bad bag's message. One MPI job (2
workers, 2 ps ranks) runs every case of tests/scripts/pooling.py: the rows path and the
pooled path trained side by side, the collection beside separate tables, and the bytes of
a step. A
second (tests/scripts/pooling_errors.py, 2 workers, 1 ps) gives every bad bag, and a
collection a feature too few or too many, on every worker, which catches each error and
goes on, until a feature left out, not caught, ends it.
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, Run, assert_every_rank_says, failing, labels, run_mpi

sys.path.insert(0, str(SCRIPTS))
import pooling as script
import pooling_errors
from pooling_errors import BAD


# -- the MPI job: rows against pooled, the collection, the bytes ---------------------------
@pytest.fixture(scope="module")
def job():
    run = run_mpi("pooling.py", script.WORKERS, 2, script.NAMES, timeout=300)
    modes = {c.name for c in script.MODES}
    return run.assert_every_case_ran(script.NAMES, script.WORKERS,
                                     lambda name: 2 if name.startswith("bytes-")
                                     else None if name in modes else script.STEPS)


@pytest.mark.parametrize("name", [c.name for c in script.CASES])
def test_pooled_path_trains_as_the_rows_path_and_as_torch(job, name):
    ref = torch.tensor(script.reference(script.BY_NAME[name]))
    for w, got in job[name].items():
        rows, pooled = torch.tensor(got["rows"]), torch.tensor(got["pooled"])
        assert (rows - pooled).abs().max() <= 1e-6, (name, w)
        assert max(got["heads"]) <= 1e-6, (name, w)
        assert (rows - ref).abs().max() <= 1e-5, (name, w)
        assert (rows - script.initial_table()).abs().max() > 1e-3   # it trained


@pytest.mark.parametrize("name", [c.name for c in script.MODES])
def test_pooled_path_trains_as_the_rows_path_under_every_mode(job, name):
    """Backup workers (1 of 2 gradients a step), K-batch (3 a step from 2 workers) and
    async: the pooled copy equals the rows copy after the same taken pushes (read by the
    chief once the other worker closed)."""
    for w, got in job[name].items():
        assert max(got["heads"]) <= 1e-6, (name, w)
    got = job[name][0]
    rows, pooled = torch.tensor(got["rows"]), torch.tensor(got["pooled"])
    assert (rows - pooled).abs().max() <= 1e-6, name
    assert (rows - script.initial_table()).abs().max() > 1e-3   # it trained
    steps, applied, dropped, pushed = got["steps"], got["applied"], got["dropped"], got["pushed"]
    assert steps >= 1 and applied + dropped <= pushed, got
    if name == "kbatch":
        assert steps <= applied <= 3 * steps, got
    else:                       # one gradient a step; async drops none
        assert applied == steps and (name != "async" or applied == pushed), got


def test_a_collection_trains_as_separate_tables_in_one_lookup_per_ps(job):
    for w, got in job["collection"].items():
        assert max(got["diff"].values()) <= 1e-6, (w, got["diff"])
        # per ps and step: one message for the collection's three tables, one per table apart
        for sent, expected in got["lookups_per_ps"]:
            assert sent == expected, (w, got["lookups_per_ps"])
        assert max(sum(s) for s, _ in got["lookups_per_ps"]) >= 7, got["lookups_per_ps"]


def test_pooled_bytes_are_a_quarter_of_the_rows_for_bags_of_20(job):
    for w in range(script.WORKERS):
        rows = job["bytes-rows"][w]["bytes_per_step"]
        pooled = job["bytes-pooled"][w]["bytes_per_step"]
        assert max(pooled) * 4 <= min(rows), (w, rows, pooled)


# -- bad input in a job: every worker refuses it and goes on; the last one ends the job ---
@pytest.fixture(scope="module")
def errors():
    """The job of tests/scripts/pooling_errors.py: its records by case, and what the ranks
    said (its RESULT lines left out). MPISYNC_TIMEOUT is above the timeout, so that a
    failure noticed only as a stall fails the test instead of ending the job non-zero."""
    run = failing("pooling_errors.py", 2, 1, timeout=150, env={"MPISYNC_TIMEOUT": "300"})
    said = "".join(line for line in run.stdout.splitlines(keepends=True)
                   if not line.startswith("RESULT "))
    return run, run.by_case(), Run(run.returncode, said, run.stderr, [], run.command)


def test_every_bad_bag_is_refused_on_every_worker_and_training_goes_on(errors):
    run, by_case, _ = errors
    assert sorted(by_case) == sorted([f"bag-{n}" for n in range(len(BAD))]
                                     + ["missing_feature", "unknown_feature"]), run.describe()
    for n, (*_, message) in enumerate(BAD):
        assert sorted(by_case[f"bag-{n}"]) == [0, 1], run.describe()
        for w, record in by_case[f"bag-{n}"].items():
            assert re.match(rf"(ValueError|TypeError): worker {w} \(rank {w}[^)]*\): "
                            r"mpisync\.EmbeddingBag 'emb\.weight' got " + message,
                            record["error"]), (n, w, record)
            assert record["global_step"] == pooling_errors.STEPS, record


#: the cause each worker gives (``{w}``: its index), as every rank said it when it ended
#: the job; the case of BAD that gives it
@pytest.mark.parametrize("case, cause", [
    ("bag-0", (r"ValueError: worker {w} \(rank {w}[^)]*\): mpisync\.EmbeddingBag "
               r"'emb\.weight' got per_sample_weights with mode='mean'")),
    ("bag-2", (r"ValueError: worker {w} \(rank {w}[^)]*\): mpisync\.EmbeddingBag "
               r"'emb\.weight' got offsets that decrease")),
], ids=["psw_mean", "offsets_decrease"])
def test_bad_bags_are_refused_on_every_worker_naming_the_table_and_the_rank(errors, case,
                                                                            cause):
    run, by_case, _ = errors
    assert sorted(by_case[case]) == [0, 1], run.describe()
    for w, record in by_case[case].items():
        assert re.search(cause.replace("{w}", str(w)), record["error"]), run.describe()
        assert re.search(r"(ValueError|stopping because worker 1 \(rank 1 on [^)]*\) "
                         r"failed: ValueError): .*'emb\.weight'", record["error"]), record


def test_a_collection_refuses_a_feature_left_out_or_unknown_on_every_worker(errors):
    _, by_case, _ = errors
    for w, record in by_case["missing_feature"].items():
        assert re.match(rf"KeyError: [\"']worker {w} \(rank {w}[^)]*\): "
                        r"mpisync\.EmbeddingBagCollection got no input for features \['b'\]",
                        record["error"]), record
        assert record["global_step"] == pooling_errors.STEPS, record
    for w, record in by_case["unknown_feature"].items():
        assert re.match(rf"KeyError: [\"']worker {w} \(rank {w}[^)]*\): "
                        r"mpisync\.EmbeddingBagCollection got features \['c'\] that have no "
                        r"table here; the tables are \['a', 'b'\]", record["error"]), record
    assert sorted(by_case["missing_feature"]) == sorted(by_case["unknown_feature"]) == [0, 1]


def test_a_feature_left_out_of_a_collection_ends_the_job_naming_it(errors):
    """As TorchRec's (a KeyError), not silently: uncaught, the job ends on every rank."""
    run, _, said = errors
    assert re.search(r"KeyError: [\"']?worker 1 \(rank 1[^)]*\): mpisync\.EmbeddingBagCollection "
                     r"got no input for features \['b'\]", said.output), run.describe()
    assert_every_rank_says(said, r"(KeyError|stopping because worker 1 \(rank 1 on [^)]*\) "
                                 r"failed: KeyError): .*features \['b'\]", labels(2, 1))
