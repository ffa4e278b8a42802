"""EmbeddingBagCollection fed a KeyedJaggedTensor, against the same batch as a dict (one
process), a hash table in the same exchange, and tables refusing a device this process
cannot use.

The tables live on a real SyncReplicasOptimizer: this process is worker 0 and ps 0 of a
private COMM_SELF (``test_refusals.OneRank``). A small stand-in for TorchRec's
``KeyedJaggedTensor`` (its methods only) feeds one collection, the same batch as a dict
feeds a twin with the same rows: the pooled outputs, and the rows after a step, are
bitwise the same. Every bad KJT is a ``ValueError`` or ``KeyError`` naming what was wrong
and the worker, before anything is sent, and training goes on after it.
"""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from test_refusals import WORKER, OneRank

import mpisync

FEATURES = {"user": (20, 4), "item": (30, 3), "page": (10, 2)}     # rows, dim
BATCH = 3


def collection() -> mpisync.EmbeddingBagCollection:
    """Three sum tables: rows looked up, bags pooled at the owner, offsets with their end."""
    return mpisync.EmbeddingBagCollection({
        "user": mpisync.EmbeddingBag(20, 4, mode="sum", seed=1),
        "item": mpisync.EmbeddingBag(30, 3, mode="sum", seed=2, pool_on_ps=True),
        "page": mpisync.EmbeddingBag(10, 2, mode="sum", seed=3, include_last_offset=True)})


class FakeKJT:
    """What EmbeddingBagCollection reads of TorchRec's KeyedJaggedTensor: bags of key ``k``
    are ``lengths[k * stride:(k + 1) * stride]``, their ids and weights one after another."""

    def __init__(self, keys, values, lengths, weights=None, variable=False):
        self._keys, self._values, self._lengths = list(keys), values, lengths
        self._weights, self._variable = weights, variable

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def offsets(self):
        return torch.cat([torch.zeros(1, dtype=self._lengths.dtype),
                          torch.cumsum(self._lengths, 0).to(self._lengths.dtype)])

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return len(self._lengths) // len(self._keys)

    def variable_stride_per_key(self):
        return self._variable


class OffsetsOnlyKJT(FakeKJT):
    """A KJT-shaped object with offsets and no lengths."""

    lengths = None


def batch(seed: int, weighted: bool = False):
    """``(kjt, {feature: (ids, offsets, weights)})`` of one batch, keys in another order
    than the collection's; some bags empty."""
    g = torch.Generator().manual_seed(seed)
    order = ["item", "page", "user"]
    lengths, ids = [], []
    for key in order:
        rows = FEATURES[key][0]
        bag_lengths = torch.randint(0, 4, (BATCH,), generator=g)
        bag_lengths[1] = 0                                   # an empty bag in every key
        lengths.append(bag_lengths)
        ids.append(torch.randint(0, rows, (int(bag_lengths.sum()),), generator=g))
    values = torch.cat(ids)
    weights = torch.rand(len(values), generator=g) if weighted else None
    kjt = FakeKJT(order, values, torch.cat(lengths).to(torch.int32), weights)
    features, start = {}, 0
    for key, bag_lengths, key_ids in zip(order, lengths, ids):
        ends = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(bag_lengths, 0)])
        offsets = ends if key == "page" else ends[:-1]      # page: include_last_offset
        w = None if weights is None else weights[start:start + len(key_ids)]
        features[key] = (key_ids, offsets, w)
        start += len(key_ids)
    return kjt, features


@pytest.fixture
def twins():
    """``(opt, by_kjt, by_dict)``: two collections of the same rows, one optimizer."""
    rank = OneRank()
    try:
        model = torch.nn.ModuleDict({"kjt": collection(), "dict": collection()})
        opt = rank.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5))
        yield opt, model["kjt"], model["dict"]
    finally:
        rank.end()


def rows(ebc) -> dict[str, torch.Tensor]:
    return {k: ebc.tables[k].rows(torch.arange(FEATURES[k][0])) for k in FEATURES}


def step(opt, by_kjt, by_dict, seed: int, weighted: bool = False):
    """One step of both on the same batch; their outputs."""
    kjt, features = batch(seed, weighted)
    opt.zero_grad()
    kt = by_kjt(kjt)
    pooled = by_dict(features)
    target = torch.randn(BATCH, 9, generator=torch.Generator().manual_seed(seed))
    (kt.values() * target).sum().backward()
    (torch.cat(list(pooled.values()), dim=1) * target).sum().backward()
    opt.step()
    return kt, pooled


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_a_kjt_pools_and_trains_as_the_same_batch_as_a_dict(twins, weighted):
    opt, by_kjt, by_dict = twins
    first = rows(by_kjt)
    assert all(torch.equal(first[k], rows(by_dict)[k]) for k in FEATURES)
    for seed in (1, 2):
        kt, pooled = step(opt, by_kjt, by_dict, seed, weighted)
        assert isinstance(kt, mpisync.KeyedTensor)
        assert kt.keys() == ["user", "item", "page"]     # the collection's order, as TorchRec
        assert list(pooled) == kt.keys()
        assert kt.length_per_key() == [4, 3, 2] and kt.offset_per_key() == [0, 4, 7, 9]
        assert kt.key_dim() == 1
        assert torch.equal(kt.values(), torch.cat(list(pooled.values()), dim=1))
        as_dict = kt.to_dict()
        assert list(as_dict) == list(pooled)
        for key, out in pooled.items():
            assert torch.equal(as_dict[key], out) and torch.equal(kt[key], out)
            assert as_dict[key].data_ptr() == kt[key].data_ptr()      # views of values()
        assert pooled["user"][1].abs().sum() == 0        # an empty bag pools to zeros
        after_kjt, after_dict = rows(by_kjt), rows(by_dict)
        for key in FEATURES:
            assert torch.equal(after_kjt[key], after_dict[key]), key
    assert opt.global_step == 2
    assert all(not torch.equal(after_kjt[k], first[k]) for k in FEATURES)    # they trained


def test_a_kjt_with_offsets_only_reads_them(twins):
    _, by_kjt, by_dict = twins
    kjt, features = batch(3)
    only = OffsetsOnlyKJT(kjt.keys(), kjt.values(), kjt.lengths())
    with torch.no_grad():
        assert torch.equal(by_kjt(only).values(), by_kjt(kjt).values())
        assert torch.equal(by_kjt(only).values(),
                           torch.cat(list(by_dict(features).values()), dim=1))


def _bad(kjt: FakeKJT, what: str):
    """``kjt`` spoilt as ``what`` says."""
    keys, values, lengths, weights = (kjt.keys(), kjt.values(), kjt.lengths(),
                                      kjt.weights_or_none())
    if what == "sum":
        return FakeKJT(keys, values[:-1], lengths)
    if what == "negative":
        spoilt = lengths.clone()
        spoilt[0] += 1
        spoilt[1] -= 1           # the same sum, bag 1 at -1
        return FakeKJT(keys, values, spoilt)
    if what == "multiple":
        return FakeKJT(keys, values[:len(values) - int(lengths[-1])], lengths[:-1])
    if what == "weights":
        return FakeKJT(keys, values, lengths, weights[:-1])
    if what == "variable":
        return FakeKJT(keys, values, lengths, variable=True)
    if what == "unknown":
        return FakeKJT(keys[:2] + ["query"], values, lengths)
    if what == "missing":
        n = kjt.stride() * 2
        return FakeKJT(keys[:2], values[:int(lengths[:n].sum())], lengths[:n])
    raise AssertionError(what)


BAD = [
    ("sum", ValueError, r"lengths sum to \d+ but whose values\(\) has \d+ ids"),
    ("negative", ValueError, r"with a negative length: bag 1 has length -1"),
    ("multiple", ValueError, rf"of {3 * BATCH - 1} bags for 3 keys; expected a multiple"),
    ("weights", ValueError, r"weights_or_none\(\) has shape \[\d+\]; expected one weight"),
    ("variable", ValueError, r"variable batch size per feature"),
    ("unknown", KeyError, r"features \['query'\] that have no table here"),
    ("missing", KeyError, r"no input for features \['user'\]"),
]


@pytest.mark.parametrize("what,kind,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_kjt_is_refused_naming_it_and_training_goes_on(twins, what, kind, message):
    opt, by_kjt, by_dict = twins
    kjt, _ = batch(4, weighted=True)
    with pytest.raises(kind, match=rf"{re.escape(WORKER)}: mpisync\.EmbeddingBagCollection got .*"
                                   rf"{message}"):
        by_kjt(_bad(kjt, what))
    step(opt, by_kjt, by_dict, 5)
    assert opt.global_step == 1


def test_a_keyed_tensor_says_what_it_holds():
    kt = mpisync.KeyedTensor(["a", "b"], [2, 3], torch.arange(10.).view(2, 5))
    assert torch.equal(kt["b"], torch.tensor([[2., 3., 4.], [7., 8., 9.]]))
    assert kt.offset_per_key() == [0, 2, 5]
    with pytest.raises(KeyError, match=r"KeyedTensor has no key 'c'; its keys are \['a', 'b'\]"):
        kt["c"]
    with pytest.raises(ValueError, match=r"values of shape \[2, 4\]; expected \(batch, 5\)"):
        mpisync.KeyedTensor(["a", "b"], [2, 3], torch.zeros(2, 4))
    assert repr(kt) == "KeyedTensor(keys=['a', 'b'], length_per_key=[2, 3], values=(2, 5))"


@pytest.mark.skipif(importlib.util.find_spec("torchrec") is None,
                    reason="torchrec is not installed")
def test_a_real_keyed_jagged_tensor(twins):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    _, by_kjt, by_dict = twins
    fake, features = batch(6, weighted=True)
    kjt = KeyedJaggedTensor(keys=fake.keys(), values=fake.values(), lengths=fake.lengths(),
                            weights=fake.weights_or_none())
    with torch.no_grad():
        assert torch.equal(by_kjt(kjt).values(), by_kjt(fake).values())
        assert torch.equal(by_kjt(kjt).values(),
                           torch.cat(list(by_dict(features).values()), dim=1))


# -- devices -----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("table", [mpisync.Embedding, mpisync.EmbeddingBag])
def test_cuda_without_cuda_is_refused_at_construction(table):
    with pytest.raises(ValueError, match=rf"^mpisync\.{table.__name__}\(10, 4, device='cuda'\): "
                                         r"this process's torch cannot use device 'cuda': CUDA "
                                         r"is not available"):
        table(10, 4, device="cuda")


def test_a_cuda_ordinal_beyond_the_devices_is_refused():
    with pytest.raises(ValueError, match=r"^mpisync\.EmbeddingBag\(10, 4, device='cuda:99'\): "
                                         r"this process's torch cannot use device 'cuda:99'"):
        mpisync.EmbeddingBag(10, 4, device="cuda:99")


def test_a_bogus_device_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"^mpisync\.EmbeddingBag\(10, 4, device='bogus'\): "
                                         r"device 'bogus' is not a device torch knows: "):
        mpisync.EmbeddingBag(10, 4, device="bogus")
    assert mpisync.EmbeddingBag(10, 4, device="cpu").device == torch.device("cpu")


# -- hash tables in a collection ---------------------------------------------------------------
HUGE = 10**15          # the hash table's ids: any int64


def hashed_pair():
    """``(together, user, huge)``: a collection of a table and a hash table, and the same
    two tables' twins to be looked up one by one."""
    together = mpisync.EmbeddingBagCollection({
        "user": mpisync.EmbeddingBag(20, 4, mode="sum", seed=1),
        "huge": mpisync.HashEmbeddingBag(3, capacity_per_shard=40, mode="sum", seed=5)})
    return together, mpisync.EmbeddingBag(20, 4, mode="sum", seed=1), \
        mpisync.HashEmbeddingBag(3, capacity_per_shard=40, mode="sum", seed=5)


def hashed_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, 20, (BATCH, 2), generator=g)
    huge = HUGE + torch.randint(0, 12, (7,), generator=g) * 7919     # 1-D, with offsets
    offsets = torch.tensor([0, 3, 3])                                # an empty bag
    weights = torch.rand(7, generator=g)
    lengths = torch.tensor([2] * BATCH + [3, 0, 4])
    kjt = FakeKJT(["user", "huge"], torch.cat([user.flatten(), huge]), lengths,
                  torch.cat([torch.ones(2 * BATCH), weights]))
    return kjt, user, (huge, offsets, weights)


def test_a_hash_table_joins_the_collections_exchange_and_trains_as_alone():
    """One message per ps rank for both tables (training mode), the same sightings, pooled
    bags, gradients and rows as the two tables looked up one by one; in eval mode the hash
    table reads without sighting."""
    rank = OneRank()
    try:
        together, user, huge = hashed_pair()
        model = torch.nn.ModuleDict({"together": together, "user": user, "huge": huge})
        opt = rank.wrap(model, torch.optim.Adagrad(model.parameters(), lr=0.3))
        channel = user.table.channel
        ids = HUGE + torch.arange(12) * 7919
        for seed in (1, 2, 3):
            kjt, user_ids, (huge_ids, offsets, weights) = hashed_batch(seed)
            opt.zero_grad()
            sent = channel.lookups[0][0]
            kt = together(kjt)
            assert channel.lookups[0][0] == sent + 1          # one exchange for both tables
            one = user(user_ids.flatten(), torch.arange(0, 2 * BATCH, 2),
                       torch.ones(2 * BATCH))
            other = huge(huge_ids, offsets, weights)
            assert channel.lookups[0][0] == sent + 3          # apart: one more each
            assert kt.keys() == ["user", "huge"] and kt.length_per_key() == [4, 3]
            assert torch.equal(kt["user"], one) and torch.equal(kt["huge"], other)
            assert kt["huge"][1].abs().sum() == 0             # the empty bag
            target = torch.randn(BATCH, 7, generator=torch.Generator().manual_seed(seed))
            (kt.values() * target).sum().backward()
            (torch.cat([one, other], dim=1) * target).sum().backward()
            opt.step()
            assert torch.equal(together.tables["huge"].rows(ids), huge.rows(ids))
            assert torch.equal(together.tables["user"].rows(torch.arange(20)),
                               user.rows(torch.arange(20)))
        assert together.tables["huge"].rows(ids).abs().sum() > 0        # admitted, trained
        stats = opt.stats["hash_tables"]
        assert stats["together.tables.huge.weight"] == stats["huge.weight"]
        together.eval()
        huge.eval()
        kjt, user_ids, (huge_ids, offsets, weights) = hashed_batch(9)
        with torch.no_grad():
            kt = together(kjt)
            assert torch.equal(kt["huge"], huge(huge_ids, offsets, weights))
        assert opt.stats["hash_tables"]["together.tables.huge.weight"] == \
            stats["together.tables.huge.weight"]                   # eval: nothing sighted
    finally:
        rank.end()


def test_a_hash_table_that_would_overflow_a_shard_is_refused_before_anything_is_sent():
    rank = OneRank()
    try:
        together = mpisync.EmbeddingBagCollection({
            "user": mpisync.EmbeddingBag(20, 4, mode="sum", seed=1),
            "huge": mpisync.HashEmbeddingBag(3, capacity_per_shard=4, mode="sum")})
        opt = rank.wrap(together, torch.optim.SGD(together.parameters(), lr=0.1))
        channel = together.tables["user"].table.channel
        sent = channel.lookups[0][0]
        with pytest.raises(mpisync.CapacityError, match=r"needs 6 rows on shard 0 .* more "
                                                       r"than its capacity_per_shard=4"):
            together({"user": torch.zeros(2, 1, dtype=torch.long),
                      "huge": HUGE + torch.arange(6).view(2, 3)})
        assert channel.lookups[0][0] == sent and opt.global_step == 0
    finally:
        rank.end()
