"""Embedding tables on the ps ranks and sparse nn.Embedding weights, against plain torch.

One job (3 workers, 2 ps ranks) runs every case of tests/scripts/tables.py, one optimizer
after another; this process trains each case with a dense nn.Embedding in one process on
the combined batch (torch's SparseAdam on a sparse one) and compares the table and the
dense parameters. A second job runs them with ``dense="allreduce"``: the dense head
averaged among the workers, the tables still on the ps ranks.
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, assert_every_rank_says, failing, labels, run_mpi

sys.path.insert(0, str(SCRIPTS))
from tables import BY_NAME, CASES, WORKERS, reference

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["ps", "allreduce"])
def job(request):
    dense = [] if request.param == "ps" else [f"--dense={request.param}"]
    run = run_mpi("tables.py", WORKERS, 2, dense + [c.name for c in CASES], timeout=300)
    return run, run.by_case()


def test_every_case_ran_on_every_worker(job):
    run, _ = job
    run.assert_every_case_ran([c.name for c in CASES], WORKERS,
                              lambda name: BY_NAME[name].steps)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_table_matches_plain_torch(job, name):
    _, by_case = job
    ref = reference(BY_NAME[name])
    for w, got in by_case[name].items():
        table = torch.tensor(got["table"])
        diff = (table - torch.tensor(ref["table"])).abs().max().item()
        assert diff <= TOLERANCE, (name, w, "table", diff)
        for a, b in zip(got["head"], ref["head"]):
            diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
            assert diff <= TOLERANCE, (name, w, "head", diff)


# -- backup workers, K-batch and async -----------------------------------------------------
def test_backup_workers_drop_the_slow_workers_rows_and_hold_no_step_up():
    run = run_mpi("tables_modes.py", 3, 2, ["--mode", "backup", "--steps", "12"], timeout=180)
    workers = run.by_worker()
    assert sorted(workers) == [0, 1, 2], run.describe()
    stats = run.ps()[0]["stats"]
    assert stats["gradients_dropped"] >= 1, run.describe()
    assert stats["dropped_per_worker"][2] >= 1, run.describe()
    # the fast workers were not held up: every step took both of theirs, none the slow one's
    assert stats["global_step"] == 12 and stats["taken_per_worker"][:2] == [12, 12], \
        run.describe()
    assert stats["gradients_applied"] == 2 * stats["global_step"], run.describe()


@pytest.mark.parametrize("mode, per_step", [("kbatch", 4), ("async", 1)])
def test_kbatch_and_async_with_a_table(mode, per_step):
    run = run_mpi("tables_modes.py", 3, 2, ["--mode", mode, "--steps", "8"], timeout=180)
    stats = run.ps()[0]["stats"]
    assert stats["gradients_applied"] == per_step * stats["global_step"], run.describe()
    assert stats["global_step"] >= 1, run.describe()
    # 8 pushes per worker at most (a worker stops early once the others closed)
    assert sum(stats["taken_per_worker"]) + stats["gradients_dropped"] + \
        stats["gradients_pending"] <= 24, run.describe()


# -- what travels and what a worker holds ---------------------------------------------------
def test_a_step_moves_rows_not_the_table():
    run = run_mpi("tables_modes.py", 2, 2, ["--rows", str(10**6), "--ids", "100"], timeout=180)
    for w, got in run.by_worker().items():
        assert got["bytes_per_step"] < 0.01 * got["table_bytes"], (w, got)


@pytest.mark.slow
def test_a_workers_memory_does_not_grow_with_the_table():
    small = run_mpi("tables_modes.py", 2, 1, ["--rows", str(10**5), "--steps", "3"], timeout=180)
    big = run_mpi("tables_modes.py", 2, 1, ["--rows", str(10**7), "--steps", "3"], timeout=300)
    for w in (0, 1):
        grew = big.by_worker()[w]["peak_rss_mb"] - small.by_worker()[w]["peak_rss_mb"]
        assert grew < 100, (w, grew, big.by_worker()[w], small.by_worker()[w])


# -- bad input: a clear error on every rank, no hang ----------------------------------------
@pytest.mark.parametrize("case, cause", [
    ("out_of_range", (r"IndexError: worker 1 \(rank 1[^)]*\): mpisync\.Embedding 'emb\.weight' "
                      r"got id 50, outside \[0, 50\)")),
    ("negative", (r"IndexError: worker 1 \(rank 1[^)]*\): mpisync\.Embedding 'emb\.weight' got "
                  r"id -1, outside \[0, 50\)")),
    ("float_ids", (r"TypeError: worker 1 \(rank 1[^)]*\): mpisync\.Embedding 'emb\.weight' got "
                   r"ids of dtype torch\.float32; expected an integer dtype")),
    ("int16_ids", (r"TypeError: worker 1 \(rank 1[^)]*\): mpisync\.Embedding 'emb\.weight' got "
                   r"ids of dtype torch\.int16; expected an integer dtype")),
])
def test_bad_ids_end_the_job_naming_the_table_and_the_rank(case, cause):
    run = failing("tables_errors.py", 2, 1, ["--case", case])
    assert re.search(cause, run.output), run.describe()
    assert_every_rank_says(run, r"(IndexError|TypeError|stopping because worker 1 \(rank 1 on "
                                r"[^)]*\) failed: (IndexError|TypeError)): .*'emb\.weight'",
                           labels(2, 1))


@pytest.mark.parametrize("case, cause", [
    ("bad_strategy", (r"ValueError: partition_strategy must be one of \('mod', 'div'\), got "
                      r"'hash'")),
    ("zero_dim", (r"ConfigError: .*partitioner fixed_size\(2\) for parameter 'scale': .*"
                  r"0-dimensional")),
    ("weight_differs", (r"ConfigError: .*worker 1 \(rank 1\): mpisync\.Embedding "
                        r"'emb\.weight': weight= has shape \[51, 4\], the table is \[50, 4\]")),
])
def test_bad_set_up_is_refused_on_every_rank(case, cause):
    run = failing("tables_errors.py", 2, 1, ["--case", case])
    assert_every_rank_says(run, r"(" + cause + r"|stopping because .*" + cause.split(":")[0]
                           + r")", labels(2, 1))


# -- saving and loading tables --------------------------------------------------------------
def test_tables_and_their_state_save_and_load_exactly():
    run = run_mpi("tables_state.py", 2, 2, timeout=180)
    workers = run.by_worker()
    assert sorted(workers) == [0, 1], run.describe()
    for got in workers.values():
        assert got["same"], run.describe()
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
    data = [ts.batches(w) for w in range(2)]
    for t in range(ts.STEPS):
        ids = torch.cat([d[t][0] for d in data])
        y = torch.cat([d[t][1] for d in data])
        opt.zero_grad()
        torch.nn.functional.mse_loss(head(emb(ids)), y).backward()
        opt.step()
    got = workers[0]
    assert (torch.tensor(got["saved_weight"]) - emb.weight).abs().max() <= 1e-6
    assert (torch.tensor(got["saved_sum"]) - opt.state[emb.weight]["sum"]).abs().max() <= 1e-6


def test_a_worker_that_catches_a_set_up_error_can_set_up_again():
    run = run_mpi("tables_errors.py", 2, 1, ["--case", "retry"], timeout=120)
    assert re.search(r"ps 0 \(rank 2[^)]*\): ConfigError: setup failed on the workers: .*"
                     r"'scale'.*serving on", run.output), run.describe()
    for w in (0, 1):
        assert f"worker {w}: trained to step 4" in run.output, run.describe()
