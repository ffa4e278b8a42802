"""A ps rank's tables as they stood at a checkpoint's step, while training goes on.

A checkpoint's tables are written after the workers went on training: the chief asks
every ps rank for a snapshot at the saved step (``("snap_begin", mode)``), the workers
continue, and its writer reads the snapshot shard by shard (``("snap_read", unit)``),
each shard once. Shards are copied on write: before anything here changes rows of a
shard not read yet (a step's row updates, a dense step of the shard, an ``opt.update``
function, a load; of a hash shard also an admitted id's initial row and the reset of its
optimizer state), those rows' values and per-row optimizer state are kept as they were,
once per row, so a read gives the saved step's shard and the extra memory is the rows
changed while the snapshot is read (the whole shard at most, where a dense step changes
every row). A hash shard's ids, slots and counts are small beside its rows: they are
copied at the snapshot. What an incremental file holds (the rows changed since the last
file, see ``mpisync.ps.changes``) is decided at the snapshot too, and the marks start
again there.
"""
from __future__ import annotations

import torch

from ..errors import ProtocolError
from .changes import Marks, per_row_keys, state_of

__all__ = ["Snapshot", "answer"]


class Snapshot:
    """One dense resident shard at the snapshot's step, kept by copying rows on write."""

    __slots__ = ("chunks", "copied", "fixed", "local", "mode", "optimizer", "param", "per_row",
                 "state_keys", "whole")

    def __init__(self, param: torch.Tensor, optimizer, marks: Marks | None, mode):
        self.param, self.optimizer = param, optimizer
        state = state_of(optimizer, param)
        rows = param.shape[0]
        self.mode = mode                  # None: every row, marks untouched; False/True
        self.state_keys = tuple(state)    # the entries that existed at the step
        self.per_row = per_row_keys(state, rows)
        # the entries that are not per row (a step count): small, kept now
        self.fixed = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()
                      if k not in self.per_row}
        self.local: torch.Tensor | None = None       # the rows to give (None: every row)
        if mode is not None and marks is not None:
            whole = not mode or self.state_keys != marks.keys
            if not whole:
                self.local = marks.changed.nonzero().flatten()
            marks.keys = self.state_keys
            marks.clear()
        self.copied = torch.zeros(rows, dtype=torch.bool)
        self.chunks: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        self.whole: tuple[torch.Tensor, dict] | None = None   # every row kept

    def before(self, rows) -> None:
        """``rows`` (local ids, or True: every row) are about to change: keep those not
        kept yet as they are."""
        if self.whole is not None or rows is None:
            return
        state = state_of(self.optimizer, self.param)
        values = self.param.detach()
        if rows is True:                  # every row: kept whole, with the rows kept so far
            weight = values.clone()
            kept = {k: state[k].clone() for k in self.per_row if k in state}
            for ids, old, saved in self.chunks:
                weight[ids] = old
                for k, v in saved.items():
                    kept[k][ids] = v
            self.whole = (weight, kept)
            self.chunks, self.copied = [], torch.zeros(0, dtype=torch.bool)
            return
        if not len(rows):
            return
        new = rows[~self.copied[rows]]
        if not len(new):
            return
        new = torch.unique(new)
        self.copied[new] = True
        self.chunks.append((new, values[new], {k: state[k][new] for k in self.per_row
                                               if k in state}))

    def read(self) -> dict:
        """The shard at the snapshot's step, as ``Marks.read`` (``mode`` given) or a plain
        read (``{"weight", "state"}``) gives it."""
        weight, out_state = self.values(self.local)
        if self.mode is None:
            return {"weight": weight, "state": out_state}
        return {"local": self.local, "per_row": list(self.per_row), "weight": weight,
                "state": out_state}

    def values(self, local: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The rows ``local`` (sorted local ids; None: every row) as at the snapshot: their
        weight and their optimizer state (the per-row entries' rows, the others whole)."""
        if self.whole is not None:
            weight, kept = self.whole
            per_row = {k: kept[k] for k in self.per_row}
        else:
            state = state_of(self.optimizer, self.param)
            weight = self.param.detach()
            per_row = {k: state[k] for k in self.per_row}
        weight = weight.clone() if local is None else weight[local]
        per_row = {k: v.clone() if local is None else v[local] for k, v in per_row.items()}
        for ids, rows, saved in self.chunks:        # rows changed since: as they were
            if local is None:
                at, have = ids, slice(None)
            else:
                at = torch.searchsorted(local, ids).clamp_(max=max(len(local) - 1, 0))
                have = local[at] == ids if len(local) else torch.zeros(len(ids), dtype=torch.bool)
                at = at[have]
            weight[at] = rows[have]
            for k, v in saved.items():
                per_row[k][at] = v[have]
        return weight, {k: per_row[k] if k in per_row else self.fixed[k]
                        for k in self.state_keys}


class HashSnapshot:
    """One hash shard at the snapshot's step: the ids it held, their slots and counts
    (and, for an incremental file, which of them changed, the ids evicted since), taken
    now; their rows and optimizer state kept by copying slots on write (an admitted id's
    initial row, its state reset, a step's updates, a load)."""

    __slots__ = ("before", "hashed", "plan", "rows")

    def __init__(self, hashed, optimizer, mode):
        self.hashed = hashed
        self.plan = hashed.plan(optimizer, True, mode)
        self.rows = Snapshot(hashed.param, optimizer, None, None)
        self.before = hashed.keep = self.rows.before     # slots' rows, by slot

    def read(self) -> dict:
        """The rows planned, with their values and state as at the snapshot (by id)."""
        self.drop()
        slots = torch.from_numpy(self.plan["got"]["slots"])[self.plan["pick"]]
        order = torch.argsort(slots)
        weight, state = self.rows.values(slots[order])
        back = torch.empty_like(order)          # the plan's order again
        back[order] = torch.arange(len(order))
        per_row = set(self.rows.per_row)
        return self.hashed.rows_of(self.plan, weight[back],
                         {k: v[back] if k in per_row else v for k, v in state.items()},
                         True, picked=True)

    def drop(self) -> None:
        if self.hashed.keep == self.before:
            self.hashed.keep = None


def answer(shards, request, optimizer):
    """The answer to a snapshot request to ``shards`` (a ps rank's ``RowShards``, its row
    updates settled): ``("snap_begin", mode)`` (``mode`` as ``read_changed``'s, None:
    plain reads) takes the snapshot of every resident shard, ``("snap_read", unit)``
    gives one shard as at it (each once), ``("snap_end",)`` drops what is left. None, the
    shard, or the error."""
    what = request[0]
    for snap in shards.snaps.values() if what != "snap_read" else ():
        if isinstance(snap, HashSnapshot):
            snap.drop()
    if what == "snap_begin":
        mode = request[1]
        shards.snaps = {}
        for u in shards.units:
            if not u.spec.resident:
                continue
            if u.hashed is not None:
                shards.snaps[u.unit] = HashSnapshot(u.hashed, optimizer, mode)
            else:
                shards.snaps[u.unit] = Snapshot(u.param, optimizer, u.marks, mode)
        return None
    if what == "snap_read":
        snap = shards.snaps.pop(request[1], None)
        u = shards.by_unit.get(request[1])
        if u is None or snap is None:
            return ProtocolError(f"{shards.label}: a snapshot read of table shard "
                                 f"{request[1]!r}, not held here or read already")
        return snap.read()
    shards.snaps = {}
    return None

