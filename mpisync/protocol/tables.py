"""What both sides know of a table: its spec, what a module says of it, the sparse modules.

``TableSpec`` is a table as the spec carries it to the ps ranks; ``TableInfo`` and
``HashTableInfo`` are what an ``mpisync.Embedding`` or ``mpisync.HashEmbedding`` knows of
its table before and after set-up (``table_info`` finds it behind a stand-in parameter);
``sparse_modules`` finds the ``nn.Embedding(sparse=True)`` modules whose weights travel as
rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import hashing, partition
from .holders import holders

__all__ = ["HashTableInfo", "TableInfo", "TableSpec", "sparse_modules", "table_info"]


@dataclass(frozen=True)
class TableSpec:
    """A tensor whose rows travel instead of the whole tensor; the same on every rank.

    ``resident``: an ``mpisync.Embedding`` table, held by the ps ranks only; otherwise the
    weight of an ``nn.Embedding(sparse=True)``, whole on every worker (rows pushed, the
    rows that changed pulled). Shard ``k`` holds ``shard_rows[k]`` rows and lives on ps
    ``owners[k]``; ids map to shards by ``strategy``, as TensorFlow's ``embedding_lookup``.
    """

    name: str
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    strategy: str
    shard_rows: tuple[int, ...]
    owners: tuple[int, ...]
    resident: bool
    seed: int | None
    padding_idx: int | None
    hashed: hashing.HashSpec | None = None   # an mpisync.HashEmbedding: ids hashed to shards

    @property
    def num_shards(self) -> int:
        return len(self.shard_rows)

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize

    def unit(self, k: int) -> str:
        """The unit name of shard ``k``."""
        return f"{self.name}/part_{k}"

    def rows_of(self, k: int) -> str:
        """What rows shard ``k`` holds, for the placement table."""
        if self.hashed is not None:
            return f"ids hashed to {k} of {self.num_shards} ({self.shard_rows[k]} slots)"
        if self.strategy == "mod":
            return f"ids = {k} mod {self.num_shards} ({self.shard_rows[k]} rows)"
        start = sum(self.shard_rows[:k])
        return f"{start}:{start + self.shard_rows[k]}"

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard, local row) of each id (a hash table's local row is the id itself)."""
        if self.hashed is not None:
            return hashing.shard_of(ids, self.num_shards), ids
        return partition.map_ids(ids, self.num_rows, self.num_shards, self.strategy)

    def global_ids(self, k: int, local: torch.Tensor) -> torch.Tensor:
        """The ids of shard ``k``'s local rows ``local``."""
        if self.hashed is not None:
            return local
        return partition.unmap_ids(k, local, self.num_rows, self.num_shards, self.strategy)


class TableInfo:
    """What an ``mpisync.Embedding`` knows of its table before and after set-up."""

    # its name in the named_parameters of a SyncReplicasOptimizer whose torch optimizer
    # does not hold it (the error of a lookup while no optimizer serves it says so); on
    # the class too, for tables pickled before it existed
    left_out: str | None = None

    def __init__(self, num_rows: int, dim: int, partitioner, strategy: str,
                 weight: torch.Tensor | None, seed: int, padding_idx: int | None,
                 dtype: torch.dtype):
        self.num_rows = num_rows
        self.dim = dim
        self.partitioner = partitioner
        self.strategy = strategy
        self.weight = weight            # the initial values, until the chief sent them
        self.seed = seed
        self.padding_idx = padding_idx
        self.dtype = dtype
        self.name: str | None = None    # set by the optimizer that holds the table
        # ... and its transport (a worker's RowsChannel: worker/ is not imported here)
        self.channel: Any = None
        self.label = "this worker"

    def describe(self) -> str:
        return (f"{self.num_rows} x {self.dim} {self.dtype}, partition_strategy "
                f"{self.strategy!r}, initial values "
                + ("from weight=" if self.weight is not None else f"from seed {self.seed}"))


class HashTableInfo(TableInfo):
    """What a hash table knows of itself before and after set-up."""

    def __init__(self, dim: int, capacity: int, eviction: str, admit_after: int, seed: int,
                 partitioner, dtype: torch.dtype, init_std: float = 1.0):
        super().__init__(0, dim, partitioner, "hash", None, seed, None, dtype)
        self.hashed = hashing.HashSpec(capacity, eviction, admit_after, init_std)
        self.spec: TableSpec | None = None   # the table's, once the optimizer holds it

    def describe(self) -> str:
        h = self.hashed
        return (f"hash table of {self.dim} {self.dtype} columns, {h.capacity} rows per "
                f"shard, eviction {h.eviction!r}, admit_after {h.admit_after}, seed "
                f"{self.seed}" + (f", init_std {h.init_std}" if h.init_std != 1.0 else ""))


def table_info(p: torch.Tensor) -> TableInfo | None:
    """The table behind a stand-in parameter, or None for an ordinary one."""
    return getattr(p, "_mpisync_table", None)


_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_modules(params: list[torch.Tensor]) -> dict[int, torch.nn.Module]:
    """``id(weight) -> module`` for the ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``
    modules whose weight is one of ``params`` (their gradients are sparse).

    The modules are found by ``mpisync.protocol.holders``; a weight that several
    embeddings hold (tied) belongs to the one it was registered on last, and a weight
    tied into another kind of module still belongs to its embedding.
    """
    found = {}
    for key, held in holders([p for p in params if p.dim() == 2]).items():
        owners = [m for m, name in held if isinstance(m, _EMBEDDINGS) and name == "weight"]
        if owners and owners[-1].sparse:
            found[key] = owners[-1]
    return found
