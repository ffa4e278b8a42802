"""One-process tests for mpisync.protocol.partition: TF's partitioners, shard layout, id maps,
resolve.

Expected values are computed here from the documented formulas, written independently of
the code under test: TF's partitioners in TF's own float arithmetic, the "div" map as a
slow loop over ids.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # lets a bare `pytest` find the package without installing it
    sys.path.insert(0, str(ROOT))

partition = importlib.import_module("mpisync.protocol.partition")
fixed_size = partition.fixed_size
min_max = partition.min_max
axis_size = partition.axis_size
shard_sizes = partition.shard_sizes
shard_offsets = partition.shard_offsets
shard_rows = partition.shard_rows
map_ids = partition.map_ids
unmap_ids = partition.unmap_ids
resolve = partition.resolve

ITEMSIZES = (1, 2, 4, 8, 16)


# --- TensorFlow's formulas, re-derived line for line -------------------------------------


def tf_fixed_size(shape: tuple[int, ...], num_shards: int) -> int:
    """fixed_size_partitioner: min(num_shards, shape[0]); mpisync adds a floor of 1."""
    return max(1, min(num_shards, shape[0]))


def tf_min_max(
    shape: tuple[int, ...], itemsize: int, max_partitions: int, min_slice_size: int
) -> int:
    """min_max_variable_partitioner, in TF's float arithmetic."""
    total_size_bytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    partitions = total_size_bytes / min_slice_size
    return max(1, min(shape[0], max_partitions, math.ceil(partitions)))


def tf_axis_size(
    shape: tuple[int, ...], itemsize: int, max_shard_bytes: int, max_shards: int | None
) -> int:
    """variable_axis_size_partitioner, in TF's float arithmetic (1 where TF divides by 0)."""
    num_elements = int(np.prod(shape, dtype=np.int64))
    if shape[0] == 0 or num_elements == 0:
        return 1
    bytes_per_slice = 1.0 * (num_elements / shape[0]) * itemsize
    slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
    axis_shards = math.ceil(1.0 * shape[0] / slices_per_shard)
    if max_shards:
        axis_shards = min(max_shards, axis_shards)
    return axis_shards


def slow_div_map(ids: list[int], num_rows: int, n: int) -> tuple[list[int], list[int]]:
    """embedding_lookup's "div" map, one id at a time, with an explicit threshold."""
    ids_per_partition = num_rows // n
    extras = num_rows % n
    threshold = extras * (ids_per_partition + 1)
    shards, locals_ = [], []
    for i in ids:
        if i < threshold:
            shards.append(i // (ids_per_partition + 1))
            locals_.append(i % (ids_per_partition + 1))
        else:
            shards.append(extras + (i - threshold) // ids_per_partition)
            locals_.append((i - threshold) % ids_per_partition)
    return shards, locals_


def random_shape(rng: random.Random) -> tuple[int, ...]:
    rows = rng.choice([0, 1, 2, 3, 7, rng.randint(0, 100), rng.randint(100, 1_000_000)])
    rest = tuple(rng.choice([0, 1, 3, 16, rng.randint(1, 300)]) for _ in range(rng.randint(0, 3)))
    return (rows, *rest)


def random_partitioner(rng: random.Random):
    kind = rng.randrange(3)
    if kind == 0:
        return fixed_size(rng.randint(1, 40))
    if kind == 1:
        return min_max(
            rng.randint(1, 64), rng.choice([1, 7, 1024, 256 << 10, rng.randint(1, 10**6)])
        )
    return axis_size(rng.randint(1, 10**7), rng.choice([None, rng.randint(1, 30)]))


# --- the partitioners against TF ---------------------------------------------------------


def test_public_api() -> None:
    import mpisync

    assert all(hasattr(partition, name) for name in partition.__all__)
    for name in ("fixed_size", "min_max", "axis_size"):     # what users call
        assert getattr(mpisync, name) is getattr(partition, name)
    assert partition.STRATEGIES == ("mod", "div")


def test_fixed_size_matches_tensorflow_on_random_shapes() -> None:
    rng = random.Random(11)
    for _ in range(300):
        shape, itemsize, n = random_shape(rng), rng.choice(ITEMSIZES), rng.randint(1, 40)
        assert fixed_size(n).num_shards(shape, itemsize) == tf_fixed_size(shape, n), (shape, n)


def test_min_max_matches_tensorflow_on_random_shapes() -> None:
    rng = random.Random(12)
    for _ in range(400):
        shape, itemsize = random_shape(rng), rng.choice(ITEMSIZES)
        max_partitions = rng.randint(1, 64)
        min_slice_size = rng.choice([1, 7, 1024, 256 << 10, rng.randint(1, 10**6)])
        got = min_max(max_partitions, min_slice_size).num_shards(shape, itemsize)
        expected = tf_min_max(shape, itemsize, max_partitions, min_slice_size)
        assert got == expected, (shape, itemsize, max_partitions, min_slice_size)


def test_axis_size_matches_tensorflow_on_random_shapes() -> None:
    rng = random.Random(13)
    for _ in range(400):
        shape, itemsize = random_shape(rng), rng.choice(ITEMSIZES)
        max_shard_bytes = rng.choice([1, 4, 1000, (64 << 20) - 1, rng.randint(1, 10**7)])
        max_shards = rng.choice([None, 1, 3, rng.randint(1, 50)])
        got = axis_size(max_shard_bytes, max_shards).num_shards(shape, itemsize)
        expected = tf_axis_size(shape, itemsize, max_shard_bytes, max_shards)
        assert got == expected, (shape, itemsize, max_shard_bytes, max_shards)


def test_every_partitioner_is_capped_at_rows_and_at_least_one() -> None:
    rng = random.Random(14)
    for _ in range(300):
        partitioner, shape = random_partitioner(rng), random_shape(rng)
        shards = partitioner.num_shards(shape, rng.choice(ITEMSIZES))
        assert type(shards) is int
        assert 1 <= shards <= max(1, shape[0]), (partitioner, shape, shards)
        if shape[0] == 0:
            assert shards == 1
    # more shards asked for than there are rows: one shard per row
    assert fixed_size(8).num_shards((3, 5), 4) == 3
    assert min_max(100, 1).num_shards((5, 7), 4) == 5
    assert axis_size(1).num_shards((6, 7), 4) == 6
    for partitioner in (fixed_size(8), min_max(100, 1), axis_size(1)):
        assert partitioner.num_shards((0,), 4) == 1
        assert partitioner.num_shards((0, 9), 4) == 1


@pytest.mark.parametrize(
    ("partitioner", "shape", "itemsize", "expected"),
    [
        (fixed_size(3), (10,), 4, 3),
        (fixed_size(3), (10, 5), 8, 3),
        (fixed_size(1), (10, 5), 4, 1),
        # TF's docstring: float32 [1024, 1024] is 4 MiB = 16 slices of 256 KiB
        (min_max(16), (1024, 1024), 4, 16),
        (min_max(64), (1024, 1024), 4, 16),
        (min_max(5), (1024, 1024), 4, 5),
        (min_max(), (1024, 1024), 4, 1),
        (min_max(64), (1024, 1024 + 1), 4, 17),  # ceil: a partial slice counts
        (min_max(64), (100, 10), 4, 1),  # 4000 bytes < 256 KiB
        # one row of (100, 10) float32 is 40 bytes
        (axis_size(400), (100, 10), 4, 10),  # 10 rows per shard
        (axis_size(399), (100, 10), 4, 12),  # 9 rows per shard: ceil(100 / 9)
        (axis_size(400, max_shards=5), (100, 10), 4, 5),
        (axis_size(39), (100, 10), 4, 100),  # a row over the limit gets its own shard
        (axis_size((64 << 20) - 1), (1 << 20, 64), 4, 5),  # 256 MiB in < 64 MiB shards
    ],
)
def test_partitioners_by_hand(partitioner, shape, itemsize, expected) -> None:
    assert partitioner.num_shards(shape, itemsize) == expected


def test_num_shards_accepts_torch_size_lists_and_numpy_ints() -> None:
    weight = torch.zeros(10, 3)
    assert fixed_size(4).num_shards(weight.shape, weight.element_size()) == 4
    assert fixed_size(4).num_shards([10, 3], np.int64(4)) == 4
    assert fixed_size(np.int32(4)) == fixed_size(4)


# --- partitioners as values --------------------------------------------------------------


@pytest.mark.parametrize(
    ("partitioner", "text"),
    [
        (fixed_size(4), "fixed_size(4)"),
        (min_max(), "min_max(max_partitions=1, min_slice_size=262144)"),
        (min_max(8, 1024), "min_max(max_partitions=8, min_slice_size=1024)"),
        (axis_size(1000), "axis_size(max_shard_bytes=1000, max_shards=None)"),
        (axis_size(1000, 3), "axis_size(max_shard_bytes=1000, max_shards=3)"),
    ],
)
def test_partitioner_repr_pickle_equality(partitioner, text: str) -> None:
    assert repr(partitioner) == text
    assert eval(text, vars(partition)) == partitioner  # the repr is the factory call
    assert pickle.loads(pickle.dumps(partitioner)) == partitioner
    assert hash(pickle.loads(pickle.dumps(partitioner))) == hash(partitioner)
    assert isinstance(partitioner, partition.Partitioner)
    with pytest.raises(dataclasses.FrozenInstanceError):
        partitioner.max_shards = 2


def test_partitioners_of_different_kinds_or_args_differ() -> None:
    assert fixed_size(2) != fixed_size(3)
    assert fixed_size(1) != min_max(1)
    assert axis_size(10) != axis_size(10, 2)
    assert len({fixed_size(2), fixed_size(2), min_max(2), axis_size(2)}) == 3


# --- shard layout ------------------------------------------------------------------------


def test_shard_sizes_first_remainder_shards_are_one_row_larger() -> None:
    rng = random.Random(21)
    cases = [(rng.randint(0, 500), rng.randint(1, 40)) for _ in range(400)]
    cases += [(0, 1), (1, 1), (2, 5), (10, 10), (11, 10)]
    for rows, n in cases:
        sizes = shard_sizes(rows, n)
        assert len(sizes) == n
        assert sum(sizes) == rows
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # the larger shards come first
        assert sizes.count(rows // n + 1) == rows % n or rows % n == 0
        offsets = shard_offsets(rows, n)
        assert offsets == [sum(sizes[:p]) for p in range(n)]
        for strategy in ("mod", "div"):
            if n <= max(1, rows):
                assert shard_rows(rows, n, strategy) == sizes


def test_shard_sizes_by_hand() -> None:
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_offsets(10, 3) == [0, 4, 7]
    assert shard_sizes(13, 5) == [3, 3, 3, 2, 2]
    assert shard_offsets(13, 5) == [0, 3, 6, 9, 11]
    assert shard_sizes(12, 4) == [3, 3, 3, 3]
    assert shard_sizes(0, 1) == [0]
    assert shard_sizes(2, 4) == [1, 1, 0, 0]


def test_partitioner_then_shard_sizes_by_hand() -> None:
    shape = (10, 4)
    assert shard_sizes(shape[0], fixed_size(3).num_shards(shape, 4)) == [4, 3, 3]
    assert shard_sizes(shape[0], fixed_size(30).num_shards(shape, 4)) == [1] * 10


# --- id maps -----------------------------------------------------------------------------


def random_map_case(rng: random.Random) -> tuple[int, int, list[int]]:
    num_rows = rng.choice([1, 2, 3, 10, 13, rng.randint(1, 200), rng.randint(200, 5000)])
    n = min(num_rows, rng.choice([1, 2, 3, num_rows, rng.randint(1, 40)]))
    ids = [rng.randrange(num_rows) for _ in range(rng.randint(0, 60))]
    return num_rows, n, ids


def test_div_map_matches_slow_loop() -> None:
    rng = random.Random(31)
    for _ in range(400):
        num_rows, n, ids = random_map_case(rng)
        shard, local = map_ids(torch.tensor(ids, dtype=torch.int64), num_rows, n, "div")
        assert (shard.tolist(), local.tolist()) == slow_div_map(ids, num_rows, n), (num_rows, n)


def test_mod_map_matches_python_arithmetic() -> None:
    rng = random.Random(32)
    for _ in range(400):
        num_rows, n, ids = random_map_case(rng)
        shard, local = map_ids(torch.tensor(ids, dtype=torch.int64), num_rows, n, "mod")
        assert shard.tolist() == [i % n for i in ids]
        assert local.tolist() == [i // n for i in ids]


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_every_row_lands_once_and_unmap_inverts_map(strategy: str) -> None:
    rng = random.Random(33 if strategy == "mod" else 34)
    for _ in range(100):
        num_rows, n, _ = random_map_case(rng)
        all_ids = torch.arange(num_rows, dtype=torch.int64)
        shard, local = map_ids(all_ids, num_rows, n, strategy)
        assert shard.dtype == local.dtype == torch.int64
        assert int(shard.min()) >= 0 and int(shard.max()) < n
        sizes = shard_sizes(num_rows, n)
        # every (shard, local row) pair is used exactly once, with local row < shard size:
        # so the local rows of each shard are exactly 0..size-1
        counts = np.zeros((n, max(sizes)), dtype=np.int64)
        np.add.at(counts, (shard.numpy(), local.numpy()), 1)
        expected_counts = np.array([[1] * size + [0] * (max(sizes) - size) for size in sizes])
        assert np.array_equal(counts, expected_counts), (num_rows, n)
        # unmap gives the ids back, and map(unmap(local rows)) gives the local rows back;
        # checked on a few shards, always including the first and the last
        for p in {0, n - 1, *rng.sample(range(n), min(n, 3))}:
            mine = shard == p
            assert torch.equal(unmap_ids(p, local[mine], num_rows, n, strategy), all_ids[mine])
            local_rows = torch.arange(sizes[p], dtype=torch.int64)
            shard_back, local_back = map_ids(
                unmap_ids(p, local_rows, num_rows, n, strategy), num_rows, n, strategy
            )
            assert torch.equal(shard_back, torch.full_like(local_rows, p))
            assert torch.equal(local_back, local_rows)


def test_div_rows_are_contiguous_from_shard_offsets() -> None:
    rng = random.Random(35)
    for _ in range(100):
        num_rows, n, _ = random_map_case(rng)
        shard, _ = map_ids(torch.arange(num_rows), num_rows, n, "div")
        expected = [p for p, size in enumerate(shard_sizes(num_rows, n)) for _ in range(size)]
        assert shard.tolist() == expected
        offsets = shard_offsets(num_rows, n)
        for p in {0, n - 1, rng.randrange(n)}:
            assert unmap_ids(p, torch.tensor([0]), num_rows, n, "div").tolist() == [offsets[p]]


def test_id_maps_by_hand() -> None:
    # TF's embedding_lookup docstring: 13 ids over 5 partitions.
    ids = torch.arange(13)
    mod_shard, mod_local = map_ids(ids, 13, 5, "mod")
    assert [ids[mod_shard == p].tolist() for p in range(5)] == [
        [0, 5, 10],
        [1, 6, 11],
        [2, 7, 12],
        [3, 8],
        [4, 9],
    ]
    assert mod_local.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    div_shard, div_local = map_ids(ids, 13, 5, "div")
    assert [ids[div_shard == p].tolist() for p in range(5)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, 10],
        [11, 12],
    ]
    assert div_local.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    shard, local = map_ids(torch.arange(10), 10, 3, "div")
    assert shard.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert local.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert unmap_ids(2, torch.tensor([0, 2]), 10, 3, "div").tolist() == [7, 9]
    assert unmap_ids(2, torch.tensor([0, 2]), 10, 3, "mod").tolist() == [2, 8]


def test_map_ids_keeps_shape_and_takes_any_integer_dtype() -> None:
    ids = torch.tensor([[9, 0], [4, 5]], dtype=torch.int32)
    shard, local = map_ids(ids, 10, 3, "div")
    assert shard.shape == local.shape == (2, 2)
    assert shard.dtype == local.dtype == torch.int64
    assert shard.tolist() == [[2, 0], [1, 1]]
    assert local.tolist() == [[2, 0], [0, 1]]
    empty_shard, empty_local = map_ids(torch.empty(0, dtype=torch.int64), 10, 3, "mod")
    assert empty_shard.numel() == empty_local.numel() == 0


def test_zero_rows_is_one_empty_shard() -> None:
    for strategy in ("mod", "div"):
        shard, local = map_ids(torch.empty(0, dtype=torch.int64), 0, 1, strategy)
        assert shard.numel() == local.numel() == 0
        assert unmap_ids(0, torch.empty(0, dtype=torch.int64), 0, 1, strategy).numel() == 0
        assert shard_rows(0, 1, strategy) == [0]


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["MOD", "contiguous", "", None])
def test_bad_strategy_raises_naming_it(strategy) -> None:
    for call in (
        lambda: map_ids(torch.arange(3), 3, 2, strategy),
        lambda: unmap_ids(0, torch.arange(2), 3, 2, strategy),
        lambda: shard_rows(3, 2, strategy),
    ):
        with pytest.raises(ValueError, match="strategy") as info:
            call()
        assert repr(strategy) in str(info.value)
        assert "'mod'" in str(info.value) and "'div'" in str(info.value)


@pytest.mark.parametrize("partitioner", [fixed_size(2), min_max(2), axis_size(100)])
def test_zero_dimensional_shape_raises(partitioner) -> None:
    with pytest.raises(ValueError, match="splits axis 0; parameter is 0-dimensional"):
        partitioner.num_shards((), 4)
    with pytest.raises(ValueError, match="0-dimensional"):
        partitioner.num_shards(torch.zeros(()).shape, 4)


@pytest.mark.parametrize(
    ("shape", "itemsize", "error", "shown"),
    [
        ((-1, 3), 4, ValueError, "-1"),
        ((3, 2.0), 4, TypeError, "2.0"),
        ("10", 4, TypeError, "'10'"),
        (10, 4, TypeError, "10"),
        ((10,), 0, ValueError, "itemsize"),
        ((10,), 4.0, TypeError, "itemsize"),
    ],
)
def test_bad_shape_or_itemsize_raises(shape, itemsize, error, shown: str) -> None:
    with pytest.raises(error) as info:
        fixed_size(2).num_shards(shape, itemsize)
    assert shown in str(info.value)


@pytest.mark.parametrize(
    ("make", "error", "shown"),
    [
        (lambda: fixed_size(0), ValueError, "num_shards must be >= 1, got 0"),
        (lambda: fixed_size(-3), ValueError, "got -3"),
        (lambda: fixed_size(2.0), TypeError, "num_shards must be an int, got float 2.0"),
        (lambda: fixed_size(True), TypeError, "bool"),
        (lambda: fixed_size(None), TypeError, "NoneType"),
        (lambda: min_max(0), ValueError, "max_partitions must be >= 1"),
        (lambda: min_max(2, 0), ValueError, "min_slice_size must be >= 1"),
        (lambda: min_max(2, 1.5), TypeError, "min_slice_size"),
        (lambda: axis_size(0), ValueError, "max_shard_bytes must be >= 1"),
        (lambda: axis_size("64MB"), TypeError, "max_shard_bytes"),
        (lambda: axis_size(100, 0), ValueError, "max_shards must be >= 1"),
        (lambda: axis_size(100, 2.0), TypeError, "max_shards"),
    ],
)
def test_bad_constructor_arguments_raise(make, error, shown: str) -> None:
    with pytest.raises(error) as info:
        make()
    assert shown in str(info.value)


def test_bad_map_arguments_raise() -> None:
    with pytest.raises(ValueError, match="got 4 shards for 3 rows"):
        map_ids(torch.arange(3), 3, 4, "div")
    with pytest.raises(ValueError, match="got 2 shards for 0 rows"):
        map_ids(torch.empty(0, dtype=torch.int64), 0, 2, "mod")
    with pytest.raises(ValueError, match="number of shards must be >= 1"):
        map_ids(torch.arange(3), 3, 0, "mod")
    with pytest.raises(ValueError, match=r"got 10; expected every value in range\(10\)"):
        map_ids(torch.tensor([0, 10]), 10, 3, "div")
    with pytest.raises(ValueError, match=r"got -1; expected every value in range\(10\)"):
        map_ids(torch.tensor([-1, 3]), 10, 3, "mod")
    with pytest.raises(TypeError, match="integer tensor"):
        map_ids(torch.tensor([1.0]), 10, 3, "mod")
    with pytest.raises(TypeError, match="torch.Tensor"):
        map_ids([1, 2], 10, 3, "mod")
    with pytest.raises(ValueError, match=r"shard must be in range\(3\), got 3"):
        unmap_ids(3, torch.tensor([0]), 10, 3, "div")
    with pytest.raises(ValueError, match=r"local rows of shard 1: got 3; .*range\(3\)"):
        unmap_ids(1, torch.tensor([3]), 10, 3, "div")
    # without the range check, out-of-range ids are mapped by the formula, unchecked
    shard, _ = map_ids(torch.tensor([10]), 10, 3, "mod", check_range=False)
    assert shard.tolist() == [1]


# --- resolve -----------------------------------------------------------------------------


def test_resolve_none_single_and_globs() -> None:
    assert resolve(None, "fc.weight") is None
    four = fixed_size(4)
    assert resolve(four, "anything") is four
    table = {
        "embed.bias": None,  # a None value leaves matching parameters whole
        "embed.*": fixed_size(8),
        "*.weight": axis_size(1 << 20),
        "*": min_max(4),
    }
    assert resolve(table, "embed.weight") == fixed_size(8)  # first match wins, in dict order
    assert resolve(table, "embed.bias") is None
    assert resolve(table, "fc.weight") == axis_size(1 << 20)
    assert resolve(table, "fc.bias") == min_max(4)
    assert resolve({"Embed.*": four}, "embed.weight") is None  # case-sensitive
    assert resolve({"layer?.w": four}, "layer1.w") is four
    assert resolve({"layer[0-2].w": four}, "layer3.w") is None
    assert resolve({}, "x") is None


@pytest.mark.parametrize(
    ("spec", "name", "shown"),
    [
        (4, "w", "got int 4"),
        ("fixed_size(4)", "w", "got str"),
        ([fixed_size(2)], "w", "got list"),
        ({"w": 4}, "w", "'w' must be a Partitioner or None, got int 4"),
        ({"x": fixed_size(2), "w": "4"}, "x", "'w'"),  # checked even past the match
        ({1: fixed_size(2)}, "w", "got int 1"),
        (fixed_size(2), 3, "parameter name must be a str"),
    ],
)
def test_resolve_bad_input_raises_type_error(spec, name, shown: str) -> None:
    with pytest.raises(TypeError) as info:
        resolve(spec, name)
    assert shown in str(info.value)


# --- properties over generated cases -------------------------------------------------------


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.builds(fixed_size, st.integers(1, 50)),
        st.builds(min_max, st.integers(1, 50), st.integers(1, 1 << 12)),
        st.builds(axis_size, st.integers(1, 1 << 12), st.one_of(st.none(), st.integers(1, 50))),
    ),
    st.lists(st.integers(0, 60), min_size=1, max_size=3),
    st.sampled_from(ITEMSIZES),
    st.sampled_from(["mod", "div"]),
)
def test_a_partitioners_shards_hold_every_row_exactly_once(partitioner, shape, itemsize,
                                                          strategy) -> None:
    rows = shape[0]
    n = partitioner.num_shards(shape, itemsize)
    assert 1 <= n <= max(1, rows)
    sizes = shard_sizes(rows, n)
    assert sum(sizes) == rows and shard_rows(rows, n, strategy) == sizes
    ids = torch.arange(rows, dtype=torch.int64)
    shard, local = map_ids(ids, rows, n, strategy)
    pairs = sorted(zip(shard.tolist(), local.tolist()))
    assert pairs == [(p, i) for p, size in enumerate(sizes) for i in range(size)]
    for p in set(shard.tolist()):
        mine = shard == p
        assert torch.equal(unmap_ids(p, local[mine], rows, n, strategy), ids[mine])


def test_a_float_tensor_is_not_a_count() -> None:
    """A 0-d float tensor has ``__index__`` but is no int: refused as any other non-int."""
    with pytest.raises(TypeError, match=r"^num_shards must be an int, got Tensor tensor\(2\.5000\)$"):
        fixed_size(torch.tensor(2.5))
    assert fixed_size(torch.tensor(3)) == fixed_size(3)
