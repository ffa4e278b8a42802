"""EmbeddingBag as torch takes it, bags pooled where the rows live, in one process.

The bags (``mpisync.protocol.bags``) and the pooled messages (``mpisync.protocol.pooled``:
what a ps answers and what it makes of a push) are checked against
``nn.EmbeddingBag(sparse=True)``, and every bad bag's message and a collection's refusals
here; the MPI jobs are tests/mpi/test_pooling_jobs.py's.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from mpi_helpers import SCRIPTS

import mpisync
from mpisync.native import kernels, rowslib
from mpisync.protocol import partition
from mpisync.protocol.bags import bags_of, fewest_unique_to_pool, pooling_pays
from mpisync.protocol.pooled import (
    EXCHANGE,
    POOLED,
    Part,
    answer,
    as_lookup_nbytes,
    bag_grads,
    pack_as_lookup,
    pack_parts,
    parts_nbytes,
    row_grads,
    unpack_parts,
)
from mpisync.tables import bagrows

sys.path.insert(0, str(SCRIPTS))
from pooling_errors import BAD

# -- one process: the bags and the messages against nn.EmbeddingBag ------------------------
ROWS, DIM = 30, 3


def _inputs():
    """(name, kwargs of the module, input, offsets, per_sample_weights): what people write."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ROWS, (17,), generator=g)
    jagged = torch.tensor([0, 0, 3, 4, 4, 9, 16])        # empty bags, a bag of one
    psw = torch.rand(17, generator=g) + 0.5
    two_d = torch.randint(0, ROWS, (5, 4), generator=g)
    two_d[1, :] = 7                                        # a bag of padding only
    two_d[2, 1] = 7
    return [
        ("2d-sum", {"mode": "sum"}, two_d, None, None),
        ("2d-mean-padding", {"mode": "mean", "padding_idx": 7}, two_d, None, None),
        ("2d-sum-weights-padding", {"mode": "sum", "padding_idx": 7}, two_d, None,
         torch.rand(5, 4, generator=g)),
        ("jagged-sum", {"mode": "sum"}, ids, jagged, None),
        ("jagged-mean-padding", {"mode": "mean", "padding_idx": int(ids[2])}, ids, jagged,
         None),
        ("jagged-sum-weights", {"mode": "sum"}, ids, jagged, psw),
        ("last-offset-mean", {"mode": "mean", "include_last_offset": True}, ids,
         torch.tensor([0, 2, 2, 9, 17]), None),
        ("last-offset-sum-weights", {"mode": "sum", "include_last_offset": True}, ids,
         torch.tensor([0, 5, 17]), psw),
        ("one-empty-bag", {"mode": "mean"}, ids[:0], torch.tensor([0]), None),
    ]


def _pooled_at(weight: torch.Tensor, kw: dict, input, offsets, psw, shards: int, strategy: str):
    """Forward and backward as mpisync pools them: the bags split among ``shards`` shards
    (held by two ps ranks), each ps's reply summed, then a push's gradient turned into
    rows on each ps. Returns (output, dense gradient of sum(output * grad_out), grad_out)."""
    bags = bags_of(input, offsets, psw, mode=kw["mode"],
                   include_last_offset=kw.get("include_last_offset", False),
                   padding_idx=kw.get("padding_idx"), dtype=weight.dtype)
    shard, local = partition.map_ids(bags.ids, ROWS, shards, strategy)
    params = [weight[partition.unmap_ids(k, torch.arange(n), ROWS, shards, strategy)]
              for k, n in enumerate(partition.shard_rows(ROWS, shards, strategy))]
    parts = []
    for k in range(shards):
        at = shard == k
        w = None if bags.weights is None else bags.weights[at]
        parts.append(Part(local[at], bags.bag[at], w, bags.num_bags) if bool(at.any()) else None)
    on = [[k for k in range(shards) if k % 2 == j] for j in range(2)]
    sums = torch.zeros(bags.num_bags, DIM)
    for ks in on:
        reply = answer(pack_parts(EXCHANGE, [parts[k] for k in ks], []), [params[k] for k in ks],
                       [0] * len(ks))
        if len(reply):
            sums += torch.from_numpy(reply[:4 * DIM * bags.num_bags]).view(torch.float32
                                                                          ).view(-1, DIM)
    leaf = sums.requires_grad_(True)
    out = leaf / bags.counts.clamp(min=1).unsqueeze(1) if kw["mode"] == "mean" else leaf * 1
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad_out)
    dense = torch.zeros(ROWS, DIM)
    for ks in on:
        mine = [parts[k] for k in ks]
        if all(p is None for p in mine):
            continue
        got = row_grads(pack_parts(POOLED, mine, [leaf.grad]), 0, [params[k] for k in ks],
                        [0] * len(ks))
        for k, g in zip(ks, got):
            if g is not None:
                assert torch.equal(g[0], torch.unique(g[0]))    # unique local ids
                dense[partition.unmap_ids(k, g[0], ROWS, shards, strategy)] += g[1]
    return out.detach(), dense, grad_out


@pytest.mark.parametrize("name", [c[0] for c in _inputs()])
def test_a_push_that_names_its_lookup_pools_as_one_that_sends_its_parts(name):
    """The ps keeps a lookup's pooled parts, checked (``answer(kept=)``); a push that names
    that lookup (``AS_LOOKUP``) gives the same rows, bitwise, in fewer bytes; one that names
    another lookup, or none kept, or another number of parts, is refused."""
    _, kw, input, offsets, psw = next(c for c in _inputs() if c[0] == name)
    bags = bags_of(input, offsets, psw, mode=kw["mode"],
                   include_last_offset=kw.get("include_last_offset", False),
                   padding_idx=kw.get("padding_idx"), dtype=torch.float32)
    params = [torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2)),
              torch.randn(4, DIM)]
    parts = [Part(bags.ids, bags.bag, bags.weights, bags.num_bags) if len(bags.ids) else None,
             Part(torch.tensor([1, 3]))]                  # a rows part: not the push's
    kept: list = []
    answer(pack_parts(EXCHANGE, parts, [], seq=7), params, [0, 1], kept=kept)
    assert kept[0] == 7 and kept[1][1] is None
    grads = torch.randn(bags.num_bags, DIM, generator=torch.Generator().manual_seed(3))
    full = pack_parts(POOLED, [parts[0], None], [grads] if parts[0] is not None else [])
    blocks = [grads] if parts[0] is not None else []
    named = pack_as_lookup(7, 2, blocks, np.empty(as_lookup_nbytes(blocks), np.uint8), 0)
    want = row_grads(full, 0, params, [0, 1])
    got = row_grads(named, 0, params, [0, 1], last=kept)
    assert [g is None for g in got] == [w is None for w in want] == [parts[0] is None, True]
    if parts[0] is not None:
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])
        assert named.nbytes < full.nbytes - 8 * len(bags.ids)
    for last, seq, n in ((kept, 8, 2), ([], 7, 2), (kept, 7, 3)):
        wrong = pack_as_lookup(seq, n, blocks, np.empty(as_lookup_nbytes(blocks), np.uint8), 0)
        with pytest.raises(ValueError, match=f"those of its lookup {seq}"):
            bag_grads(wrong, 0, params, [0, 1], last)


@pytest.mark.parametrize("strategy, shards", [("mod", 3), ("div", 4)])
@pytest.mark.parametrize("name", [c[0] for c in _inputs()])
def test_pooled_bags_match_torch(name, strategy, shards):
    _, kw, input, offsets, psw = next(c for c in _inputs() if c[0] == name)
    torch.manual_seed(0)
    ref = torch.nn.EmbeddingBag(ROWS, DIM, sparse=True, **kw)
    out, grad, grad_out = _pooled_at(ref.weight.detach(), kw, input, offsets, psw, shards,
                                     strategy)
    expected = ref(input, offsets, per_sample_weights=psw)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)
    expected.backward(grad_out)
    want = ref.weight.grad.to_dense() if ref.weight.grad is not None else torch.zeros(ROWS, DIM)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-6)


def test_a_ps_sums_bags_in_any_order_of_their_ids():
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([3, 9, 3, 0, 7, 7, 12])
    bag = torch.tensor([0, 0, 1, 3, 3, 3, 4])
    w = torch.rand(7, generator=torch.Generator().manual_seed(3))
    replies = []
    for order in (torch.arange(7), torch.tensor([6, 2, 0, 5, 1, 4, 3])):   # bag order, shuffled
        msg = pack_parts(EXCHANGE, [Part(ids[order], bag[order], w[order], 5)], [])
        replies.append(torch.from_numpy(answer(msg, [weight], [0])[:4 * 5 * DIM]).view(torch.float32)
                       .view(5, DIM))
    want = torch.zeros(5, DIM).index_add_(0, bag, weight[ids] * w[:, None])
    for got in replies:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw, input, offsets, psw, message", BAD)
def test_bad_bags_name_the_table_and_the_rank(kw, input, offsets, psw, message):
    with pytest.raises((ValueError, TypeError),
                       match=r"^worker 1 \(rank 1\): mpisync\.EmbeddingBag 'emb\.weight' got "
                       + message):
        bags_of(input, offsets, psw, mode=kw["mode"],
                include_last_offset=kw.get("include_last_offset", False), padding_idx=None,
                dtype=torch.float32, label="worker 1 (rank 1)", name="emb.weight")
    # torch refuses the same, but for: the last offset taken as the end of the last bag (it
    # divides a mean by the bag's ids up to the input's end), and offsets that decrease
    # (with one thread it reads past the bag and returns what memory held)
    if "include_last_offset" not in kw and "decrease" not in message:
        with pytest.raises((ValueError, RuntimeError, TypeError, IndexError)):
            torch.nn.EmbeddingBag(10, 2, **kw)(input, offsets, per_sample_weights=psw)


@pytest.mark.parametrize("name", [c[0] for c in _inputs()])
def test_the_rows_path_keeps_the_ids_and_weights_the_forward_took(name):
    """A loader that reuses its buffers overwrites the ids and weights after the forward:
    the rows path's backward (``bagrows.pool`` over the flattened bags) still takes the
    forward's, as ``nn.EmbeddingBag`` given them alone would."""
    _, kw, input, offsets, psw = next(c for c in _inputs() if c[0] == name)
    ref = torch.nn.EmbeddingBag(ROWS, DIM, sparse=True, **kw)
    ref(input, offsets, per_sample_weights=psw).sum().backward()
    want = ref.weight.grad.to_dense()
    batch, weights = input.clone(), None if psw is None else psw.clone()
    mode, pad_id = kw["mode"], kw.get("padding_idx")
    bags = bags_of(batch, offsets, weights, mode=mode, padding_idx=pad_id,
                   include_last_offset=kw.get("include_last_offset", False),
                   dtype=torch.float32)
    unique, inverse = torch.unique(batch, sorted=True, return_inverse=True)
    pad = None if pad_id is None or pad_id not in unique.tolist() else \
        unique.tolist().index(pad_id)
    rows = ref.weight.detach()[unique].requires_grad_(True)
    out = bagrows.pool(rows, inverse.view(batch.shape), unique, bags, offsets, mode, weights,
                       pad, kw.get("include_last_offset", False))
    batch.fill_(0)
    if weights is not None:
        weights.fill_(7)
    out.sum().backward()
    got = torch.zeros(ROWS, DIM).index_add_(0, unique, rows.grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compiled", [True, False])
def test_bags_in_order_travel_as_offsets_and_come_back_as_they_were(compiled, monkeypatch):
    """Bags that never decrease (empty bags among them, first and last) go as their
    num_bags + 1 offsets, others as one bag a position; unpacked, each part is what was
    packed. Offsets that do not run from 0 to the count in order are refused."""
    if not compiled:
        monkeypatch.setattr(rowslib, "_lib", None)
    g = torch.Generator().manual_seed(5)
    ordered = torch.tensor([1, 1, 2, 2, 2, 4, 6, 6])            # bags 0, 3, 5 and 7 empty
    shuffled = ordered[torch.randperm(8, generator=g)]
    parts = [Part(torch.randint(0, ROWS, (8,), generator=g), ordered, None, 8),
             Part(torch.randint(0, ROWS, (8,), generator=g), shuffled,
                  torch.rand(8, generator=g), 8),
             None, Part(torch.tensor([4, 9]))]
    msg = pack_parts(EXCHANGE, parts, [])
    head = 8 * (3 + 3 * 4)
    assert len(msg) == parts_nbytes(parts, []) == head + 8 * (8 + 9) + 8 * (8 + 8) + 4 * 8 \
        + 8 * 2
    _, got, at = unpack_parts(msg, [torch.float32] * 4)
    assert at == len(msg) and got[2] is None and not got[3].pooled
    for a, b in zip(parts, got):
        if a is not None:
            assert torch.equal(a.ids, b.ids) and a.num_bags == b.num_bags
            assert (a.bag is None and b.bag is None) or torch.equal(a.bag, b.bag)
            assert (a.weights is None and b.weights is None) or torch.equal(a.weights,
                                                                              b.weights)
    offsets = torch.from_numpy(msg[head + 64:head + 64 + 72]).view(torch.int64)
    assert offsets.tolist() == [0, 0, 2, 5, 5, 6, 6, 8, 8]
    for bad in ([1, 0, 2, 5, 5, 6, 6, 8, 8], [0, 0, 2, 5, 4, 6, 6, 8, 8],
                [0, 0, 2, 5, 5, 6, 6, 8, 7]):
        broken = msg.copy()
        broken[head + 64:head + 64 + 72] = torch.tensor(bad).numpy().view("uint8")
        with pytest.raises(ValueError, match="offsets do not run from 0"):
            unpack_parts(broken, [torch.float32] * 4)


def test_pool_on_ps_is_refused_for_max_and_must_be_a_known_choice():
    with pytest.raises(ValueError, match=r"pool_on_ps=True cannot pool mode='max'"):
        mpisync.EmbeddingBag(10, 2, mode="max", pool_on_ps=True)
    with pytest.raises(ValueError, match=r"pool_on_ps must be False, True or 'auto', got 1"):
        mpisync.EmbeddingBag(10, 2, pool_on_ps=1)
    assert mpisync.EmbeddingBag(10, 2, mode="max", pool_on_ps="auto").pool_on_ps == "auto"


def test_auto_pools_long_bags_of_rare_ids_and_looks_up_repeated_ones():
    # the benchmark's batch: 4096 bags of 20 ids, nearly all distinct, 64 float32, 1 ps rank
    assert pooling_pays(81920, 78700, 4096, 256, 0, 1)
    # bags of one id: the pooled rows cost as much as the rows
    assert not pooling_pays(4096, 4000, 4096, 256, 0, 2)
    # bags of 20 drawn from 50 ids: 50 rows travel, not 4096 sums
    assert not pooling_pays(81920, 50, 4096, 256, 0, 1)


@pytest.mark.parametrize("seed", range(4))
def test_auto_decides_by_counting_distinct_ids_only_as_far_as_it_must(seed):
    """What a forward in ``"auto"`` does: count distinct ids until the fewest for which
    pooling pays (no sort); the same answer as ``pooling_pays`` on the exact count."""
    g = torch.Generator().manual_seed(seed)
    for rows in (50, 5000, 10 ** 6):
        for n, bags in ((4096, 4096), (81920, 4096), (20, 1), (0, 3), (600, 30)):
            ids = torch.randint(0, rows, (n,), generator=g)
            for ps, weight in ((1, 0), (2, 4)):
                least = fewest_unique_to_pool(n, bags, 256, weight, ps)
                want = pooling_pays(n, len(ids.unique()), bags, 256, weight, ps)
                assert (len(ids.unique()) >= least) == want
                if kernels.available():
                    assert kernels.holds_distinct(ids, least) == want
                    assert kernels.holds_distinct(ids.int(), least) == want     # any dtype,
                    assert kernels.holds_distinct(ids.view(-1, 1)[::1], least) == want  # shape
                    assert kernels.holds_distinct(ids, len(ids.unique()))
                    assert not kernels.holds_distinct(ids, len(ids.unique()) + 1)


@pytest.mark.skipif(not kernels.available(), reason="the kernels are not built here")
def test_unique_inverse_equals_torchs_unique_on_any_ids():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randint(-2 ** 62, 2 ** 62, (1500,), generator=gen)
    cases = [torch.zeros(0, dtype=torch.int64), torch.tensor([7]), torch.tensor([5, 5, 5]),
             torch.tensor([-3, 2 ** 62, -2 ** 63, 0, 2 ** 63 - 1, -3, 0] * 400),
             torch.randint(0, 10, (4000,), generator=gen),                # few: qsort
             torch.randint(0, 10 ** 6, (4096,), generator=gen),           # two digits
             torch.randint(0, 2 ** 33, (3000,), generator=gen),           # three digits
             torch.randint(-1000, 1000, (5000,), generator=gen),
             torch.tensor([0, 2 ** 33] * 1100),                           # range 2**33
             wide[torch.randint(0, 1500, (6000,), generator=gen)],        # six digits
             torch.randint(-2 ** 40, 2 ** 40, (3000,), generator=gen),    # spread: torch's
             torch.randint(0, 50, (1024, 3), generator=gen).int(),        # any shape, int32
             torch.randint(0, 7, (50, 20, 8), generator=gen)[:, :, ::2],  # strided
             torch.randint(0, 10, (100,), generator=gen)]                 # few: torch's
    for ids in cases:
        got_unique, got_inverse = kernels.unique_inverse(ids)
        want_unique, want_inverse = torch.unique(ids.long(), sorted=True, return_inverse=True)
        assert torch.equal(got_unique, want_unique), ids
        assert torch.equal(got_inverse, want_inverse), ids
        assert got_unique.dtype == got_inverse.dtype == torch.int64
        assert got_inverse.shape == ids.shape


def _colliding(count: int) -> list[int]:
    """``count`` ids that all fall in the first slot of the kernel's table (Fibonacci
    hashing: the top bits of ``id * 0x9E3779B97F4A7C15``)."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 2 ** 64)
    ids = [inverse * i % 2 ** 64 for i in range(count)]
    return [i - 2 ** 64 if i >= 2 ** 63 else i for i in ids]


@pytest.mark.skipif(not kernels.available(), reason="the kernels are not built here")
def test_unique_inverse_of_ids_made_to_collide_equals_torchs():
    # every id in the table's first slot: the kernel gives up and torch.unique answers
    ids = torch.tensor(_colliding(3000) * 2)
    got_unique, got_inverse = kernels.unique_inverse(ids)
    want_unique, want_inverse = torch.unique(ids, sorted=True, return_inverse=True)
    assert torch.equal(got_unique, want_unique) and torch.equal(got_inverse, want_inverse)
    assert got_unique.untyped_storage().nbytes() == 8 * 3000     # not the batch's buffer


def test_a_collection_names_a_feature_it_has_no_table_or_no_input_for():
    ebc = mpisync.EmbeddingBagCollection({k: mpisync.EmbeddingBag(10, 2) for k in "ab"})
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(KeyError, match=r"this worker: mpisync\.EmbeddingBagCollection got no "
                                       r"input for features \['b'\]; as TorchRec's"):
        ebc({"a": ids})
    with pytest.raises(KeyError, match=r"got features \['c'\] that have no table here; the "
                                       r"tables are \['a', 'b'\]"):
        ebc({"a": ids, "b": ids, "c": ids})
