"""mpisync.HashEmbedding: the pure parts, in one process.

The slot map (``mpisync.hashing.SlotMap``) is checked against a shard written plainly
(tests/scripts/hash_reference.py) on generated sequences of lookups. The two MPI jobs
(every case of tests/scripts/hashtables.py, then its checkpoint loaded at 2 ps) are
tests/mpi/test_hashtables_jobs.py's.
"""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_helpers import SCRIPTS

import mpisync
from mpisync import hashing
from mpisync.ps.hashrows import fresh_state

sys.path.insert(0, str(SCRIPTS))
from hash_reference import ReferenceShard
from hashtables import WORKERS


# -- the hash and the initial rows ---------------------------------------------------------
def test_splitmix64_is_the_published_function():
    # the first outputs of SplitMix64 seeded with 0: splitmix64(0), splitmix64(golden)...
    assert int(hashing.splitmix64(np.uint64(0))) == 0xE220A8397B1DCDAF
    assert int(hashing.splitmix64(np.uint64(0x9E3779B97F4A7C15))) == 0x6E789E6AA1B965F4


def test_any_int64_id_has_a_shard_and_a_row():
    ids = torch.tensor([-2**63, -1, 0, 1, 2**63 - 1])
    shards = hashing.shard_of(ids, 3)
    assert shards.dtype == torch.int64 and bool(((shards >= 0) & (shards < 3)).all())
    rows = hashing.initial_rows(ids, 5, seed=1)
    assert rows.shape == (5, 5) and bool(torch.isfinite(rows).all())


def test_initial_rows_depend_on_seed_and_id_only():
    ids = torch.tensor([5, -3, 2**50, 77])
    rows = hashing.initial_rows(ids, 4, seed=9)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(hashing.initial_rows(ids[perm], 4, seed=9), rows[perm])
    assert torch.equal(hashing.initial_rows(ids[1:2], 4, seed=9), rows[1:2])
    assert not torch.equal(hashing.initial_rows(ids, 4, seed=10), rows)
    emb = mpisync.HashEmbedding(4, capacity_per_shard=8, seed=9)
    assert torch.equal(emb.initial_rows(ids), rows)
    many = hashing.initial_rows(torch.arange(20000), 8)
    assert abs(float(many.mean())) < 0.02 and abs(float(many.std()) - 1) < 0.02


def test_init_std_scales_the_initial_rows_in_float64():
    ids = torch.tensor([5, -3, 2**50, 77])
    unit = hashing.initial_rows(ids, 4, seed=9, dtype=torch.float64)
    assert torch.equal(hashing.initial_rows(ids, 4, seed=9, std=0.05),
                       (unit * 0.05).to(torch.float32))
    emb = mpisync.HashEmbeddingBag(4, capacity_per_shard=8, seed=9, init_std=0.05)
    assert torch.equal(emb.initial_rows(ids), hashing.initial_rows(ids, 4, 9, std=0.05))
    assert emb.table.hashed.init_std == 0.05 and "init_std 0.05" in emb.table.describe()
    assert "init_std=0.05" in repr(emb)
    plain = mpisync.HashEmbedding(4, capacity_per_shard=8)
    assert plain.table.hashed.init_std == 1.0 and "init_std" not in repr(plain)


# -- the slot map against the plain reference ----------------------------------------------
def _check_same(slots: hashing.SlotMap, ref: ReferenceShard) -> None:
    got = slots.export()
    assert got["ids"].tolist() == sorted(ref.rows)
    assert got["count"].tolist() == [ref.rows[i][0] for i in sorted(ref.rows)]
    assert got["last"].tolist() == [ref.rows[i][1] for i in sorted(ref.rows)]
    assert slots.stats() == ref.stats()
    assert len(set(got["slots"].tolist())) == len(got["slots"])          # one id per slot
    assert slots.slot_id[got["slots"]].tolist() == got["ids"].tolist()


lookups = st.lists(st.lists(st.one_of(st.integers(-6, 6), st.sampled_from([-2**63, 2**62, 2**63 - 1])),
                            max_size=6), max_size=25)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 6), eviction=st.sampled_from(["lru", "lfu"]),
       admit_after=st.integers(1, 3), messages=lookups)
def test_slot_map_admits_and_evicts_as_the_reference(capacity, eviction, admit_after,
                                                     messages):
    slots = hashing.SlotMap(capacity, eviction, admit_after)
    ref = ReferenceShard(capacity, eviction, admit_after)
    for message in messages:
        ids = np.array(sorted(set(message))[:capacity], np.int64)
        admitted, _ = ref.see(ids.tolist())
        got, new = slots.see(ids)
        assert sorted(slots.slot_id[new].tolist()) == admitted
        held = [i in ref.rows for i in ids.tolist()]
        assert ((got >= 0) == np.array(held, bool)).all()
        assert (slots.slot_id[got[got >= 0]] == ids[got >= 0]).all()
        _check_same(slots, ref)
        assert (slots.peek(ids) == got).all()


def test_slot_map_refuses_more_ids_than_it_holds():
    with pytest.raises(ValueError, match=r"5 distinct ids in one lookup of a shard that holds 4"):
        hashing.SlotMap(4).see(np.arange(5))


def test_slot_map_reloads_what_it_exported():
    slots = hashing.SlotMap(5, "lfu")
    for ids in ([1, 2, 3], [2, 9], [9, -4, 7, 8]):
        slots.see(np.array(ids))
    saved = slots.export()
    again = hashing.SlotMap(5, "lfu")
    again.reload(saved["ids"][::-1].copy(), saved["count"][::-1].copy(),
                 saved["last"][::-1].copy(), slots.clock)
    for key in ("ids", "count", "last"):
        assert again.export()[key].tolist() == saved[key].tolist()
    ref_next = slots.see(np.array([100]))[1]
    assert slots.slot_id[ref_next].tolist() == [100]
    again.see(np.array([100]))
    assert again.export()["ids"].tolist() == slots.export()["ids"].tolist()


def test_a_new_row_gets_the_optimizers_fresh_state():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    ada = torch.optim.Adagrad([p], lr=0.1, initial_accumulator_value=0.25)
    assert torch.equal(fresh_state(ada, ada.param_groups[0], (2,), torch.float32)["sum"],
                       torch.full((2,), 0.25))
    adam = torch.optim.Adam([p], lr=0.1)
    fresh = fresh_state(adam, adam.param_groups[0], (2,), torch.float32)
    assert sorted(fresh) == ["exp_avg", "exp_avg_sq"] and all(not v.any() for v in fresh.values())
    rowwise = mpisync.RowWiseAdagrad([p], lr=0.1, initial_accumulator_value=0.5)
    fresh = fresh_state(rowwise, rowwise.param_groups[0], (2,), torch.float32)
    assert list(fresh) == ["sum"] and fresh["sum"].shape == () and float(fresh["sum"]) == 0.5


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="capacity_per_shard must be an int >= 1, got 0"):
        mpisync.HashEmbedding(4, capacity_per_shard=0)
    with pytest.raises(ValueError, match=r"eviction must be one of \('lru', 'lfu'\), got 'fifo'"):
        mpisync.HashEmbedding(4, capacity_per_shard=3, eviction="fifo")
    with pytest.raises(ValueError, match="admit_after must be an int >= 1"):
        mpisync.HashEmbeddingBag(4, capacity_per_shard=3, admit_after=0)
    for bad in (0, -0.1, float("nan"), float("inf"), 1e300, 1e-320):
        with pytest.raises(ValueError, match=r"init_std must lie in \[1\.17549e-38, "
                                             r"4\.25353e\+37\] for torch\.float32 rows, got"):
            mpisync.HashEmbedding(4, capacity_per_shard=3, init_std=bad)
    for bad in (True, "0.1", None, torch.tensor(0.1)):
        with pytest.raises(TypeError, match=r"init_std must be a real number, got"):
            mpisync.HashEmbedding(4, capacity_per_shard=3, init_std=bad)
    for good, dtype in ((np.float32(0.5), torch.float32), (np.int64(2), torch.float32),
                        (2, torch.float32), (1e300, torch.float64)):
        emb = mpisync.HashEmbedding(4, capacity_per_shard=3, init_std=good, dtype=dtype)
        assert emb.init_std == float(good) and type(emb.init_std) is float
    for bad in (-1, 0, float("nan")):
        with pytest.raises(ValueError, match=r"std must lie in"):
            hashing.initial_rows(torch.tensor([1]), 4, std=bad)


def test_a_lookup_over_capacity_is_refused_before_anything_is_sent():
    """The worker's check (CapacityError; the whole job's end: the last test of
    tests/mpi/test_hashtables_jobs.py), with
    the table of the loading job: one shard per ps rank, 2 ps ranks, capacity 4."""
    # (imported here, after mpisync's other modules: see tests/unit/test_tables.py)
    from mpisync.protocol import spec as specs
    model = torch.nn.ModuleDict({"emb": mpisync.HashEmbedding(3, capacity_per_shard=4)})
    spec, _ = specs.build_spec(torch.optim.SGD(model.parameters(), lr=0.1),
                               specs.Model(tuple(model.named_parameters())), specs.Options(),
                               opt_id=0, num_workers=WORKERS, num_ps=2)
    info = model["emb"].table
    info.name, info.label, info.spec = "emb.weight", "worker 1 (rank 1)", spec.tables[0]
    info.channel = object()                # the lookup is refused before it is used
    candidates = torch.arange(-1000, 1000)
    on_first = candidates[hashing.shard_of(candidates, 2) == 0]
    with pytest.raises(AttributeError):    # as many as a shard holds: sent (on no channel)
        model["emb"](on_first[:4])
    message = (f"worker 1 (rank 1): mpisync.HashEmbedding 'emb.weight' needs 6 rows on shard 0 "
               f"(on ps {spec.tables[0].owners[0]}) for one lookup, more than its "
               f"capacity_per_shard=4; raise capacity_per_shard, use more shards (partitioner=) "
               f"or look up fewer distinct ids at once")
    with pytest.raises(mpisync.CapacityError, match="^" + re.escape(message) + "$"):
        model["emb"](on_first[:6])

