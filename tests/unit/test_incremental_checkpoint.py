"""Incremental checkpoints of a table on the ps, in one process (``test_refusals.OneRank``):
files that hold the changed rows over a base load bitwise as a full file of the same step,
a missing base is refused naming it, ``latest`` passes over broken chains and ``keep``
keeps the bases the newest files need."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from test_refusals import OneRank

import mpisync
from mpisync import ckptchain

ROWS, DIM, HOT = 10_000, 8, 40
NAME = "emb.weight"

pytestmark = pytest.mark.filterwarnings("ignore:.*were written after the last step")


class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = mpisync.Embedding(ROWS, DIM, seed=seed)
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


OPTIMIZERS = {
    # sparse: only the rows of a step's ids change
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    # dense over the table (momentum): every row changes every step
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    # dense too (weight decay), though Adagrad
    "adagrad-decay": lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01),
}


@pytest.fixture
def rank():
    r = OneRank()
    r.cluster.worker_comm = r.worker_comm          # what save and load talk over
    try:
        yield r
    finally:
        r.end()


def build(rank, kind: str, seed: int = 0):
    net = Net(seed)
    return net, rank.wrap(net, OPTIMIZERS[kind](net.parameters()))


def train_step(net, opt, t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    ids = torch.randint(0, HOT, (16, 3), generator=g) * (ROWS // HOT)   # a few rows only
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(ids), torch.randint(0, 2, (16,), generator=g)
                                      ).backward()
    opt.step()


def table(opt) -> list:
    """The table's shards as the ps ranks hold them, with their optimizer state."""
    return [(s["ids"], s["weight"], s.get("state")) for s in opt.table_shards(NAME)]


def record(net, opt) -> list:
    """What a load restores: the table with its state, the model's state, the optimizer's."""
    return [table(opt), net.state_dict(), opt.state_dict(tables=False)]


def same(a, b, at: str = "") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, at
        assert torch.equal(a, b), at
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), at
        for k in a:
            same(a[k], b[k], f"{at}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{at}[{i}]")
    else:
        assert a == b, at


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def shrink(rows: torch.Tensor) -> None:
    """An ``opt.update`` function that changes every row it is given."""
    rows.mul_(0.5)


def run(rank, kind: str, tmp_path, steps: int = 5, update: bool = False, **kw):
    """``steps`` steps saving each (``full_every=3``), and a full file of each step beside;
    ``(ckpt dir, full dir, {step: the table}``, the optimizer closed. ``update``: every
    row shrunk after each step (``opt.update``)."""
    d, full = tmp_path / "ckpt", tmp_path / "full"
    net, opt = build(rank, kind)
    if update:
        rank.cluster.helper_comm = lambda what: rank.worker_comm    # one worker: itself
        opt.update(NAME, shrink, rows="all")
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=1, full_every=3, **kw)
    records = {}
    for t in range(steps):
        train_step(net, opt, t)
        assert ckpt.maybe_save() == str(d / ckpt_name(t + 1))
        mpisync.save(full / f"{t + 1}.pt", net, opt)        # a plain save: marks untouched
        records[t + 1] = table(opt)
    opt.close()
    return d, full, records


@pytest.mark.parametrize("kind", [*OPTIMIZERS, "adagrad-update"])
def test_an_incremental_chain_loads_bitwise_as_a_full_file_of_its_step(rank, kind, tmp_path):
    update = kind.endswith("-update")
    kind = kind.removesuffix("-update")
    d, full, records = run(rank, kind, tmp_path, update=update)
    files = {t: torch.load(d / ckpt_name(t), weights_only=True) for t in range(1, 6)}
    for t, base in ((1, None), (2, 1), (3, 2), (4, None), (5, 4)):
        got = files[t]["base"]
        assert (got and got["file"]) == (base and ckpt_name(base)), t
        if base is not None:
            assert got["id"] == files[base]["file_id"]
            assert files[t]["tables"][NAME]["incremental"] is True
            assert files[t]["version"] == 2
    sizes = {t: os.path.getsize(d / ckpt_name(t)) for t in files}
    changed = sum(len(s["ids"]) for s in files[2]["tables"][NAME]["shards"])
    if kind == "adagrad" and not update:    # only the step's rows
        assert 0 < changed <= HOT and sizes[2] * 10 < sizes[1]
    else:                   # a dense step over the table, or an update of all rows
        assert changed == ROWS
    loads_as_full_files(*build(rank, kind, seed=7), d, full, records, (3, 5, 2))


def loads_as_full_files(net, opt, d, full, records: dict, steps) -> None:
    """Each step's chain loads what the full file of that step loads (its table as it
    was), and ``plain_state`` reads the same from both; ``opt`` closed after."""
    for t in steps:
        mpisync.load(d / ckpt_name(t), net, opt)
        chained = record(net, opt)
        same(chained[0], records[t], f"the table of step {t}")
        mpisync.load(full / f"{t}.pt", net, opt)
        same(chained, record(net, opt), f"chain and full file of step {t}")
    t = steps[0]
    same(mpisync.plain_state(d / ckpt_name(t)), mpisync.plain_state(full / f"{t}.pt"))
    opt.close()


def test_a_missing_base_is_refused_naming_it_and_latest_falls_back(rank, tmp_path):
    d, _, records = run(rank, "adagrad", tmp_path)
    cut = tmp_path / "cut"
    cut.mkdir()
    for t in (2, 3):
        shutil.copyfile(d / ckpt_name(t), cut / ckpt_name(t))
    assert mpisync.latest(cut) is None                  # no chain is whole
    net, opt = build(rank, "adagrad", seed=7)
    before = record(net, opt)
    with pytest.raises(mpisync.ConfigError,
                       match=rf"{cut / ckpt_name(3)}: an incremental checkpoint whose chain of "
                             rf"bases needs {cut / ckpt_name(1)} \(the base of "
                             rf"{cut / ckpt_name(2)}\), which is missing"):
        mpisync.load(cut / ckpt_name(3), net, opt)
    same(record(net, opt), before, "nothing loaded")
    with pytest.raises(FileNotFoundError, match=ckpt_name(1)):
        mpisync.plain_state(cut / ckpt_name(3))

    os.unlink(d / ckpt_name(4))                         # the base of 5: 3 is the newest whole
    assert mpisync.latest(d) == str(d / ckpt_name(3))
    shutil.copyfile(tmp_path / "full" / "4.pt", d / ckpt_name(4))
    assert mpisync.latest(d) == str(d / ckpt_name(4))   # not the base 5 was written over
    with pytest.raises(mpisync.ConfigError, match="replaced by another file of that name"):
        mpisync.load(d / ckpt_name(5), net, opt)
    with open(d / ckpt_name(4), "r+b") as f:            # a truncated file passes over too
        f.truncate(os.path.getsize(d / ckpt_name(4)) // 2)
    assert mpisync.latest(d) == str(d / ckpt_name(3))
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=1, full_every=3)
    with pytest.warns(RuntimeWarning, match=rf"resume\(\): passed over {d / ckpt_name(5)}: .*"
                                            rf"base {d / ckpt_name(4)} is not complete.*; {d / ckpt_name(4)}: "
                                            rf"cut short"):
        ckpt.resume()
    assert opt.global_step == 3
    same(table(opt), records[3], "resumed")
    train_step(net, opt, 3)
    ckpt.maybe_save()                                   # after a resume: full
    ckpt.wait()                                         # written beside training
    assert torch.load(d / ckpt_name(4), weights_only=True)["base"] is None
    train_step(net, opt, 4)
    ckpt.maybe_save()
    ckpt.wait()
    assert torch.load(d / ckpt_name(5), weights_only=True)["base"]["file"] == ckpt_name(4)
    same(table(opt), records[5], "resumed and trained on")
    opt.close()

    net, opt = build(rank, "adagrad", seed=7)           # only the broken chain: refused
    before = [table(opt), {k: v.clone() for k, v in net.state_dict().items()}]
    saved = {p.name: p.read_bytes() for p in cut.iterdir()}
    ckpt = mpisync.Checkpointer(cut, net, opt, every_steps=1, full_every=3)
    with pytest.raises(mpisync.ConfigError,
                       match=rf"holds checkpoints but none can be loaded \({cut / ckpt_name(3)}: "
                             rf"an incremental checkpoint whose chain of bases needs "
                             rf"{cut / ckpt_name(1)} \(the base of {cut / ckpt_name(2)}\), "
                             rf"which is missing.*{cut / ckpt_name(2)}: .*; starting from step 0 would "
                             rf"write over them") as refused:
        ckpt.resume()                                   # not step 0 over the files there
    assert refused.value.collective
    assert opt.global_step == 0
    same(record(net, opt)[:2], before, "nothing loaded")
    assert {p.name: p.read_bytes() for p in cut.iterdir()} == saved
    opt.close()


def test_keep_keeps_the_bases_the_newest_file_needs(rank, tmp_path):
    d = tmp_path / "ckpt"
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=1, full_every=3, keep=1)
    listed = []
    for t in range(5):
        train_step(net, opt, t)
        ckpt.maybe_save()
        ckpt.wait()
        listed.append(sorted(p.name for p in d.iterdir()))
    want = [[1], [1, 2], [1, 2, 3], [4], [4, 5]]
    assert listed == [[ckpt_name(t) for t in names] for names in want]
    assert ckptchain.needed(str(d / ckpt_name(5))) == [str(d / ckpt_name(t)) for t in (5, 4)]
    opt.close()


def test_full_every_one_writes_every_file_full_and_bad_values_are_refused(rank, tmp_path):
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(tmp_path, net, opt, every_steps=1, full_every=1)
    for t in range(2):
        train_step(net, opt, t)
        ckpt.maybe_save()
        ckpt.wait()
        ck = torch.load(tmp_path / ckpt_name(t + 1), weights_only=True)
        assert ck["base"] is None and ck["version"] == 1 and "incremental" not in ck["tables"][NAME]
    for bad in (0, -1, True, 2.0, None):
        with pytest.raises(ValueError, match=f"full_every must be a positive int, got {bad!r}"):
            mpisync.Checkpointer(tmp_path, net, opt, full_every=bad)
    opt.close()


def test_the_save_after_a_failed_one_is_full(rank, tmp_path):
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(tmp_path, net, opt, every_steps=1, full_every=8)
    train_step(net, opt, 0)
    ckpt.maybe_save()
    train_step(net, opt, 1)
    (tmp_path / ckpt_name(2)).mkdir()                   # the rename onto it fails
    ckpt.maybe_save()                                   # written beside training: told later
    bad = re.escape(str(tmp_path / ckpt_name(2)))
    with pytest.raises(OSError, match=rf"Checkpointer.wait\(\): the checkpoint {bad} could not "
                                      rf"be written: IsADirectoryError"):
        ckpt.wait()
    train_step(net, opt, 2)
    ckpt.maybe_save()
    ckpt.wait()
    assert torch.load(tmp_path / ckpt_name(3), weights_only=True)["base"] is None
    train_step(net, opt, 3)
    ckpt.maybe_save()
    ckpt.wait()
    assert torch.load(tmp_path / ckpt_name(4), weights_only=True)["base"]["file"] == ckpt_name(3)
    shard_rows = table(opt)
    net2, opt2 = build(rank, "adagrad", seed=7)
    mpisync.load(tmp_path / ckpt_name(4), net2, opt2)
    same(table(opt2), shard_rows, "loaded after the failed save")
    opt2.close()
    opt.close()


def test_keep_never_removes_the_file_just_written_for_a_later_one(rank, tmp_path):
    """A file of a later step in the directory (cut short, so resume() passed over it, or
    left by a run that went further) is neither counted by ``keep`` nor removed: each save
    stays (it used to be removed at once, and a restart lost every step)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / ckpt_name(100)).write_bytes(b"PK\x03\x04cut short")  # a torch file cut short
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=1, full_every=1, keep=1)
    with pytest.warns(RuntimeWarning, match=rf"passed over {d / ckpt_name(100)}: cut short"):
        assert ckpt.resume() is None                    # nothing to resume from in it
    listed = []
    for t in range(3):
        train_step(net, opt, t)
        ckpt.maybe_save()
        ckpt.wait()
        listed.append(sorted(p.name for p in d.iterdir()))
    assert listed == [[ckpt_name(s), ckpt_name(100)] for s in (1, 2, 3)]
    assert mpisync.latest(d) == str(d / ckpt_name(3))
    opt.close()


@pytest.mark.parametrize("what", ["text", "directory", "empty", "zip-start"])
def test_a_file_that_is_no_checkpoint_is_refused_one_cut_short_passed_over(rank, tmp_path,
                                                                          what):
    """Only a checkpoint cut short (empty, or a torch file's first bytes) holds nothing to
    resume from; a file of something else, or a directory, under a checkpoint's name is
    refused, untouched, rather than written over."""
    d = tmp_path / "ckpt"
    d.mkdir()
    f = d / ckpt_name(1)
    if what == "directory":
        f.mkdir()
    else:
        f.write_bytes({"text": b"hello world\n", "empty": b"",
                       "zip-start": b"PK\x03\x04\x14\x00"}[what])
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=1)
    if what in ("text", "directory"):
        with pytest.raises(mpisync.ConfigError, match=rf"{f}: not a checkpoint file"):
            ckpt.resume()
        assert f.is_dir() if what == "directory" else f.read_bytes() == b"hello world\n"
    else:
        with pytest.warns(RuntimeWarning, match=rf"passed over {f}: cut short"):
            assert ckpt.resume() is None
    opt.close()


def test_the_partial_files_of_a_writer_killed_mid_write_are_removed(rank, tmp_path):
    """A chief killed while writing leaves ``.ckpt-<step>.pt.tmp-<host>-<pid>``; the next
    chief's Checkpointer removes it (its writer is gone), not a live writer's, not another
    host's, and no checkpoint."""
    from mpisync import ckptfile
    d = tmp_path / "ckpt"
    d.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = ckptfile._HOST
    names = {"dead": f".ckpt-000000003.pt.tmp-{host}-{gone.pid}",
             "alive": f".ckpt-000000006.pt.tmp-{host}-{os.getpid()}",
             "elsewhere": f".ckpt-000000006.pt.tmp-{host}x-{gone.pid}",
             "kept": ckpt_name(3)}
    for name in names.values():
        (d / name).write_bytes(b"partial")
    net, opt = build(rank, "adagrad")
    mpisync.Checkpointer(d, net, opt, every_steps=1)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        names[k] for k in ("alive", "elsewhere", "kept"))
    train_step(net, opt, 0)                  # a save leaves no partial file of its own
    mpisync.save(d / ckpt_name(1), net, opt)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [names["alive"], names["elsewhere"], ckpt_name(1), ckpt_name(3)])
    opt.close()


# -- hash tables ----------------------------------------------------------------------------
HASH_CAPACITY, HASH_POOL, HASH_STEPS, HASH_BATCH = 40, 150, 10, 8
HASH_OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rowwise": lambda ps: mpisync.RowWiseAdagrad(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),   # every slot
}


class HashNet(torch.nn.Module):
    def __init__(self, seed: int, eviction: str, admit_after: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = mpisync.HashEmbedding(DIM, capacity_per_shard=HASH_CAPACITY, seed=seed,
                                         eviction=eviction, admit_after=admit_after)
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def hash_step(net, opt, t: int) -> None:
    """A step over 3 ids a sample of a pool of unbounded 64-bit ids, common ones more often:
    the shard fills up after a few steps and evicts from then on."""
    g = torch.Generator().manual_seed(100 + t)
    pool = torch.randint(0, 2**62, (HASH_POOL,), generator=torch.Generator().manual_seed(3))
    at = (torch.rand(HASH_BATCH, 3, generator=g) ** 2 * HASH_POOL).long()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(pool[at]), torch.randint(0, 2, (HASH_BATCH,),
                                                                   generator=g)).backward()
    opt.step()


@pytest.mark.parametrize("kind, eviction, admit_after",
                         [("adagrad", "lru", 1), ("rowwise", "lfu", 2),
                          ("sgd-momentum", "lru", 1)])
def test_a_hash_table_chain_merges_to_the_full_file_of_its_step(rank, tmp_path, kind, eviction,
                                                                 admit_after):
    """Each file of a chain holds the rows whose weight, state or counts changed since the
    one before and the ids evicted since; merged, the chain is the full file of its step,
    and loads as it does."""
    d, full = tmp_path / "ckpt", tmp_path / "full"

    def build_hash(seed):
        net = HashNet(seed, eviction, admit_after)
        return net, rank.wrap(net, HASH_OPTIMIZERS[kind](net.parameters()))

    net, opt = build_hash(0)
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=1, full_every=4)
    records, steps = {}, HASH_STEPS
    for t in range(steps):
        hash_step(net, opt, t)
        ckpt.maybe_save()
        mpisync.save(full / f"{t + 1}.pt", net, opt)
        records[t + 1] = table(opt)
    opt.close()
    files = {t: torch.load(d / ckpt_name(t), weights_only=True) for t in range(1, steps + 1)}
    removed = fewer = 0
    for t, ck in files.items():
        shards = ck["tables"][NAME]["shards"]
        if t % 4 == 1:                              # full_every=4
            assert ck["base"] is None and "incremental" not in ck["tables"][NAME], t
            continue
        assert ck["tables"][NAME]["incremental"] is True, t
        held = sum(len(s["ids"]) for s in torch.load(full / f"{t}.pt")["tables"][NAME]["shards"])
        changed = sum(len(s["ids"]) for s in shards)
        removed += sum(len(s["removed"]) for s in shards if s["removed"] is not None)
        if any(s["removed"] is None for s in shards):
            # whole: the optimizer's state appeared since the base (admit_after=2: no
            # row, no gradient, no state at step 1)
            assert (t, admit_after) == (2, 2) and changed == held, t
        elif kind == "sgd-momentum":                # a dense step: every row held
            assert changed == held, t
        else:                                       # the rows a step sighted
            assert 0 < changed <= min(3 * HASH_BATCH, held), t
            fewer += changed < held
        merged = ckptchain.merged_tables(ckptchain.chain(str(d / ckpt_name(t))))[NAME]
        whole = torch.load(full / f"{t}.pt", weights_only=True)["tables"][NAME]
        for got, want in zip(merged["shards"], whole["shards"], strict=True):
            same(dict(got), want, f"shard of step {t}")
    assert removed > 0, "no file named an evicted id: the test does not evict"
    assert fewer or kind == "sgd-momentum", "no file held fewer rows than the table"
    loads_as_full_files(*build_hash(7), d, full, records, (7, 4, 10, 2))


def test_ids_seen_but_not_admitted_yet_keep_their_sightings_across_a_load(rank, tmp_path):
    """admit_after=2: an id seen once before a checkpoint and once after it is admitted
    whether or not the job stopped and loaded the checkpoint in between, from a full
    file or a chain."""
    def build_hash(seed):
        net = HashNet(seed, "lru", 2)
        return net, rank.wrap(net, torch.optim.Adagrad(net.parameters(), lr=0.1))

    def step(net, opt, ids):
        opt.zero_grad()
        net(torch.tensor(ids)).sum().backward()
        opt.step()

    net, opt = build_hash(0)
    ckpt = mpisync.Checkpointer(tmp_path, net, opt, every_steps=1, full_every=4)
    step(net, opt, [[1, 2]])
    step(net, opt, [[1, 3]])                    # 1 admitted; 2 and 3 seen once
    ckpt.maybe_save()
    step(net, opt, [[1, 5]])                    # 5 seen once
    ckpt.maybe_save()                           # incremental
    step(net, opt, [[2, 5]])                    # 2 and 5 admitted
    unbroken = table(opt)
    opt.close()
    assert sorted(unbroken[0][0].tolist()) == [1, 2, 5]
    for t in (3, 2):                            # the chain, then its full base
        net, opt = build_hash(0)                # the table's seed: admitted ids' rows
        step(net, opt, [[7, 8], [7, 9]])        # something else, before the load
        mpisync.load(tmp_path / ckpt_name(t), net, opt)
        if t == 2:
            step(net, opt, [[1, 5]])
        step(net, opt, [[2, 5]])
        same(table(opt), unbroken, f"loaded at step {t}, trained on")
        opt.close()


@pytest.mark.parametrize("kind, update", [("adagrad", False), ("sgd-momentum", False),
                                          ("adagrad", True), ("hash", False),
                                          ("hash-rowwise", False), ("hash-sgd-momentum", True)])
def test_a_file_written_beside_training_holds_its_step_though_later_steps_changed_it(
        rank, tmp_path, monkeypatch, kind, update):
    """The workers go on while the chief writes: each file, full or incremental, still
    holds the table (rows, optimizer state, a hash table's ids and counts) and the model
    of the step it was saved at, though the next two steps changed them before its
    shards were read (rows a step updates, every row of a dense step or of an
    ``opt.update`` function over all rows, ids admitted and evicted)."""
    from mpisync.worker.tables_io import TableShards
    d = tmp_path / "ckpt"
    hashed = kind.startswith("hash")
    how = kind.removeprefix("hash").removeprefix("-") or "adagrad"
    admit = 2 if how == "rowwise" else 1

    def build_hash(seed):
        net = HashNet(seed, "lfu" if admit == 2 else "lru", admit)
        return net, rank.wrap(net, HASH_OPTIMIZERS[how](net.parameters()))

    if hashed:
        net, opt = build_hash(0)
        step = hash_step
    else:
        net, opt = build(rank, kind)
        step = train_step
    if update:
        rank.cluster.helper_comm = lambda what: rank.worker_comm    # one worker: itself
        opt.update(NAME, shrink, rows="all")
    go_on = threading.Event()
    read = TableShards.read_snapshot

    def held(self, name):                           # the writer waits for two more steps
        assert go_on.wait(60)
        yield from read(self, name)

    monkeypatch.setattr(TableShards, "read_snapshot", held)
    ckpt = mpisync.Checkpointer(d, net, opt, every_steps=3, full_every=2)
    saved = {}
    for t in range(12):
        step(net, opt, t)
        if t % 3 == 1:                              # two steps after the save
            go_on.set()
            ckpt.wait()
            go_on.clear()
        if ckpt.maybe_save() is not None:
            saved[opt.global_step] = (table(opt), {k: v.clone() for k, v in
                                                   net.state_dict().items()})
    go_on.set()
    ckpt.wait()
    opt.close()
    assert sorted(saved) == [3, 6, 9, 12]
    for s, (rows, model) in saved.items():
        ck = torch.load(d / ckpt_name(s), weights_only=True)
        assert (ck["base"] is None) == (s in (3, 9)), s       # full_every=2
        if hashed:
            net2, opt2 = build_hash(5)
        else:
            net2, opt2 = build(rank, kind, seed=5)
        mpisync.load(d / ckpt_name(s), net2, opt2)
        got = table(opt2)
        if hashed:                                  # the same ids, maybe in another order
            got, rows = ([(*sorted_by_id(i, w, st),) for i, w, st in x] for x in (got, rows))
        same(got, rows, f"table of step {s}")
        same(net2.state_dict(), model, f"model of step {s}")
        opt2.close()


def sorted_by_id(ids, weight, state):
    order = ids.argsort()
    return ids[order], weight[order], {k: v[order] if torch.is_tensor(v) and v.dim() and
                                       v.shape[0] == len(ids) else v
                                       for k, v in (state or {}).items()}


def test_an_extra_no_file_can_hold_is_refused_at_the_save_not_later(rank, tmp_path):
    """The file is written beside training, but what it cannot hold is refused by the save
    itself, on every worker, and nothing is left behind: the next save writes a full file."""
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(tmp_path, net, opt, every_steps=1)
    train_step(net, opt, 0)
    with pytest.raises(OSError, match=r"failed on the chief: .*(pickle|Pickl).*lambda"):
        ckpt.save(extra={"bad": lambda: 0})
    assert not list(tmp_path.iterdir())
    train_step(net, opt, 1)
    ckpt.maybe_save(extra={"epoch": 1})
    ckpt.wait()
    ck = torch.load(tmp_path / ckpt_name(2), weights_only=True)
    assert ck["base"] is None and ck["extra"] == {"epoch": 1}
    opt.close()


def test_a_failed_write_is_told_at_the_next_save_or_at_close(rank, tmp_path):
    """A file the chief could not write beside training is an OSError naming it at the
    next ``maybe_save()`` (training went on in between), and at ``opt.close()`` when no
    save came after it: the optimizer is closed all the same."""
    net, opt = build(rank, "adagrad")
    ckpt = mpisync.Checkpointer(tmp_path, net, opt, every_steps=1)
    for t in (1, 3):
        (tmp_path / ckpt_name(t)).mkdir()               # the rename onto it fails
    train_step(net, opt, 0)
    ckpt.maybe_save()
    train_step(net, opt, 1)
    with pytest.raises(OSError, match=rf"Checkpointer\.(maybe_save|save)\(\): the checkpoint "
                                      rf"{re.escape(str(tmp_path / ckpt_name(1)))} could not "
                                      rf"be written: IsADirectoryError"):
        ckpt.maybe_save()
    ckpt.maybe_save()                                   # step 2: written, full
    train_step(net, opt, 2)
    ckpt.maybe_save()                                   # step 3: fails, told at close
    with pytest.raises(OSError, match=rf"the checkpoint {re.escape(str(tmp_path / ckpt_name(3)))} "
                                      rf"could not be written: IsADirectoryError"):
        opt.close()
    assert opt.closed
    assert torch.load(tmp_path / ckpt_name(2), weights_only=True)["base"] is None


def test_marks_cost_nothing_until_read_and_then_follow_every_change():
    """A shard's changed rows (``mpisync.ps.changes.Marks``): every row until the first
    read (a step's marking is then skipped, its rows are marked already); after a read,
    the rows changed since; clear() (a snapshot's or a hash shard's read) does the same."""
    from mpisync.ps.changes import Marks

    weight = torch.arange(12.0).view(6, 2)
    marks = Marks(6)
    marks.mark(torch.tensor([1, 4]))
    assert marks.changed.all() and marks.every
    first = marks.read(weight, {}, with_state=False, whole=False)
    assert first["local"].tolist() == list(range(6)) and not marks.every
    marks.mark(torch.tensor([4, 1, 4]))
    marks.mark(None)
    second = marks.read(weight, {}, with_state=False, whole=False)
    assert second["local"].tolist() == [1, 4]
    assert torch.equal(second["weight"], weight[[1, 4]])
    assert marks.read(weight, {}, with_state=False, whole=False)["local"].tolist() == []
    marks.mark(True)                                   # a load: every row again
    assert marks.every and marks.read(weight, {}, False, False)["local"].tolist() == \
        list(range(6))
    marks.mark(True)
    marks.clear()
    marks.mark(torch.tensor([2]))
    assert marks.changed.nonzero().flatten().tolist() == [2]
