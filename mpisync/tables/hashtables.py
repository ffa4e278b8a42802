"""Embedding tables for unbounded int64 ids, held on the ps ranks in hashed shards.

``mpisync.HashEmbedding`` and ``mpisync.HashEmbeddingBag`` are TensorFlow Recommenders-
Addons' dynamic embeddings for mpisync: there is no ``num_embeddings``; any int64 id
(negative and huge ones too) is hashed to a shard (``mpisync.hashing``), and each shard
holds at most ``capacity_per_shard`` rows. A row is created on its id's first admitted
sighting with ``initial_rows(ids)``, a pure function of ``(seed, id)``; when the shard is
full, admitting a row evicts another one (``"lru"`` or ``"lfu"``) together with its
optimizer state. On the ps ranks a shard is a dense tensor of ``capacity_per_shard`` rows
plus an id -> slot map, so the wrapped torch optimizer updates it as it updates an
``mpisync.Embedding`` shard.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn import functional as F

from ..errors import CapacityError
from ..protocol import hashing
from ..protocol.bags import bags_of
from ..protocol.tables import HashTableInfo
from ..worker.exchange import Request
from .embedding import TableParameter, check_id_tensor, live_table, unique_ids

if TYPE_CHECKING:
    from ..protocol.partition import Partitioner
    from ..protocol.tables import TableSpec
    from ..worker.rows import RowsChannel

__all__ = ["HashEmbedding", "HashEmbeddingBag", "check_saved_hash_table", "place_hash_table"]


class _HashModule(torch.nn.Module):
    def __init__(self, embedding_dim: int, capacity_per_shard: int, eviction: str,
                 admit_after: int, seed: int, partitioner: Partitioner | None,
                 dtype: torch.dtype, init_std: float) -> None:
        super().__init__()
        for name, value, low in (("embedding_dim", embedding_dim, 1),
                                 ("capacity_per_shard", capacity_per_shard, 1),
                                 ("admit_after", admit_after, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if eviction not in hashing.EVICTIONS:
            raise ValueError(f"eviction must be one of {hashing.EVICTIONS}, got {eviction!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        hashing.check_std(init_std, dtype, "init_std")
        self.embedding_dim = embedding_dim
        self.capacity_per_shard = capacity_per_shard
        self.eviction, self.admit_after, self.seed = eviction, admit_after, seed
        self.init_std = float(init_std)     # a numpy scalar too
        info = HashTableInfo(embedding_dim, capacity_per_shard, eviction, admit_after, seed,
                             partitioner, dtype, self.init_std)
        stand_in = TableParameter(torch.empty(0, embedding_dim, dtype=dtype))
        stand_in._mpisync_table = info
        self.weight = stand_in

    @property
    def table(self) -> HashTableInfo:
        """What the optimizer learns of this table: row size, capacity, eviction, seed,
        partitioner and, once an optimizer serves it, the channel to its ps ranks."""
        return cast(HashTableInfo, self.weight._mpisync_table)

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` get when admitted: ``mpisync.hashing.initial_rows`` of this seed
        and ``init_std``."""
        return hashing.initial_rows(ids, self.embedding_dim, self.seed, self.table.dtype,
                                    self.init_std)

    def _rows(self, ids: torch.Tensor, what: str, peek: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the unique ids' rows, the index of each id among them, the unique ids)."""
        info = live_table(self.table, what)
        check_id_tensor(ids, info, what)
        unique, inverse = unique_ids(ids)
        if not peek:
            self._check_capacity(info, unique, what)
        return info.channel.lookup(info, unique, peek=peek), inverse, unique

    @staticmethod
    def _check_capacity(info: HashTableInfo, unique: torch.Tensor, what: str) -> None:
        """Refuse a lookup that needs more rows on a shard than it holds, before sending."""
        if info.spec is None:
            info.spec = next(tb.spec for tb in info.channel.tables if tb.info is info)
        t = info.spec
        hashed = t.hashed
        assert hashed is not None            # the spec of a hash table
        if len(unique) <= hashed.capacity:
            return
        counts = torch.bincount(t.locate(unique)[0], minlength=t.num_shards)
        k = int(counts.argmax())
        if int(counts[k]) > hashed.capacity:
            raise CapacityError(
                f"{info.label}: {what} {info.name!r} needs {int(counts[k])} rows on shard {k} "
                f"(on ps {t.owners[k]}) for one lookup, more than its capacity_per_shard="
                f"{hashed.capacity}; raise capacity_per_shard, use more shards "
                f"(partitioner=) or look up fewer distinct ids at once")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` (a copy, without autograd), for evaluation or export.

        Reading is not a sighting: ids without a row read as zeros and get none.
        """
        with torch.no_grad():
            rows, inverse, _ = self._rows(ids, "rows() of", peek=True)
            return rows[inverse]

    def extra_repr(self) -> str:
        """The row size, capacity, eviction and admission, for ``repr(model)``."""
        return (f"{self.embedding_dim}, capacity_per_shard={self.capacity_per_shard}, "
                f"eviction={self.eviction!r}, admit_after={self.admit_after}"
                + (f", init_std={self.init_std}" if self.init_std != 1.0 else "")
                + ", on the ps ranks")


class HashEmbedding(_HashModule):
    """An embedding table for any int64 ids, on the ps ranks in hashed shards of bounded size.

    ``forward(ids)`` sends the batch's unique ids to the ps ranks of their shards (one
    message per ps rank) and returns their rows, with autograd, as ``mpisync.Embedding``.
    Id ``i`` lives in shard ``splitmix64(i) % num_shards`` (``mpisync.hashing``).

    A *sighting* of an id is one training-mode ``forward`` (one lookup message to its
    shard) whose ids include it. After ``admit_after`` sightings the id is admitted: it
    gets a row, ``initial_rows([i])``, and from then on its gradients update that row.
    Until then it reads as zeros and its gradients are dropped. ``rows(ids)`` and
    ``forward`` in eval mode (``module.eval()``) read without sighting anything.

    Each shard holds at most ``capacity_per_shard`` rows. Admitting a row into a full
    shard evicts one row not seen by the same lookup: the least recently seen
    (``eviction="lru"``; recency counts the shard's lookup messages) or the least often
    seen (``"lfu"``, ties by recency), then the smallest id. The evicted row's optimizer
    state (each state tensor of the shard's shape) is reset to what a new row gets;
    per-tensor scalars such as Adam's ``step`` are the shard's and stay. A gradient for a
    row evicted before its step is applied is dropped. One lookup needing more rows on a
    shard than it holds raises ``mpisync.CapacityError`` on the worker that made it, and
    the job ends.

    ``opt.stats["hash_tables"]`` counts each table's admitted, evicted and live rows.
    ``mpisync.save``/``load`` keep each shard's ids, rows, optimizer state and counts (and
    the ids seen but not admitted yet, with their sightings) and re-hash them into the
    loading job's shards (any ps count).

    Args:
        embedding_dim: the row width.
        capacity_per_shard: the rows a shard holds (its dense tensor on the ps).
        eviction: ``"lru"`` or ``"lfu"``.
        admit_after: sightings before an id gets a row (1: on first use).
        seed: of the initial rows.
        partitioner: how many shards (``mpisync.fixed_size(n)``); default one per ps rank.
        dtype: of the rows.
        init_std: the initial rows' standard deviation (they are ``N(0, init_std**2)``; 1
            as ``nn.Embedding``'s; ``(3 * num_rows) ** -0.5`` gives the spread of TorchRec's
            uniform ``+-sqrt(1 / num_rows)`` for a table of ``num_rows`` rows).
    """

    def __init__(self, embedding_dim: int, *, capacity_per_shard: int, eviction: str = "lru",
                 admit_after: int = 1, seed: int = 0, partitioner: Partitioner | None = None,
                 dtype: torch.dtype = torch.float32, init_std: float = 1.0) -> None:
        super().__init__(embedding_dim, capacity_per_shard, eviction, admit_after, seed,
                         partitioner, dtype, init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (any int64 values), with autograd: ``ids``' shape plus
        ``embedding_dim``.

        In training mode each lookup is a sighting (ids may be admitted, others evicted);
        in ``eval()`` mode it only reads, and ids without a row read as zeros. Local to
        this worker.

        Raises:
            TypeError: ``ids`` is not a tensor of int64 or int32.
            CapacityError: the batch needs more rows on one shard than
                ``capacity_per_shard`` (in training mode, before anything is sent).
            RuntimeError: called before an optimizer over this table, or after it closed.
        """
        rows, inverse, _ = self._rows(ids, "mpisync.HashEmbedding", peek=not self.training)
        return F.embedding(inverse, rows)


class HashEmbeddingBag(_HashModule):
    """``nn.EmbeddingBag`` over a hash table: sums or means of rows per bag.

    ``forward(input, offsets=None, per_sample_weights=None)`` as ``nn.EmbeddingBag``
    (2-D input: one bag per row; 1-D input with ``offsets``). An id without a row counts
    in its bag as a row of zeros. Otherwise as ``HashEmbedding``.
    """

    def __init__(self, embedding_dim: int, *, capacity_per_shard: int, mode: str = "mean",
                 eviction: str = "lru", admit_after: int = 1, seed: int = 0,
                 partitioner: Partitioner | None = None,
                 dtype: torch.dtype = torch.float32, init_std: float = 1.0) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(embedding_dim, capacity_per_shard, eviction, admit_after, seed,
                         partitioner, dtype, init_std)
        self.mode = mode

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Each bag's rows pooled by ``mode``, with autograd, as ``nn.EmbeddingBag``:
        ``(number of bags, embedding_dim)``. Lookups as ``HashEmbedding.forward``.

        Args:
            input: int64 or int32 ids: 2-D (one bag per row) or 1-D with ``offsets``.
            offsets: where each bag of a 1-D ``input`` starts.
            per_sample_weights: a weight per id, ``input``'s shape (``mode="sum"`` only).

        Raises:
            TypeError, CapacityError, RuntimeError: as ``HashEmbedding.forward``.
        """
        rows, inverse, _ = self._rows(input, "mpisync.HashEmbeddingBag",
                                      peek=not self.training)
        return F.embedding_bag(inverse.view(input.shape), rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)

    def plan(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
             per_sample_weights: torch.Tensor | None = None
             ) -> tuple[Request, Callable[[torch.Tensor], torch.Tensor]]:
        """What a training-mode forward sends (the batch's unique ids, each lookup a
        sighting) and how it ends: all checked (ids, bags, capacity), nothing sent.
        ``EmbeddingBagCollection`` sends it with its other tables' in one exchange."""
        what = "mpisync.HashEmbeddingBag"
        info = live_table(self.table, what)
        check_id_tensor(input, info, what)
        bags_of(input, offsets, per_sample_weights, mode=self.mode, include_last_offset=False,
                padding_idx=None, dtype=info.dtype, label=info.label, name=info.name,
                flatten=False)
        unique, inverse = unique_ids(input)
        self._check_capacity(info, unique, what)

        def finish(rows: torch.Tensor) -> torch.Tensor:
            return F.embedding_bag(inverse.view(input.shape), rows, offsets, mode=self.mode,
                                   per_sample_weights=per_sample_weights)

        return Request(info.channel.index_of(info), unique=unique), finish


# -- checkpoints ---------------------------------------------------------------------------
def check_saved_hash_table(saved: dict[str, Any], t: TableSpec) -> str | None:
    """What keeps a checkpoint's hash table from loading into ``t`` (its TableSpec), or None."""
    if list(saved["row_shape"]) != list(t.row_shape):
        return (f"hash table {t.name!r} was saved with rows of {list(saved['row_shape'])}, "
                f"this one has rows of {list(t.row_shape)}")
    counts = [0] * t.num_shards          # any number of rows, re-hashed on load
    for sh in saved["shards"]:
        for k, c in enumerate(torch.bincount(t.locate(sh["ids"])[0],
                                             minlength=t.num_shards).tolist()):
            counts[k] += c
    hashed = t.hashed
    assert hashed is not None                # the spec of a hash table
    if max(counts) > hashed.capacity:
        return (f"hash table {t.name!r}: the checkpoint has {max(counts)} rows for shard "
                f"{counts.index(max(counts))} of {t.num_shards}, more than its "
                f"capacity_per_shard={hashed.capacity}")
    return None


def _candidates_of(shards, t: TableSpec, k: int) -> dict[str, torch.Tensor]:
    """The saved ids seen but not admitted yet (``admit_after`` above 1: few) whose ids hash
    to shard ``k`` of ``t``, with their sightings and last sighting."""
    keys = ("ids", "count", "last")
    out: dict[str, list[torch.Tensor]] = {key: [torch.empty(0, dtype=torch.int64)]
                                          for key in keys}
    for sh in shards:
        seen = sh.get("candidates")
        if seen is not None and len(seen["ids"]):
            to_k = t.locate(seen["ids"])[0] == k
            for key in keys:
                out[key].append(seen[key][to_k])
    return {key: torch.cat(values) for key, values in out.items()}


def place_hash_table(shards: list[dict[str, Any]], t: TableSpec, rows: RowsChannel) -> None:
    """Send each shard of hash table ``t`` the saved rows whose ids hash to it (with their
    optimizer state and counts), through the worker's ``RowsChannel`` ``rows``."""
    # each saved shard read once here, and below only for the new shards it has rows for
    # (a chain's shards are merged as they are read, one held at a time: ckptchain)
    located, clock = [], 0
    for sh in shards:                           # ids and counts only
        located.append(t.locate(sh["ids"])[0])
        clock = max(clock, int((sh.get("counters") or {}).get("clock", 0)))
    empty: dict[str, torch.Tensor] = {}         # each per-row state entry, no rows
    scalars0: dict[str, Any] = {}               # the other entries, shard 0's first
    any_state = False
    for sh in shards:                           # shard 0's state, mostly (the first new
        saved = sh.get("state") or {}           # shard reads it next)
        any_state = any_state or bool(saved)
        for key, value in saved.items():
            if torch.is_tensor(value) and value.dim() and len(value) == len(sh["ids"]):
                empty.setdefault(key, value[:0])
            else:
                scalars0.setdefault(key, value)
        if saved:
            break
    for k in range(t.num_shards):
        ids: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)]
        weight: list[torch.Tensor] = [torch.empty(0, *t.row_shape, dtype=t.dtype)]
        count: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)]
        last: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)]
        per_row: dict[str, list[torch.Tensor]] = {key: [v] for key, v in empty.items()}
        for s, part in enumerate(located):
            mine = (part == k).nonzero().flatten()
            if not len(mine):
                continue
            sh = shards[s]
            counters = sh.get("counters") or {}
            size = len(sh["ids"])
            ids.append(sh["ids"][mine])
            weight.append(sh["weight"][mine].to(t.dtype))
            count.append(counters["count"][mine] if "count" in counters
                         else torch.ones(len(mine), dtype=torch.int64))
            last.append(counters["last"][mine] if "last" in counters
                        else torch.zeros(len(mine), dtype=torch.int64))
            for key, value in (sh.get("state") or {}).items():
                if torch.is_tensor(value) and value.dim() and len(value) == size:
                    per_row.setdefault(key, []).append(value[mine])
            del sh
        state: dict[str, Any] = {key: torch.cat(values) for key, values in per_row.items()}
        state.update(scalars0)
        rows.write_shard(t.name, k, None, {
            "ids": torch.cat(ids), "weight": torch.cat(weight),
            "counters": {"count": torch.cat(count), "last": torch.cat(last), "clock": clock},
            "candidates": _candidates_of(shards, t, k),
            "state": state if any_state else None})
