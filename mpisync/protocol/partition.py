"""Partitioning along axis 0: how many shards a parameter gets, and which shard holds each row.

The shard counts follow TensorFlow's partitioners (``fixed_size_partitioner``,
``min_max_variable_partitioner``, ``variable_axis_size_partitioner`` in
``tensorflow/python/ops/partitioned_variables.py``) and the id maps follow
``embedding_lookup(partition_strategy="mod" | "div")``. Everything here is pure: no MPI,
no messages, so every rank computes the same answer from the same inputs.

Invariants:
    * shard ``p`` of ``n`` holds ``rows // n + 1`` rows if ``p < rows % n``, else
      ``rows // n`` (:func:`shard_sizes`), under both strategies;
    * ``"mod"`` puts row ``i`` on shard ``i % n`` at local row ``i // n``;
    * ``"div"`` puts rows on shards contiguously, in order (:func:`shard_offsets`).
"""

from __future__ import annotations

import fnmatch
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, SupportsIndex, Union

import torch

__all__ = [
    "STRATEGIES",
    "AxisSize",
    "FixedSize",
    "MinMax",
    "Partitioner",
    "axis_size",
    "fixed_size",
    "map_ids",
    "min_max",
    "resolve",
    "shard_offsets",
    "shard_rows",
    "shard_sizes",
    "unmap_ids",
]

#: Id-to-shard strategies of ``embedding_lookup``; the first one is TensorFlow's default.
STRATEGIES = ("mod", "div")


class Partitioner:
    """Base of the partitioners: ``num_shards(shape, itemsize)`` shards along axis 0."""

    def num_shards(self, shape: Sequence[int], itemsize: int) -> int:
        """Return the number of shards along axis 0, in ``1..max(1, shape[0])``.

        Args:
            shape: the parameter's shape, at least 1-dimensional.
            itemsize: bytes per element (``tensor.element_size()``).

        Returns:
            The number of shards: at least 1 (also for 0 rows), at most ``shape[0]``.

        Raises:
            TypeError: a dimension or ``itemsize`` is not an int.
            ValueError: ``shape`` is 0-dimensional, a dimension is negative, or
                ``itemsize < 1``.
        """
        shape = _check_shape(shape)
        itemsize = _check_int(itemsize, "itemsize", minimum=1)
        return max(1, min(shape[0], self._count(shape, itemsize)))

    def _count(self, shape: tuple[int, ...], itemsize: int) -> int:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class FixedSize(Partitioner):
    """``num_shards`` shards, or one per row when there are fewer rows.

    TensorFlow's ``fixed_size_partitioner(num_shards)``: ``min(num_shards, rows)``.
    """

    shards: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", _check_int(self.shards, "num_shards", minimum=1))

    def __repr__(self) -> str:
        return f"fixed_size({self.shards})"

    def _count(self, shape: tuple[int, ...], itemsize: int) -> int:
        return self.shards


@dataclass(frozen=True, repr=False)
class MinMax(Partitioner):
    """At most ``max_partitions`` shards of at least ``min_slice_size`` bytes each.

    TensorFlow's ``min_max_variable_partitioner``:
    ``max(1, min(rows, max_partitions, ceil(total_bytes / min_slice_size)))``, where
    ``total_bytes`` is the size of the whole parameter.
    """

    max_partitions: int = 1
    min_slice_size: int = 256 << 10

    def __post_init__(self) -> None:
        for name in ("max_partitions", "min_slice_size"):
            object.__setattr__(self, name, _check_int(getattr(self, name), name, minimum=1))

    def __repr__(self) -> str:
        return (
            f"min_max(max_partitions={self.max_partitions}, min_slice_size={self.min_slice_size})"
        )

    def _count(self, shape: tuple[int, ...], itemsize: int) -> int:
        total_bytes = math.prod(shape) * itemsize
        # Integer ceiling: the same as TF's math.ceil(total / min_slice_size) in floats
        # for every size below 2**53 bytes, and exact beyond.
        return min(self.max_partitions, -(-total_bytes // self.min_slice_size))


@dataclass(frozen=True, repr=False)
class AxisSize(Partitioner):
    """As few shards as keep each one within ``max_shard_bytes``, at most ``max_shards``.

    TensorFlow's ``variable_axis_size_partitioner``: a slice is one row
    (``prod(shape[1:]) * itemsize`` bytes); ``slices_per_shard =
    max(1, max_shard_bytes // slice_bytes)``; ``ceil(rows / slices_per_shard)`` shards,
    then ``min`` with ``max_shards`` if given. A row larger than ``max_shard_bytes`` gets
    a shard of its own, so shards can then exceed the limit, as in TensorFlow.
    """

    max_shard_bytes: int
    max_shards: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "max_shard_bytes",
            _check_int(self.max_shard_bytes, "max_shard_bytes", minimum=1),
        )
        if self.max_shards is not None:
            object.__setattr__(
                self, "max_shards", _check_int(self.max_shards, "max_shards", minimum=1)
            )

    def __repr__(self) -> str:
        return f"axis_size(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"

    def _count(self, shape: tuple[int, ...], itemsize: int) -> int:
        rows = shape[0]
        slice_bytes = math.prod(shape[1:]) * itemsize
        if rows == 0 or slice_bytes == 0:
            # TF divides by zero here; an empty parameter needs one shard.
            return 1
        slices_per_shard = max(1, self.max_shard_bytes // slice_bytes)
        count = -(-rows // slices_per_shard)
        if self.max_shards is not None:
            count = min(self.max_shards, count)
        return count


def fixed_size(num_shards: int) -> FixedSize:
    """Return a partitioner into ``min(num_shards, rows)`` shards (at least 1).

    Raises:
        TypeError: ``num_shards`` is not an int.
        ValueError: ``num_shards < 1``.
    """
    return FixedSize(num_shards)


def min_max(max_partitions: int = 1, min_slice_size: int = 256 << 10) -> MinMax:
    """Return TF's min-max partitioner: <= ``max_partitions`` shards of >= ``min_slice_size`` bytes.

    Raises:
        TypeError: an argument is not an int.
        ValueError: an argument is < 1.
    """
    return MinMax(max_partitions, min_slice_size)


def axis_size(max_shard_bytes: int, max_shards: int | None = None) -> AxisSize:
    """Return TF's axis-size partitioner: shards of at most ``max_shard_bytes`` where possible.

    Raises:
        TypeError: an argument is not an int (``max_shards`` may be None).
        ValueError: an argument is < 1.
    """
    return AxisSize(max_shard_bytes, max_shards)


# --- shard layout -------------------------------------------------------------------------


def shard_sizes(rows: int, n: int) -> list[int]:
    """Return the rows of each of ``n`` shards: the first ``rows % n`` hold one extra row.

    Args:
        rows: number of rows along axis 0 (>= 0).
        n: number of shards (>= 1).

    Returns:
        ``n`` sizes summing to ``rows``.

    Raises:
        TypeError, ValueError: on a bad ``rows`` or ``n``.
    """
    rows = _check_int(rows, "rows", minimum=0)
    n = _check_int(n, "number of shards", minimum=1)
    base, extras = divmod(rows, n)
    return [base + 1 if p < extras else base for p in range(n)]


def shard_offsets(rows: int, n: int) -> list[int]:
    """Return the first row of each shard when rows are split contiguously ("div").

    Raises:
        TypeError, ValueError: on a bad ``rows`` or ``n``.
    """
    offsets = []
    start = 0
    for size in shard_sizes(rows, n):
        offsets.append(start)
        start += size
    return offsets


def shard_rows(num_rows: int, n: int, strategy: str) -> list[int]:
    """Return the rows held by each shard under ``strategy``; equal to :func:`shard_sizes`.

    Raises:
        TypeError, ValueError: on a bad ``num_rows``, ``n`` or ``strategy``.
    """
    strategy = _check_strategy(strategy)
    num_rows, n = _check_rows_and_shards(num_rows, n)
    if strategy == "mod":
        # shard p holds rows p, p + n, p + 2n, ... below num_rows
        return [len(range(p, num_rows, n)) for p in range(n)]
    return shard_sizes(num_rows, n)


# --- id maps ------------------------------------------------------------------------------


def map_ids(
    ids: torch.Tensor,
    num_rows: int,
    n: int,
    strategy: str,
    *,
    check_range: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global row ids to (shard, local row), as TF's ``embedding_lookup`` does.

    ``"mod"``: shard ``id % n``, local row ``id // n``. ``"div"``: TF's formula with
    ``ids_per_partition = num_rows // n`` and ``extras = num_rows % n``: shard
    ``max(id // (ids_per_partition + 1), (id - extras) // ids_per_partition)``, local row
    ``id % (ids_per_partition + 1)`` on the first ``extras`` shards, else
    ``(id - extras) % ids_per_partition``.

    Args:
        ids: integer tensor of global row ids, any shape.
        num_rows: rows of the whole parameter along axis 0.
        n: number of shards, ``1 <= n <= max(1, num_rows)`` (a partitioner's result).
        strategy: ``"mod"`` or ``"div"``.
        check_range: raise if an id is outside ``[0, num_rows)``. This reads the ids'
            minimum and maximum back to the host (a device sync on GPU).

    Returns:
        ``(shard, local_row)``: int64 tensors shaped like ``ids``.

    Raises:
        TypeError: ``ids`` is not an integer tensor, or ``num_rows``/``n`` not an int.
        ValueError: a bad ``strategy``, ``n`` outside ``1..max(1, num_rows)``, or (with
            ``check_range``) an id outside ``[0, num_rows)``.
    """
    strategy = _check_strategy(strategy)
    num_rows, n = _check_rows_and_shards(num_rows, n)
    ids = _check_ids(ids, "ids", num_rows if check_range else None).to(torch.int64)
    if strategy == "mod" or num_rows == 0:  # one shard for 0 rows: the maps agree
        return ids % n, ids // n
    ids_per_partition, extras = divmod(num_rows, n)
    shard = torch.maximum(ids // (ids_per_partition + 1), (ids - extras) // ids_per_partition)
    local = torch.where(
        shard < extras, ids % (ids_per_partition + 1), (ids - extras) % ids_per_partition
    )
    return shard, local


def unmap_ids(
    shard: int,
    local: torch.Tensor,
    num_rows: int,
    n: int,
    strategy: str,
    *,
    check_range: bool = True,
) -> torch.Tensor:
    """Return the global ids of rows ``local`` of shard ``shard``; the inverse of :func:`map_ids`.

    Args:
        shard: shard index in ``range(n)``.
        local: integer tensor of local row indices into that shard, any shape.
        num_rows: rows of the whole parameter along axis 0.
        n: number of shards, ``1 <= n <= max(1, num_rows)``.
        strategy: ``"mod"`` or ``"div"``.
        check_range: raise if a local row is outside ``[0, shard size)`` (reads the
            minimum and maximum back to the host).

    Returns:
        int64 tensor of global ids, shaped like ``local``.

    Raises:
        TypeError: ``local`` is not an integer tensor, or an index is not an int.
        ValueError: a bad ``strategy``, ``n`` or ``shard``, or (with ``check_range``) a
            local row outside the shard.
    """
    strategy = _check_strategy(strategy)
    num_rows, n = _check_rows_and_shards(num_rows, n)
    shard = _check_int(shard, "shard", minimum=0)
    if shard >= n:
        raise ValueError(f"shard must be in range({n}), got {shard}")
    size = shard_sizes(num_rows, n)[shard]
    local = _check_ids(local, f"local rows of shard {shard}", size if check_range else None)
    local = local.to(torch.int64)
    if strategy == "mod":
        return local * n + shard
    return local + shard_offsets(num_rows, n)[shard]


# --- choosing a partitioner per parameter -------------------------------------------------

PartitionerSpec = Union[None, Partitioner, Mapping[str, Optional[Partitioner]]]


def resolve(partitioner_or_dict: PartitionerSpec, name: str) -> Partitioner | None:
    """Return the partitioner for parameter ``name``, or None to leave it whole.

    Args:
        partitioner_or_dict: None (no partitioning), one partitioner for every
            parameter, or a dict from glob pattern (``fnmatch.fnmatchcase``, so
            case-sensitive and ``*`` matches dots) to a partitioner or None; the first
            pattern in dict order that matches ``name`` wins.
        name: the parameter's name.

    Returns:
        The partitioner that applies, or None when none does.

    Raises:
        TypeError: ``partitioner_or_dict`` is none of the above (also checked for the
            keys and values of a dict that ``name`` does not reach), or ``name`` is
            not a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"parameter name must be a str, got {type(name).__name__} {name!r}")
    if partitioner_or_dict is None or isinstance(partitioner_or_dict, Partitioner):
        return partitioner_or_dict
    if not isinstance(partitioner_or_dict, Mapping):
        raise TypeError(
            "partitioner must be None, a Partitioner (fixed_size, min_max, axis_size) or a "
            f"dict from glob pattern to Partitioner, got {type(partitioner_or_dict).__name__} "
            f"{partitioner_or_dict!r}"
        )
    for pattern, value in partitioner_or_dict.items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"partitioner dict keys must be str glob patterns, "
                f"got {type(pattern).__name__} {pattern!r}"
            )
        if value is not None and not isinstance(value, Partitioner):
            raise TypeError(
                f"partitioner dict value for {pattern!r} must be a Partitioner or None, "
                f"got {type(value).__name__} {value!r}"
            )
    for pattern, value in partitioner_or_dict.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return None


# --- validation ---------------------------------------------------------------------------


def _check_int(value: object, what: str, minimum: int) -> int:
    """Return ``value`` as a plain int >= ``minimum`` (numpy integers accepted, bools not)."""
    number = None
    if not isinstance(value, bool) and isinstance(value, SupportsIndex):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return int(number)


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a sequence of ints, got {type(shape).__name__} {shape!r}")
    if len(shape) == 0:
        raise ValueError("a partitioner splits axis 0; parameter is 0-dimensional")
    return tuple(
        _check_int(dim, f"dimension {i} of shape {tuple(shape)}", minimum=0)
        for i, dim in enumerate(shape)
    )


def _check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown partition strategy {strategy!r}; expected one of {STRATEGIES}")
    return strategy


def _check_rows_and_shards(num_rows: int, n: int) -> tuple[int, int]:
    num_rows = _check_int(num_rows, "num_rows", minimum=0)
    n = _check_int(n, "number of shards", minimum=1)
    if n > max(1, num_rows):
        raise ValueError(
            f"got {n} shards for {num_rows} rows; expected at most max(1, num_rows) = "
            f"{max(1, num_rows)} (a partitioner's num_shards never exceeds the rows)"
        )
    return num_rows, n


def _check_ids(ids: torch.Tensor, what: str, upper: int | None) -> torch.Tensor:
    """Check that ``ids`` is an integer tensor, and when ``upper`` is given, in [0, upper)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got dtype {ids.dtype}")
    if upper is not None and ids.numel() > 0:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= upper:
            bad = low if low < 0 else high
            raise ValueError(f"{what}: got {bad}; expected every value in range({upper})")
    return ids
