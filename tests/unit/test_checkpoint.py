"""Checkpoint files in one process: the chief's verdict on a bad file, what a file's
pickle names, the newest complete file, and tables re-cut into another partitioning.

The jobs that kill and resume a run, load every bad file on every worker and reshard
tables while training are tests/mpi/test_checkpoint_jobs.py's.
"""
from __future__ import annotations

import pickletools
import re
import sys
import zipfile

import pytest
import torch
from mpi_helpers import SCRIPTS
from shared_checkpoint import BAD_CAUSES

sys.path.insert(0, str(SCRIPTS))
from checkpoint_errors import BAD_KINDS
from resume import Net

import mpisync
from mpisync import checkpoint, ckptfile, ckptfit
from mpisync.protocol import partition
from mpisync.protocol.tables import TableSpec
from mpisync.tables import reshard


# -- bad files -------------------------------------------------------------------------------
def test_every_kind_of_bad_file_is_made():
    assert sorted(BAD_KINDS) == sorted(BAD_CAUSES)


def test_whatever_reading_or_checking_a_file_raises_is_the_chiefs_verdict(monkeypatch):
    """The chief's verdict never raises, since the other workers wait for it: anything a
    malformed file makes the reading or the check raise is refused, naming the file."""
    def raising(exc: Exception):
        def raise_it(*args):
            raise exc
        return raise_it

    monkeypatch.setattr(ckptfile, "read", raising(TypeError("'>' not supported")))
    assert checkpoint._verdict("d/bad.pt", Net(), None) == (
        ("d/bad.pt: a malformed mpisync checkpoint (TypeError: '>' not supported)",), None)
    monkeypatch.setattr(ckptfile, "read", lambda path: {})
    monkeypatch.setattr(ckptfit, "fits", raising(KeyError("ids")))
    assert checkpoint._verdict("d/bad.pt", Net(), None) == (
        ("d/bad.pt: a malformed mpisync checkpoint (KeyError: 'ids')",), None)


def _globals_named(path) -> set[str]:
    """The ``module.name`` of every class or function the file's pickle names."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    named, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            named.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            named.add(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return named


def test_a_file_names_no_class_of_mpisync_so_moved_modules_change_no_file(tmp_path,
                                                                          monkeypatch):
    """A checkpoint holds torch's and Python's types only (the reader is
    ``torch.load(weights_only=True)``, which refuses any other class): no file names an
    mpisync module, so moving a module to another folder changes nothing a saved file
    needs. A file that named one, here ``TableSpec`` under its module of before
    (``mpisync.tables``), was refused then and is refused now, with the reason."""
    good = tmp_path / "good.pt"
    with open(good, "wb") as f:
        ckptfile.Writer(f).finish({"format": ckptfile.FORMAT, "version": 1,
                                  "weight": torch.ones(2, 3), "dtype": torch.float16})
    assert not {g for g in _globals_named(good) if g.startswith("mpisync")}
    assert torch.equal(torch.load(good, weights_only=True)["weight"], torch.ones(2, 3))

    class TableSpec:                       # where the old layout defined it
        pass

    TableSpec.__module__, TableSpec.__qualname__ = "mpisync.tables", "TableSpec"
    import mpisync.tables
    monkeypatch.setattr(mpisync.tables, "TableSpec", TableSpec, raising=False)
    old = tmp_path / "old.pt"
    with open(old, "wb") as f:
        ckptfile.Writer(f).finish({"format": ckptfile.FORMAT, "version": 1,
                                  "spec": TableSpec})
    monkeypatch.undo()
    assert "mpisync.tables.TableSpec" in _globals_named(old)
    with pytest.raises(ValueError, match=r"not a readable checkpoint \(UnpicklingError"):
        ckptfile.read(str(old))


def test_latest_passes_over_a_cut_file(tmp_path):
    (tmp_path / "ckpt-000000010.pt").write_bytes(b"PK\x03\x04 cut short")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert mpisync.latest(tmp_path) is None
    torch.save({"x": 1}, tmp_path / "ckpt-000000004.pt")
    assert mpisync.latest(tmp_path) == str(tmp_path / "ckpt-000000004.pt")
    assert mpisync.latest(tmp_path / "missing") is None


def test_latest_passes_over_a_whole_file_torch_cannot_read_and_says_so(tmp_path):
    """A file damaged after it was written (its size whole, its bytes not): the one before
    it, with a warning naming it; a file of a newer format is not passed over (load
    refuses it, saying to upgrade)."""
    torch.save({"x": 1}, tmp_path / "ckpt-000000004.pt")
    damaged = tmp_path / "ckpt-000000008.pt"
    with zipfile.ZipFile(damaged, "w") as z:       # a zip file, but not torch's
        z.writestr("archive/data.pkl", b"\x80\x02damaged")
    with pytest.warns(RuntimeWarning, match=re.escape(str(damaged)) +
                      r": not a readable checkpoint \(.+\): passed over for an older one"):
        assert mpisync.latest(tmp_path) == str(tmp_path / "ckpt-000000004.pt")
    newer = tmp_path / "ckpt-000000012.pt"
    with open(newer, "wb") as f:
        ckptfile.Writer(f).finish({"format": ckptfile.FORMAT, "version": 99})
    assert mpisync.latest(tmp_path) == str(newer)


# -- tables and their optimizer state into another partitioning ------------------------------
def _spec(rows: int, n: int, strategy: str, row_shape=(3,)) -> TableSpec:
    return TableSpec("emb.weight", rows, row_shape, torch.float32, strategy,
                     tuple(partition.shard_rows(rows, n, strategy)), (0,) * n, True, None, None)


def _saved(spec: TableSpec, weight, state_of) -> dict:
    shards = []
    for k in range(spec.num_shards):
        ids = spec.global_ids(k, torch.arange(spec.shard_rows[k]))
        shards.append({"ids": ids, "weight": weight[ids], "state": state_of(k, ids)})
    return {"num_rows": spec.num_rows, "row_shape": list(spec.row_shape), "dtype": "float32",
            "strategy": spec.strategy, "shards": shards}


def _whole(saved: dict, spec: TableSpec) -> tuple[torch.Tensor, dict, list]:
    """The table re-cut into ``spec``'s shards, then assembled: rows, per-row state, scalars."""
    assert reshard.check_table(saved, spec) is None
    from_shards, _ = reshard.sources(saved, spec)
    weight = torch.full((spec.num_rows, *spec.row_shape), float("nan"))
    rows: dict = {}
    scalars = []
    for k in range(spec.num_shards):
        part, state = reshard.new_shard(saved, spec, k, from_shards[k])
        ids = spec.global_ids(k, torch.arange(spec.shard_rows[k]))
        weight[ids] = part
        for key, value in state.items():
            if value.dim():
                rows.setdefault(key, torch.full((spec.num_rows, *value.shape[1:]), -1.0))
                rows[key][ids] = value
        scalars.append({key: v for key, v in state.items() if not v.dim()})
    return weight, rows, scalars


@pytest.mark.parametrize("rows", [1, 7, 30])
def test_every_row_and_its_state_moves_to_its_new_shard(rows):
    weight = torch.randn(rows, 3)
    acc, per_row = torch.rand(rows, 3), torch.rand(rows)      # Adagrad-like, row-wise (rows,)
    layouts = [(n, s) for n in (1, 2, 3, 5) for s in ("mod", "div") if n <= rows]
    for before in layouts:
        spec = _spec(rows, *before)
        saved = _saved(spec, weight, lambda k, ids: {"sum": acc[ids], "row": per_row[ids],
                                                     "step": torch.tensor(4.0)})
        for after in layouts:
            got, state, scalars = _whole(saved, _spec(rows, *after))
            assert torch.equal(got, weight), (before, after)
            assert torch.equal(state["sum"], acc) and torch.equal(state["row"], per_row)
            assert all(s == {"step": torch.tensor(4.0)} for s in scalars)


def test_rows_of_a_shard_without_state_start_at_zero():
    spec = _spec(12, 2, "div")
    saved = _saved(spec, torch.randn(12, 3),
                   lambda k, ids: {} if k else {"exp_avg": torch.ones(6, 3),
                                                "step": torch.tensor(2.0)})
    _, state, scalars = _whole(saved, _spec(12, 3, "mod"))
    assert torch.equal(state["exp_avg"], torch.cat([torch.ones(6, 3), torch.zeros(6, 3)]))
    assert scalars == [{"step": torch.tensor(2.0)}] * 3
    # the same partitioning: the shard that had none still has none
    from_shards, _ = reshard.sources(saved, spec)
    assert reshard.new_shard(saved, spec, 1, from_shards[1])[1] == {}


def test_shards_whose_step_counters_differ_merge_only_where_they_are_not_read():
    spec = _spec(12, 2, "div")
    saved = _saved(spec, torch.randn(12, 3),
                   lambda k, ids: {"exp_avg": torch.ones(len(ids), 3),
                                   "step": torch.tensor(3.0 + k)})
    assert reshard.check_table(saved, spec) is None                 # each keeps its own
    assert reshard.check_table(saved, _spec(12, 4, "div")) is None  # each new shard: one old
    problem = reshard.check_table(saved, _spec(12, 3, "mod"))
    assert re.fullmatch(r"table 'emb\.weight': saved shards 0 and 1 hold 'step' = 3\.0 and "
                        r"4\.0, and rows of both go to shard 0 of this job's 3 \('mod'\); load "
                        r"it into the partitioning it was saved with \(2 shards, 'div'\), "
                        r"where each shard keeps its own", problem), problem
    # a counter the update does not read (Adagrad without lr_decay): merged, the largest
    assert reshard.check_table(saved, _spec(12, 3, "mod"), ("step",)) is None
    from_shards, _ = reshard.sources(saved, _spec(12, 3, "mod"))
    for k in range(3):
        _, state = reshard.new_shard(saved, _spec(12, 3, "mod"), k, from_shards[k], ("step",))
        assert torch.equal(state["step"], torch.tensor(4.0))
    adagrad = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)])
    assert reshard.unread_counters(adagrad, {"lr_decay": 0}) == ("step",)
    assert reshard.unread_counters(adagrad, {"lr_decay": 0.1}) == ()
    assert reshard.unread_counters(mpisync.RowWiseAdagrad([torch.zeros(1, requires_grad=True)]),
                                   {}) == ("step",)
    assert reshard.unread_counters(torch.optim.SparseAdam([torch.zeros(1, requires_grad=True)]),
                                   {}) == ()


def test_a_saved_table_of_another_shape_or_with_rows_missing_is_described():
    spec = _spec(12, 2, "mod")
    saved = _saved(spec, torch.randn(12, 3), lambda k, ids: {})
    assert reshard.check_table(saved, _spec(13, 2, "mod")) == (
        "table 'emb.weight' was saved with 12 rows of [3], this one has 13 rows of [3]")
    assert "this one has 12 rows of [4]" in reshard.check_table(saved, _spec(12, 2, "mod", (4,)))
    saved["shards"][1]["ids"] = torch.zeros(6, dtype=torch.int64)    # row 0 7 times, odd never
    assert reshard.check_table(saved, _spec(12, 3, "div")) == (
        "table 'emb.weight' in the checkpoint gives shard 0 8 rows, it holds 4: the saved ids "
        "are not each row once")
