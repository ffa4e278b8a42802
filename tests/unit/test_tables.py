"""Embedding tables on the ps ranks, in one process: bad ids and a bad set-up refused,
each message exactly (the jobs that train the tables against plain torch and refuse the
same on every worker: tests/mpi/test_tables_jobs.py)."""
from __future__ import annotations

import copy
import io
import pickle
import re
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS

import mpisync
from mpisync.errors import ConfigError

sys.path.insert(0, str(SCRIPTS))
import tables_errors


# -- bad input in one process: each message, exactly ---------------------------------------
def _live_embedding() -> mpisync.Embedding:
    """An Embedding as a SyncReplicasOptimizer leaves it on worker 1 (its table served)."""
    emb = mpisync.Embedding(tables_errors.ROWS, tables_errors.DIM)
    emb.table.name, emb.table.label = "emb.weight", "worker 1 (rank 1)"
    emb.table.channel = object()       # the ids are checked before it is used
    return emb


@pytest.mark.parametrize("case, error, message", [
    ("out_of_range", IndexError, "got id 50, outside [0, 50) (its num_embeddings)"),
    ("negative", IndexError, "got id -1, outside [0, 50) (its num_embeddings)"),
    ("float_ids", TypeError, ("got ids of dtype torch.float32; expected an integer dtype "
                              "(torch.int64 or torch.int32)")),
    ("int16_ids", TypeError, ("got ids of dtype torch.int16; expected an integer dtype "
                              "(torch.int64 or torch.int32)")),
], ids=list(tables_errors.BAD_IDS))
def test_bad_ids_are_refused_before_anything_is_sent(case, error, message):
    emb = _live_embedding()
    full = "worker 1 (rank 1): mpisync.Embedding 'emb.weight' " + message
    with pytest.raises(error, match="^" + re.escape(full) + "$"):
        emb(tables_errors.BAD_IDS[case]())
    with pytest.raises(error, match="^" + re.escape(full.replace(
            "mpisync.Embedding", "rows() of")) + "$"):
        emb.rows(tables_errors.BAD_IDS[case]())


def _agreed_set_up(models, partitioner=None):
    """What every worker raises when the workers' models are ``models``: each builds the
    spec, and the first failure of any is theirs (as SyncReplicasOptimizer's set-up)."""
    # (imported here: mpisync.protocol.spec imported before the rest of mpisync is circular)
    from mpisync.protocol import compare
    from mpisync.protocol import spec as specs
    gathered = []
    for model in models:
        named = specs.Model(tuple(model.named_parameters()))
        spec = routes = error = None
        try:
            spec, routes = specs.build_spec(torch.optim.SGD(model.parameters(), lr=0.1), named,
                                            specs.Options(partitioner=partitioner), opt_id=0,
                                            num_workers=len(models), num_ps=1)
        except (ValueError, TypeError) as exc:
            error = str(exc)
        gathered.append((error, compare.model_summary(named),
                         compare.setup_summary(spec, routes)))
    return compare.first_failure(gathered, tuple(range(len(models))))


def _table_model(weight=None) -> torch.nn.Module:
    model = torch.nn.Module()
    model.emb = mpisync.Embedding(tables_errors.ROWS, tables_errors.DIM, weight=weight)
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    return model


def test_a_copy_of_a_table_not_served_yet_is_a_table_of_its_own():
    # as nn.Embedding's: the same shape, seed and initial weight=, nothing shared (a served
    # table's copy shares it: tests/scripts/tables.py)
    first = torch.randn(10, 4)
    model = torch.nn.ModuleDict({
        "plain": mpisync.Embedding(10, 4, seed=3),
        "bag": mpisync.EmbeddingBag(10, 4, mode="sum", weight=first),
        "hashed": mpisync.HashEmbeddingBag(4, capacity_per_shard=8, init_std=0.1)})
    twin = copy.deepcopy(model)
    for name in model:
        got, want = twin[name], model[name]
        assert type(got.weight) is type(want.weight) and got.table is not want.table
        assert got.table.describe() == want.table.describe() and repr(got) == repr(want)
    assert torch.equal(twin["bag"].table.weight, first)
    assert twin["bag"].table.weight.data_ptr() != model["bag"].table.weight.data_ptr()
    assert torch.equal(twin["hashed"].initial_rows(torch.tensor([5, -9])),
                       model["hashed"].initial_rows(torch.tensor([5, -9])))
    with pytest.raises(RuntimeError, match="called before a SyncReplicasOptimizer"):
        twin["plain"](torch.tensor([1]))


def test_a_pickled_table_module_comes_back_with_its_table():
    model = torch.nn.ModuleDict({
        "plain": mpisync.Embedding(10, 4, seed=3, padding_idx=2),
        "hashed": mpisync.HashEmbeddingBag(4, capacity_per_shard=8, init_std=0.1)})
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    for back in (pickle.loads(pickle.dumps(model)), torch.load(saved, weights_only=False)):
        for name in model:
            assert type(back[name].weight) is mpisync.tables.embedding.TableParameter
            assert back[name].table.describe() == model[name].table.describe()
            assert repr(back[name]) == repr(model[name])
        twin = copy.deepcopy(back)       # and a copy of it is a table of its own
        assert twin["plain"].table is not back["plain"].table
        assert twin["plain"].table.describe() == model["plain"].table.describe()


def test_a_bad_partition_strategy_is_refused_where_the_table_is_made():
    with pytest.raises(ValueError, match=r"^partition_strategy must be one of \('mod', "
                                         r"'div'\), got 'hash'$"):
        mpisync.Embedding(50, 4, partition_strategy="hash")


def test_a_partitioner_for_a_scalar_is_refused_on_every_worker():
    assert _agreed_set_up([_table_model(), _table_model()],
                          {"scale": mpisync.fixed_size(2)}) == (
        ConfigError, ("worker 0 (rank 0): partitioner fixed_size(2) for parameter 'scale': a "
                      "partitioner splits axis 0; parameter is 0-dimensional"))


def test_a_weight_of_another_shape_on_one_worker_is_refused_on_every_worker():
    differs = [_table_model(torch.zeros(50, 4)), _table_model(torch.zeros(51, 4))]
    assert _agreed_set_up(differs) == (
        ConfigError, ("worker 1 (rank 1): mpisync.Embedding 'emb.weight': weight= has shape "
                      "[51, 4], the table is [50, 4]"))
    assert _agreed_set_up([_table_model(torch.zeros(50, 4))] * 2) is None
