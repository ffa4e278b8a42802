"""mpisync.HashEmbedding under MPI: two jobs (the pure parts, the slot map against a plain
reference among them, run in one process: tests/unit/test_hashtables.py).

One job (2 workers, 1 ps) runs every case of tests/scripts/hashtables.py and saves a
checkpoint; a second job (2 ps) loads it and ends with a lookup over capacity.
"""
from __future__ import annotations

import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, assert_every_rank_says, failing, labels, run_mpi

import mpisync
from mpisync import hashing

sys.path.insert(0, str(SCRIPTS))
from hashtables import BY_NAME, CASES, POOL, WORKERS, reference_exact, simulate

TOLERANCE = 1e-5


# -- under MPI -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("hash")
    run = run_mpi("hashtables.py", WORKERS, 1, ["--save", path, *[c.name for c in CASES]],
                  timeout=300)
    return run, run.by_case(), path


def test_every_case_ran_on_every_worker(saved):
    run, _, _ = saved
    run.assert_every_case_ran(BY_NAME, WORKERS, lambda name: BY_NAME[name].steps)


def _rows(got: dict) -> dict[int, torch.Tensor]:
    return {int(i): torch.tensor(r["weight"]) for i, r in got["table"]["rows"].items()}


@pytest.mark.parametrize("name", [c.name for c in CASES if c.kind == "exact"])
def test_with_room_to_spare_it_trains_as_embedding_and_plain_torch(saved, name):
    _, by_case, _ = saved
    ref = reference_exact(BY_NAME[name])
    for w, got in by_case[name].items():
        rows, twin = _rows(got), torch.tensor(got["twin"])
        seen = {int(i) for i in POOL.tolist()} & set(rows)
        assert seen == set(rows) and rows, (name, w, sorted(rows))
        for n, i in enumerate(POOL.tolist()):
            if i in rows:
                assert (rows[i] - twin[n]).abs().max() <= 1e-6, (name, w, i, "twin")
                assert (rows[i] - ref["table"][n]).abs().max() <= TOLERANCE, (name, w, i)
        for mine, theirs in zip(*got["heads"]):
            assert (torch.tensor(mine) - torch.tensor(theirs)).abs().max() <= 1e-6
        for mine, plain in zip(got["heads"][0], ref["head"]):
            assert (torch.tensor(mine) - plain).abs().max() <= TOLERANCE
        assert got["hash_stats"] == {"admitted": len(rows), "evicted": 0, "live": len(rows)}
        assert got["rows_agree"], (name, w)


@pytest.mark.parametrize("name", [c.name for c in CASES if c.kind != "exact"])
def test_admission_and_eviction_follow_the_reference(saved, name):
    _, by_case, _ = saved
    ref = simulate(BY_NAME[name])
    shards = ref["shards"]
    expected = {k: sum(s.stats()[k] for s in shards) for k in ("admitted", "evicted", "live")}
    assert expected["evicted"] > 0, expected         # the case does evict
    for w, got in by_case[name].items():
        assert got["hash_stats"] == expected, (name, w)
        assert [sorted(ids) for ids in got["table"]["shards"]] == \
            [sorted(s.rows) for s in shards], (name, w)
        rows = _rows(got)
        for i, row in rows.items():
            assert (row - ref["rows"][i]).abs().max() <= TOLERANCE, (name, w, i)
            count = next(s.rows[i][0] for s in shards if i in s.rows)
            assert got["table"]["rows"][str(i)]["count"] == count, (name, w, i)
            state = got["table"]["rows"][str(i)]["state"]
            if "sum" in state:
                assert (torch.tensor(state["sum"]) - ref["acc"][i]).abs().max() <= TOLERANCE
        for mine, plain in zip(got["head"], ref["head"]):
            assert (torch.tensor(mine) - plain).abs().max() <= TOLERANCE, (name, w)
        assert got["rows_agree"], (name, w)


@pytest.fixture(scope="module")
def loaded(saved):
    _, _, path = saved
    return failing("hashtables_load.py", WORKERS, 2, ["--load", mpisync.latest(path)],
                   timeout=120)


def test_a_checkpoint_at_one_ps_loads_at_two_by_id(saved, loaded):
    """The newest file of an incremental chain (each file the rows changed and the ids
    evicted since the one before) loads as the table was, by id."""
    _, by_case, path = saved
    before = by_case["evict-lru-adagrad-saved"][0]
    newest = torch.load(mpisync.latest(path), weights_only=True)
    assert newest["base"] is not None and newest["global_step"] == before["global_step"]
    table = newest["tables"]["emb.weight"]
    assert table["incremental"] is True and table["shards"][0]["removed"] is not None
    for w, got in loaded.by_worker().items():
        assert got["num_ps"] == 2 and len(got["table"]["shards"]) == 2, loaded.describe()
        assert got["table"]["rows"] == before["table"]["rows"], (w, loaded.describe())
        for k, ids in enumerate(got["table"]["shards"]):
            assert (hashing.shard_of(torch.tensor(ids, dtype=torch.int64), 2) == k).all()
        # counts restart at a load: every row loaded is live and admitted, none evicted
        live = len(got["table"]["rows"])
        assert got["hash_stats"] == {"admitted": live, "evicted": 0, "live": live}
        assert got["global_step"] == before["global_step"]
    assert sorted(loaded.by_worker()) == [0, 1], loaded.describe()


def test_a_lookup_over_capacity_ends_the_job_naming_the_need(loaded):
    cause = (r"CapacityError: worker 1 \(rank 1[^)]*\): mpisync\.HashEmbedding 'emb\.weight' "
             r"needs 6 rows on shard 0 \(on ps \d\) for one lookup, more than its "
             r"capacity_per_shard=4")
    assert_every_rank_says(loaded, r"(" + cause + r"|stopping because worker 1 .*" + cause
                           + ")", labels(WORKERS, 2))
