"""Embedding tables on the ps ranks and sparse nn.Embedding weights, against plain torch.

One job (3 workers, 2 ps ranks) runs every case of tests/scripts/tables.py, one optimizer
after another, each twice: as given, and with ``dense="allreduce"`` (the dense head
averaged among the workers, the tables still on the ps ranks); this process trains each
case with a dense nn.Embedding in one process on the combined batch (torch's SparseAdam on
a sparse one) and compares the table and the dense parameters. The same job then trains a
table under backup workers, K-batch and async, measures what a step moves, and saves and
loads a table's state. Bad ids and a bad set-up are refused in one process
(tests/unit/test_tables.py), and in a second job (tests/scripts/tables_errors.py, 2 workers,
1 ps) on every worker, which catches each error and goes on, until a last id out of range,
not caught, ends it.
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, Run, assert_every_rank_says, failing, labels, run_mpi

sys.path.insert(0, str(SCRIPTS))
import tables_errors
from tables import ALLREDUCE, BY_NAME, CASES, OTHER, WORKERS, reference

TOLERANCE = 1e-5
DENSE = {"ps": "", "allreduce": ALLREDUCE}     # the name prefix of each dense= mode's run
NAMES = [prefix + c.name for prefix in DENSE.values() for c in CASES] + list(OTHER)


@pytest.fixture(scope="module")
def job():
    """Every case under both dense= modes, then the modes, the bytes and the state:
    ~15 s of start-up, ~3 s a case on a loaded machine."""
    run = run_mpi("tables.py", WORKERS, 2, NAMES, timeout=540)
    return run, run.by_case()


def ps_stats(run: Run, name: str) -> dict:
    """The statistics ps 0 (the coordinator) gave for the optimizer of case ``name``."""
    (record,) = [r for r in run.ps() if r["case"] == name and r["ps"] == 0]
    return record["stats"]


def test_every_case_ran_on_every_worker(job):
    run, _ = job
    run.assert_every_case_ran(NAMES, WORKERS, lambda name: None if name in OTHER
                              else BY_NAME[name.removeprefix(ALLREDUCE)].steps)
    # each ps rank served every optimizer, one a case
    assert [r["case"] for r in run.ps()] == NAMES * 2, run.describe()


@pytest.mark.parametrize("name", [c.name for c in CASES])
@pytest.mark.parametrize("dense", list(DENSE))
def test_table_matches_plain_torch(job, dense, name):
    _, by_case = job
    ref = reference(BY_NAME[name])
    for w, got in by_case[DENSE[dense] + name].items():
        table = torch.tensor(got["table"])
        diff = (table - torch.tensor(ref["table"])).abs().max().item()
        assert diff <= TOLERANCE, (name, w, "table", diff)
        for a, b in zip(got["head"], ref["head"]):
            diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
            assert diff <= TOLERANCE, (name, w, "head", diff)


# -- backup workers, K-batch and async -----------------------------------------------------
def test_backup_workers_drop_the_slow_workers_rows_and_hold_no_step_up(job):
    run, by_case = job
    assert sorted(by_case["mode-backup"]) == [0, 1, 2], run.describe()
    stats = ps_stats(run, "mode-backup")
    assert stats["gradients_dropped"] >= 1, run.describe()
    assert stats["dropped_per_worker"][2] >= 1, run.describe()
    # the fast workers were not held up: every step took both of theirs, none the slow one's
    assert stats["global_step"] == 12 and stats["taken_per_worker"][:2] == [12, 12], \
        run.describe()
    assert stats["gradients_applied"] == 2 * stats["global_step"], run.describe()


@pytest.mark.parametrize("mode, per_step", [("kbatch", 4), ("async", 1)])
def test_kbatch_and_async_with_a_table(job, mode, per_step):
    run, _ = job
    stats = ps_stats(run, f"mode-{mode}")
    assert stats["gradients_applied"] == per_step * stats["global_step"], run.describe()
    assert stats["global_step"] >= 1, run.describe()
    # 8 pushes per worker at most (a worker stops early once the others closed)
    assert sum(stats["taken_per_worker"]) + stats["gradients_dropped"] + \
        stats["gradients_pending"] <= 24, run.describe()


# -- what travels and what a worker holds ---------------------------------------------------
def test_a_step_moves_rows_not_the_table(job):
    _, by_case = job
    for w, got in by_case["moves-rows"].items():
        assert got["bytes_per_step"] < 0.01 * got["table_bytes"], (w, got)


@pytest.mark.slow
def test_a_workers_memory_does_not_grow_with_the_table():
    """One job trains a table of 10^5 rows, then one of 10^7: each worker's peak memory
    (its high-water mark, read after each) may not grow by the bigger table's 320 MB."""
    run = run_mpi("tables_modes.py", 2, 1, ["--sizes", f"{10**5},{10**7}", "--steps", "3"],
                  timeout=480)
    by_case = run.by_case()
    small, big = by_case[f"rows-{10**5}"], by_case[f"rows-{10**7}"]
    for w in (0, 1):
        grew = big[w]["peak_rss_mb"] - small[w]["peak_rss_mb"]
        assert grew < 100, (w, grew, big[w], small[w])


# -- saving and loading tables --------------------------------------------------------------
def test_tables_and_their_state_save_and_load_exactly(job):
    run, by_case = job
    workers = by_case["state"]
    assert sorted(workers) == list(range(WORKERS)), run.describe()
    for got in workers.values():
        assert got["reloaded"] and got["same"], run.describe()
        assert got["global_step"] == 6 and got["shards"] == [14, 13, 13]   # 3 + 3 after loading
    # the saved table and Adagrad state are those of plain torch on the combined batch
    import tables_state as ts
    torch.manual_seed(0)
    weight = torch.zeros(ts.ROWS, ts.DIM)
    for shard_rows, k in ((14, 0), (13, 1), (13, 2)):
        g = torch.Generator().manual_seed(4 * 1_000_003 + k)
        weight[torch.arange(shard_rows) * 3 + k] = torch.randn(shard_rows, ts.DIM, generator=g)
    emb = torch.nn.Embedding(ts.ROWS, ts.DIM, _weight=weight)
    torch.manual_seed(0)                # mpisync.Embedding draws nothing from torch's seed
    head = torch.nn.Linear(ts.DIM, 1)
    opt = torch.optim.Adagrad([*emb.parameters(), *head.parameters()], lr=0.2)
    data = [ts.batches(w) for w in range(WORKERS)]
    for t in range(ts.STEPS):
        ids = torch.cat([d[t][0] for d in data])
        y = torch.cat([d[t][1] for d in data])
        opt.zero_grad()
        torch.nn.functional.mse_loss(head(emb(ids)), y).backward()
        opt.step()
    got = workers[0]
    assert (torch.tensor(got["saved_weight"]) - emb.weight).abs().max() <= 1e-6
    assert (torch.tensor(got["saved_sum"]) - opt.state[emb.weight]["sum"]).abs().max() <= 1e-6


# -- bad input in a job: every worker refuses it and goes on; the last one ends the job ---
@pytest.fixture(scope="module")
def errors():
    """The job of tests/scripts/tables_errors.py: its records by case, and what the ranks
    said (its RESULT lines left out). MPISYNC_TIMEOUT is above the timeout, so that a
    failure noticed only as a stall fails the test instead of ending the job non-zero."""
    run = failing("tables_errors.py", 2, 1, timeout=150, env={"MPISYNC_TIMEOUT": "300"})
    said = "".join(line for line in run.stdout.splitlines(keepends=True)
                   if not line.startswith("RESULT "))
    return run, run.by_case(), Run(run.returncode, said, run.stderr, [], run.command)


def test_every_bad_input_case_ran_on_every_worker(errors):
    run, by_case, _ = errors
    assert sorted(by_case) == sorted([*tables_errors.BAD_IDS, *tables_errors.BAD_SET_UP,
                                      "left_out", "retry"]), run.describe()
    for name, records in by_case.items():
        assert sorted(records) == [0, 1], (name, run.describe())
        # each worker went on training after the error, to the last step
        assert {r["global_step"] for r in records.values()} == {tables_errors.STEPS}, name


#: the cause each worker gives (``{w}``: its index), as every rank said it when it ended
#: the job; and a pattern every rank's message matched then
BAD_ID_CAUSES = [
    ("out_of_range", (r"IndexError: worker {w} \(rank {w}[^)]*\): mpisync\.Embedding "
                      r"'emb\.weight' got id 50, outside \[0, 50\)")),
    ("negative", (r"IndexError: worker {w} \(rank {w}[^)]*\): mpisync\.Embedding 'emb\.weight' "
                  r"got id -1, outside \[0, 50\)")),
    ("float_ids", (r"TypeError: worker {w} \(rank {w}[^)]*\): mpisync\.Embedding 'emb\.weight' "
                   r"got ids of dtype torch\.float32; expected an integer dtype")),
    ("int16_ids", (r"TypeError: worker {w} \(rank {w}[^)]*\): mpisync\.Embedding 'emb\.weight' "
                   r"got ids of dtype torch\.int16; expected an integer dtype")),
]
BAD_ID_SAID = (r"(IndexError|TypeError|stopping because worker 1 \(rank 1 on [^)]*\) failed: "
               r"(IndexError|TypeError)): .*'emb\.weight'")


@pytest.mark.parametrize("case, cause", BAD_ID_CAUSES, ids=[c for c, _ in BAD_ID_CAUSES])
def test_bad_ids_are_refused_on_every_worker_naming_the_table_and_the_rank(errors, case,
                                                                           cause):
    run, by_case, _ = errors
    assert sorted(by_case[case]) == [0, 1], run.describe()
    for w, record in by_case[case].items():
        assert re.search(cause.replace("{w}", str(w)), record["error"]), (w, run.describe())
        assert re.search(BAD_ID_SAID, record["error"]), (w, record)


def test_an_uncaught_bad_id_ends_the_job_on_every_rank_naming_the_table_and_the_rank(errors):
    run, _, said = errors
    assert re.search(BAD_ID_CAUSES[0][1].replace("{w}", "1"), said.output), run.describe()
    assert_every_rank_says(said, BAD_ID_SAID, labels(2, 1))


@pytest.mark.parametrize("case, cause, told", [
    ("bad_strategy", (r"ValueError: partition_strategy must be one of \('mod', 'div'\), got "
                      r"'hash'"), False),
    ("zero_dim", (r"ConfigError: .*partitioner fixed_size\(2\) for parameter 'scale': .*"
                  r"0-dimensional"), True),
    ("weight_differs", (r"ConfigError: .*worker 1 \(rank 1\): mpisync\.Embedding "
                        r"'emb\.weight': weight= has shape \[51, 4\], the table is \[50, 4\]"),
     True),
], ids=list(tables_errors.BAD_SET_UP))
def test_bad_set_up_is_refused_on_every_rank(errors, case, cause, told):
    """On every worker (a set-up refused by one is refused by all: ConfigError naming the
    worker that found it), and on the ps rank, told by the chief, when the optimizer's
    set-up failed (a table made with bad arguments never reaches one)."""
    run, by_case, said = errors
    pattern = r"(" + cause + r"|stopping because .*" + cause.split(":")[0] + r")"
    assert sorted(by_case[case]) == [0, 1], run.describe()
    for w, record in by_case[case].items():
        assert re.search(pattern, record["error"]), (w, run.describe())
        if case != "bad_strategy":
            assert record["error"].startswith(f"ConfigError: worker {w} (rank {w}"), record
    if told:
        assert_every_rank_says(said, pattern, labels(2, 1)[2:])


def test_a_table_the_optimizer_does_not_hold_is_refused_at_lookup_saying_what_to_do(errors):
    run, by_case, _ = errors
    assert sorted(by_case["left_out"]) == [0, 1], run.describe()
    for w, record in by_case["left_out"].items():
        assert re.match(rf"RuntimeError: worker {w} \(rank {w}[^)]*\): mpisync\.Embedding "
                        r"'emb\.weight' is in none of the param groups of the torch optimizer "
                        r"given to this worker's SyncReplicasOptimizer, .*give its weight to "
                        r"the torch optimizer", record["error"]), (w, record)


def test_a_worker_that_catches_a_set_up_error_can_set_up_again(errors):
    run, _, said = errors
    assert re.search(r"ps 0 \(rank 2[^)]*\): ConfigError: setup failed on the workers: .*"
                     r"'scale'.*serving on", said.output), run.describe()
    for w in (0, 1):
        assert f"worker {w}: set up again without the partitioner" in said.output
        assert f"worker {w}: trained to step 4" in said.output, run.describe()
