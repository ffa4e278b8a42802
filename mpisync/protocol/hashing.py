"""Hash tables for unbounded int64 ids: the fixed hash, the per-id initial rows, the slot map.

Pure functions and one pure class (numpy and torch, no MPI), shared by the workers (which
shard an id lives in) and the ps ranks (which slot of the shard holds it).

- **The hash.** ``splitmix64`` (Steele, Lea and Flood's SplitMix64 finaliser) of the id
  taken as an unsigned 64-bit integer. It is fixed: the same on every rank, every run
  and every platform. Id ``i`` lives in shard ``splitmix64(i) % num_shards``.
- **Initial rows.** Row ``i`` starts at ``N(0, 1)`` values (times the table's
  ``init_std``) drawn by Box-Muller from the
  two 32-bit halves of a counter-based hash per column, ``splitmix64`` of
  ``(seed, i, column)``: the same
  ``(seed, id)`` gives the same row whatever the shard count, the rank or the order of
  first use (``initial_rows``).
- **Slots.** A shard is a dense tensor of ``capacity`` rows; ``SlotMap`` maps the ids it
  holds to slots (a sorted id array and ``searchsorted``), admits ids after
  ``admit_after`` sightings and evicts one row per admitted id when full.

A *sighting* of an id on a shard is one lookup message (one training-mode ``forward`` of
one worker) whose ids include it; each such message ticks the shard's clock once.
Recency is the clock at a row's last sighting. Eviction takes, among the rows not seen
by the message being admitted, the least recently seen (``"lru"``) or the least often
seen (``"lfu"``, ties by recency); remaining ties go to the smallest id. Ids not yet
admitted are remembered with their sighting counts, at most ``capacity`` of them per
shard (the least recently seen forgotten first); an evicted id starts again from zero
sightings.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["EVICTIONS", "HashSpec", "SlotMap", "check_std", "initial_rows", "shard_of",
           "splitmix64"]

EVICTIONS = ("lru", "lfu")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SEED_SALT = np.uint64(0x5EED5EED5EED5EED)


@dataclass(frozen=True)
class HashSpec:
    """How a hash table's shards hold rows: the same on every rank."""

    capacity: int          # rows per shard
    eviction: str          # "lru" | "lfu"
    admit_after: int       # sightings before an id gets a row
    init_std: float = 1.0  # the initial rows' standard deviation


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 of each element (``uint64``, arithmetic modulo 2**64)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def _as_u64(ids: torch.Tensor | npt.ArrayLike) -> np.ndarray:
    if torch.is_tensor(ids):
        ids = ids.detach().cpu().to(torch.int64).numpy()
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)


def shard_of(ids: torch.Tensor | npt.ArrayLike, num_shards: int) -> torch.Tensor:
    """The shard of each id: ``splitmix64(id) % num_shards`` (an int64 tensor)."""
    h = splitmix64(_as_u64(ids)) % np.uint64(num_shards)
    return torch.from_numpy(h.astype(np.int64))


def check_std(std: object, dtype: torch.dtype = torch.float32, name: str = "std") -> None:
    """Raises TypeError unless ``std`` is a real number, ValueError unless the rows it
    scales are finite and not all zero in ``dtype``: ``std`` at least ``dtype``'s smallest
    normal number and at most its largest over 8 (the unit draws lie within +-6.7)."""
    if isinstance(std, bool) or not isinstance(std, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {std!r}")
    info = torch.finfo(dtype)
    if not info.tiny <= float(std) <= info.max / 8:
        raise ValueError(f"{name} must lie in [{info.tiny:g}, {info.max / 8:g}] for {dtype} "
                         f"rows, got {std!r}")


def initial_rows(ids: torch.Tensor | npt.ArrayLike, dim: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32, std: float = 1.0) -> torch.Tensor:
    """The initial rows of ``ids`` (``[len(ids), dim]``, ``N(0, std**2)``), a pure function.

    Column ``c`` of id ``i``: with ``key = splitmix64(i ^ splitmix64(seed ^ salt))`` and
    ``h = splitmix64(key + c * 0x9E3779B97F4A7C15)``, ``u1 = ((h >> 32) + 1) / 2**32`` and
    ``u2 = (h & 0xFFFFFFFF) / 2**32``, the value is ``sqrt(-2 ln u1) cos(2 pi u2) * std``
    computed in float64, then cast to ``dtype``.

    Raises:
        TypeError, ValueError: ``std`` is not a real number whose rows fit ``dtype``
            (``check_std``).
    """
    check_std(std, dtype)
    u = _as_u64(ids)
    with np.errstate(over="ignore"):
        salt = splitmix64(np.uint64(seed % (1 << 64)) ^ _SEED_SALT)
        key = splitmix64(u ^ salt)
        j = np.arange(dim, dtype=np.uint64) * _GOLDEN
        h = splitmix64(key[:, None] + j[None, :])
    scale = 1.0 / (1 << 32)
    # through uint32: numpy converts uint64 to float64 slowly
    u1 = ((h >> np.uint64(32)).astype(np.uint32).astype(np.float64) + 1.0) * scale  # (0, 1]
    u2 = h.astype(np.uint32).astype(np.float64) * scale       # the low half
    np.log(u1, out=u1)
    u1 *= -2.0
    np.sqrt(u1, out=u1)
    u2 *= 2.0 * math.pi
    np.cos(u2, out=u2)
    u1 *= u2
    if std != 1.0:
        u1 *= float(std)
    return torch.from_numpy(u1).to(dtype)


def _smallest(columns: list[np.ndarray], k: int) -> np.ndarray:
    """Indices of the ``k`` rows smallest by ``columns`` (compared in order; the last one
    unique), in no particular order: a partition per column, no full sort."""
    candidates = np.arange(len(columns[0]))
    chosen = []
    for col in columns:
        if k == 0:
            break
        values = col[candidates]
        if k >= len(candidates):
            chosen.append(candidates)
            k = 0
            break
        kth = _kth(values, k)
        below = candidates[values < kth]
        chosen.append(below)
        k -= len(below)
        candidates = candidates[values == kth]
    if k:
        chosen.append(candidates[:k])        # only if the last column repeats
    return np.concatenate(chosen) if chosen else np.empty(0, np.int64)


def _kth(values: np.ndarray, k: int):
    """The ``k``-th smallest of ``values`` (1-based): a histogram for a narrow range of
    integers (sighting counts, clocks: selection is slow on many equal values)."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 4 * len(values):
        cumulative = np.cumsum(np.bincount(values - lo))
        return lo + int(np.searchsorted(cumulative, k))
    return np.partition(values, k - 1)[k - 1]


class SlotMap:
    """Which id each of a shard's ``capacity`` slots holds: admission, recency, eviction.

    ``see(ids)`` is one sighting of each of ``ids`` (sorted, unique): rows already held
    are refreshed, ids with ``admit_after`` sightings are admitted into free slots, or
    into the slots of evicted rows when the shard is full. ``peek(ids)`` only reads.
    The counters ``admitted``, ``evicted`` and ``live`` count rows since creation (or load).

    Raises:
        ValueError: ``see`` got more distinct ids than the capacity.
    """

    def __init__(self, capacity: int, eviction: str = "lru", admit_after: int = 1) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.capacity, self.eviction, self.admit_after = capacity, eviction, admit_after
        self._reset()

    def _reset(self) -> None:
        """Empty: no rows held, no candidates, the clock and the counters at zero."""
        capacity = self.capacity
        self.keys = np.empty(0, np.int64)         # the ids held, sorted
        self.key_slot = np.empty(0, np.int64)     # ... and their slots
        self.slot_id = np.zeros(capacity, np.int64)
        self.live = np.zeros(capacity, bool)
        self.count = np.zeros(capacity, np.int64)   # sightings of the row's id
        self.last = np.zeros(capacity, np.int64)    # the clock at its last sighting
        self.clock = 0
        self.cand_keys = np.empty(0, np.int64)    # ids seen, not admitted yet (sorted)
        self.cand_count = np.empty(0, np.int64)
        self.cand_last = np.empty(0, np.int64)
        self.admitted = self.evicted = 0

    @property
    def num_live(self) -> int:
        """The number of rows the shard holds now."""
        return len(self.keys)

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not held; changes nothing."""
        ids = np.asarray(ids, np.int64)
        if not len(self.keys):
            return np.full(len(ids), -1, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, ids), len(self.keys) - 1)
        return np.where(self.keys[pos] == ids, self.key_slot[pos], -1)

    def see(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One sighting of ``ids`` (sorted, unique): ``(slot of each or -1, slots admitted)``.

        The admitted slots are in the order of their ids in ``ids``; they need their
        initial rows (and fresh optimizer state) before anyone reads them.
        """
        ids = np.asarray(ids, np.int64)
        if len(ids) > self.capacity:
            raise ValueError(f"{len(ids)} distinct ids in one lookup of a shard that holds "
                             f"{self.capacity} rows (capacity_per_shard)")
        self.clock += 1
        t = self.clock
        slots = self.peek(ids)
        hit = slots >= 0
        self.count[slots[hit]] += 1
        self.last[slots[hit]] = t
        miss = np.flatnonzero(~hit)
        if not len(miss):
            return slots, np.empty(0, np.int64)
        if self.admit_after > 1:
            miss = miss[self._sighted(ids[miss], t)]
        if not len(miss):
            return slots, np.empty(0, np.int64)
        new = self._allocate(len(miss), t)
        admit = ids[miss]
        self.slot_id[new] = admit
        self.live[new] = True
        self.count[new] = self.admit_after
        self.last[new] = t
        pos = np.searchsorted(self.keys, admit)
        self.keys = np.insert(self.keys, pos, admit)
        self.key_slot = np.insert(self.key_slot, pos, new)
        slots[miss] = new
        self.admitted += len(new)
        return slots, new

    def _sighted(self, ids: np.ndarray, t: int) -> np.ndarray:
        """Count a sighting of ids not held; True for those now due for admission."""
        n = len(self.cand_keys)
        pos = np.searchsorted(self.cand_keys, ids)
        found = pos < n
        found[found] = self.cand_keys[pos[found]] == ids[found]
        counts = np.ones(len(ids), np.int64)
        counts[found] = self.cand_count[pos[found]] + 1
        self.cand_count[pos[found]] = counts[found]
        self.cand_last[pos[found]] = t
        new = ~found
        at = pos[new]
        self.cand_keys = np.insert(self.cand_keys, at, ids[new])
        self.cand_count = np.insert(self.cand_count, at, 1)
        self.cand_last = np.insert(self.cand_last, at, t)
        due = counts >= self.admit_after
        if due.any():
            keep = ~np.isin(self.cand_keys, ids[due], assume_unique=True)
            self._keep_candidates(keep)
        self._forget_excess_candidates()
        return due

    def _forget_excess_candidates(self) -> None:
        """At most ``capacity`` candidates: the least recently seen, then the smallest
        ids, are forgotten."""
        excess = len(self.cand_keys) - self.capacity
        if excess > 0:
            order = np.lexsort((self.cand_keys, self.cand_last))
            keep = np.ones(len(self.cand_keys), bool)
            keep[order[:excess]] = False
            self._keep_candidates(keep)

    def _keep_candidates(self, keep: np.ndarray) -> None:
        self.cand_keys = self.cand_keys[keep]
        self.cand_count = self.cand_count[keep]
        self.cand_last = self.cand_last[keep]

    def _allocate(self, k: int, t: int) -> np.ndarray:
        """``k`` slots: free ones (lowest first), then those of evicted rows."""
        free = np.flatnonzero(~self.live)[:k]
        need = k - len(free)
        if need <= 0:
            return free
        held = np.flatnonzero(self.live & (self.last < t))      # not seen by this message
        order = [self.last, self.slot_id]
        if self.eviction == "lfu":
            order.insert(0, self.count)
        victims = held[_smallest([col[held] for col in order], need)]
        self.live[victims] = False
        gone = np.searchsorted(self.keys, self.slot_id[victims])     # all held
        self.keys, self.key_slot = np.delete(self.keys, gone), np.delete(self.key_slot, gone)
        self.evicted += need
        return np.concatenate([free, victims])

    # -- whole shards (checkpoints) ---------------------------------------------------------
    def export(self) -> dict[str, np.ndarray]:
        """The rows held, by id: ``ids`` (sorted), ``slots``, ``count``, ``last``; and the
        ids seen but not admitted yet (``admit_after`` above 1): ``cand_ids`` (sorted),
        ``cand_count``, ``cand_last``."""
        return {"ids": self.keys.copy(), "slots": self.key_slot.copy(),
                "count": self.count[self.key_slot], "last": self.last[self.key_slot],
                "cand_ids": self.cand_keys.copy(), "cand_count": self.cand_count.copy(),
                "cand_last": self.cand_last.copy()}

    def reload(self, ids: np.ndarray, count: np.ndarray, last: np.ndarray, clock: int,
               candidates: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
               ) -> np.ndarray:
        """Hold exactly ``ids`` (unique), in slots ``0..len(ids)-1``; returns those slots.

        ``candidates``: the ids seen but not admitted yet, with their sightings and last
        sighting (``export``'s), kept as they were (the least recently seen forgotten
        beyond ``capacity``, ids held dropped); none if not given. The counters start
        again: ``admitted`` is the rows given, ``evicted`` zero.
        """
        ids = np.asarray(ids, np.int64)
        if len(ids) > self.capacity:
            raise ValueError(f"{len(ids)} rows for a shard that holds {self.capacity} "
                             f"(capacity_per_shard)")
        order = np.argsort(ids, kind="stable")
        if len(ids) > 1 and not (np.diff(ids[order]) > 0).all():
            raise ValueError("the ids given for a hash shard repeat")
        n = len(ids)
        self._reset()
        slots = np.arange(n, dtype=np.int64)
        self.slot_id[:n], self.live[:n] = ids, True
        self.count[:n], self.last[:n] = count, last
        self.keys, self.key_slot = ids[order], slots[order]
        self.clock = max(int(clock), int(np.max(last)) if n else 0)
        self.admitted = n
        if candidates is not None and len(candidates[0]):
            c_ids, c_count, c_last = (np.asarray(a, np.int64) for a in candidates)
            keep = ~np.isin(c_ids, ids)
            c_order = np.argsort(c_ids[keep], kind="stable")
            self.cand_keys = c_ids[keep][c_order]
            if len(self.cand_keys) > 1 and not (np.diff(self.cand_keys) > 0).all():
                raise ValueError("the ids given as candidates for a hash shard repeat")
            self.cand_count, self.cand_last = c_count[keep][c_order], c_last[keep][c_order]
            self._forget_excess_candidates()
            self.clock = max(self.clock, int(np.max(c_last)))
        return slots

    def stats(self) -> dict[str, int]:
        """The counters: rows ``admitted`` and ``evicted`` since creation (or load), and
        ``live`` rows held now."""
        return {"admitted": self.admitted, "evicted": self.evicted, "live": self.num_live}
