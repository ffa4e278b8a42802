"""Which rows of a resident table shard changed since the last incremental read, on its ps.

A checkpoint that writes only the rows that changed since the previous one asks each
shard's ps for them (``("read_changed", unit, with_state, whole)``). The ps keeps one
bool per row of each ``mpisync.Embedding`` shard it holds, set by everything that
changes a row here: a step's row updates (the ids the step touched, or every row when
the optimizer steps the shard's dense gradient), a function of ``opt.update`` over all
rows, and a write of the shard (a load). Reading them clears the marks, so the next
read answers the rows changed since this one. A hash shard's marks are over its slots
(``mpisync.ps.hashrows``): a lookup that sights an id changes its counts too.

A step costs one indexed write of its touched local ids into the marks (no allocation
beyond torch's index temporaries), and nothing while every row is marked: from the start
(nothing read yet) until the first read, so a job that never reads its changed rows never
pays for them.
"""
from __future__ import annotations

import torch

from ..native import kernels

__all__ = ["Marks", "per_row_keys", "state_of"]


def state_of(optimizer, param: torch.Tensor) -> dict:
    """The optimizer's state of ``param`` ({} without an optimizer or state yet)."""
    return optimizer.state.get(param, {}) if optimizer is not None else {}


def per_row_keys(state: dict, rows: int) -> list[str]:
    """The state entries of a shard of ``rows`` rows that hold one entry per row (a tensor
    whose first dimension is ``rows``), in the state's order."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows]


class Marks:
    """The changed rows of one resident table shard since its last incremental read."""

    __slots__ = ("changed", "every", "keys")

    def __init__(self, rows: int):
        self.changed = torch.ones(rows, dtype=torch.bool)   # nothing read yet: all of them
        self.every = True                                    # every row is marked
        self.keys: tuple[str, ...] | None = None             # the state entries last read

    def mark(self, rows) -> None:
        """``rows`` changed: None (none), a tensor of local ids, or True (every row)."""
        if rows is None or self.every:
            return
        if rows is True:
            self.changed.fill_(True)
            self.every = True
        elif len(rows) and kernels.available():
            kernels.set_flags(rows, self.changed)
        elif len(rows):
            self.changed[rows] = True

    def read(self, param: torch.Tensor, state: dict, with_state: bool, whole: bool) -> dict:
        """The changed rows (every row with ``whole``), and forget them.

        Returns:
            ``{"local": local ids or None (every row), "weight": their rows, "per_row":
            the per-row state entries' names}``, and with ``with_state`` ``"state"``: the
            per-row entries' rows of those ids, the other entries (a ``step``) whole. A
            shard whose state entries are not those of the last read (state that appeared
            since, or was dropped) is read whole.
        """
        rows = param.shape[0]
        keys = tuple(state)
        if with_state and keys != self.keys:
            whole = True
        per_row = per_row_keys(state, rows)
        local = None if whole else self.changed.nonzero().flatten()
        values = param.detach()
        out: dict = {"local": local, "per_row": per_row,
                     "weight": values.clone() if local is None else values[local]}
        if with_state:
            out["state"] = {k: (v.clone() if local is None or k not in per_row else v[local])
                            if torch.is_tensor(v) else v for k, v in state.items()}
            self.keys = keys
        self.clear()
        return out

    def clear(self) -> None:
        """Forget the marks: the next read answers the rows changed from now on."""
        self.changed.fill_(False)
        self.every = False
