"""A hash-table shard's admission and eviction written plainly, to check mpisync.hashing by.

One dict of held ids and one of candidates; every rule of ``mpisync.hashing``'s module
docstring spelled out one id at a time.
"""
from __future__ import annotations


class ReferenceShard:
    """Rows held (id -> [sightings, last sighting]) and candidates, one id at a time."""

    def __init__(self, capacity: int, eviction: str = "lru", admit_after: int = 1):
        self.capacity, self.eviction, self.admit_after = capacity, eviction, admit_after
        self.rows: dict[int, list[int]] = {}
        self.candidates: dict[int, list[int]] = {}
        self.clock = 0
        self.admitted = self.evicted = 0

    def see(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """One lookup message with ``ids``: (ids admitted by it, ids evicted by it)."""
        ids = sorted(set(ids))
        assert len(ids) <= self.capacity
        self.clock += 1
        for i in ids:
            if i in self.rows:
                self.rows[i][0] += 1
                self.rows[i][1] = self.clock
        admit = []
        for i in ids:
            if i in self.rows:
                continue
            count = self.candidates.get(i, [0, 0])[0] + 1
            if count >= self.admit_after:
                admit.append(i)
                self.candidates.pop(i, None)
            else:
                self.candidates[i] = [count, self.clock]
        while len(self.candidates) > self.capacity:
            oldest = min(self.candidates, key=lambda i: (self.candidates[i][1], i))
            del self.candidates[oldest]
        evicted = []
        for i in admit:
            if len(self.rows) == self.capacity:
                victim = min((j for j, (_, last) in self.rows.items() if last < self.clock),
                             key=self._victim_order)
                del self.rows[victim]
                evicted.append(victim)
            self.rows[i] = [self.admit_after, self.clock]
        self.admitted += len(admit)
        self.evicted += len(evicted)
        return admit, evicted

    def _victim_order(self, i: int):
        count, last = self.rows[i]
        return (last, i) if self.eviction == "lru" else (count, last, i)

    def stats(self) -> dict[str, int]:
        return {"admitted": self.admitted, "evicted": self.evicted, "live": len(self.rows)}
