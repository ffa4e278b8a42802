"""Saved table shards re-cut for another partitioning, one new shard at a time (no MPI).

A checkpoint holds each ``mpisync.Embedding`` table as the shards of the job that saved
it: ``{"num_rows", "row_shape", "dtype", "strategy", "shards": [{"ids", "weight",
"state"}, ...]}``, where ``ids`` are the global row ids a shard holds, ``weight`` their
rows and ``state`` the wrapped optimizer's state of that shard. A job with another
number of ps ranks, another partitioner or another ``partition_strategy`` builds each
of its own shards from them, row by row:

- a state tensor whose first dimension is the saved shard's row count is per-row
  (Adagrad's ``sum``, Adam's ``exp_avg``/``exp_avg_sq``, a row-wise ``(rows,)`` state):
  each row's entry goes with the row; rows of a saved shard that had no state yet (a
  lazily initialised optimizer such as SparseAdam that never stepped it) get zeros;
- any other entry (a ``step`` counter, a number) belongs to the shard as a whole and
  is copied to every new shard that takes rows from it; the saved shards that give
  rows to one new shard must agree on it, or the load is refused (their rows would be
  updated as if they had taken the same number of steps). A shard counts only the steps
  that gave it rows, so counters differ once a shard missed one; where the update never
  reads an entry (``unread``: Adagrad's ``step`` without ``lr_decay``, RowWiseAdagrad's),
  they may differ, and the new shard takes the largest.

Memory: the id map of one saved shard at a time (two int64 per saved row), and one new
shard's rows and state being filled; the saved tensors are read from the file as
they are needed (``torch.load(mmap=True)``), so no process ever holds a whole table.
"""
from __future__ import annotations

import torch

from ..protocol.multi import inner_of
from ..protocol.tables import TableSpec

__all__ = ["check_table", "new_shard", "sources", "unread_counters"]


def _per_row(value, rows: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if torch.is_tensor(a) or torch.is_tensor(b):
        return False
    return a == b


def _shown(value) -> str:
    return repr(value.tolist() if torch.is_tensor(value) and value.numel() <= 4 else value)


def sources(saved: dict, spec: TableSpec) -> tuple[list[list[int]], list[int]]:
    """Which saved shards give rows to each shard of ``spec``, and how many rows each gets.

    Returns:
        ``(from_shards, rows)``: ``from_shards[k]`` the numbers of the saved shards
        holding rows of shard ``k``, in order; ``rows[k]`` how many rows they give it.

    Raises:
        ValueError: a saved id lies outside the table.
    """
    from_shards: list[list[int]] = [[] for _ in range(spec.num_shards)]
    rows = [0] * spec.num_shards
    for s, shard in enumerate(saved["shards"]):
        part, _ = spec.locate(shard["ids"])
        counts = torch.bincount(part, minlength=spec.num_shards).tolist()
        for k, n in enumerate(counts):
            if n:
                from_shards[k].append(s)
                rows[k] += n
    return from_shards, rows


def check_table(saved: dict, spec: TableSpec, unread: tuple[str, ...] = ()) -> str | None:
    """What keeps the saved table from loading into ``spec``'s shards, or None.

    Checks the shape, that every row is there once per new shard, and that the saved
    shards giving rows to one new shard agree on their per-shard state (but for the
    entries named in ``unread``, which the optimizer's update does not read).
    """
    name = spec.name
    if saved["num_rows"] != spec.num_rows or list(saved["row_shape"]) != list(spec.row_shape):
        return (f"table {name!r} was saved with {saved['num_rows']} rows of "
                f"{list(saved['row_shape'])}, this one has {spec.num_rows} rows of "
                f"{list(spec.row_shape)}")
    shards = saved["shards"]
    total = sum(len(sh["ids"]) for sh in shards)
    if total != spec.num_rows:
        return f"table {name!r} in the checkpoint holds {total} rows of {spec.num_rows}"
    for s, sh in enumerate(shards):
        shape = _weight_shape(sh)
        if shape != (len(sh["ids"]), *spec.row_shape):
            return (f"shard {s} of table {name!r} in the checkpoint has rows of shape "
                    f"{list(shape)} for {len(sh['ids'])} ids")
    try:
        from_shards, rows = sources(saved, spec)
    except ValueError as exc:
        return f"table {name!r} in the checkpoint: {exc}"
    for k, (given, want) in enumerate(zip(rows, spec.shard_rows)):
        if given != want:
            return (f"table {name!r} in the checkpoint gives shard {k} {given} rows, it "
                    f"holds {want}: the saved ids are not each row once")
    for k, saved_shards in enumerate(from_shards):
        problem = _disagreement(shards, saved_shards, unread)
        if problem:
            return (f"table {name!r}: {problem}, and rows of both go to shard {k} of this "
                    f"job's {spec.num_shards} ({spec.strategy!r}); load it into the "
                    f"partitioning it was saved with ({len(shards)} shards, "
                    f"{saved['strategy']!r}), where each shard keeps its own")
    return None


def _weight_shape(sh) -> tuple[int, ...]:
    """The shape of a saved shard's rows (a chain's merged shard says it without merging)."""
    shape = getattr(sh, "weight_shape", None)
    return tuple(sh["weight"].shape) if shape is None else tuple(shape())


def _shard_entries(sh) -> dict:
    """A saved shard's state entries that are not per row (a chain's merged shard gives
    them without merging its rows)."""
    entries = getattr(sh, "shard_entries", None)
    if entries is not None:
        return entries()
    n = len(sh["ids"])
    return {k: v for k, v in (sh.get("state") or {}).items() if not _per_row(v, n)}


def _disagreement(shards: list[dict], saved_shards: list[int], unread: tuple[str, ...]
                  ) -> str | None:
    """The first per-shard state entry on which two of ``saved_shards`` differ, described."""
    first: dict = {}
    for s in saved_shards:
        for key, value in _shard_entries(shards[s]).items():
            if key in unread:
                continue
            if key not in first:
                first[key] = (s, value)
            elif not _same(first[key][1], value):
                t, other = first[key]
                return (f"saved shards {t} and {s} hold {key!r} = {_shown(other)} and "
                        f"{_shown(value)}")
    return None


def new_shard(saved: dict, spec: TableSpec, k: int, from_shards: list[int],
              unread: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
    """Shard ``k`` of ``spec`` built from the saved shards ``from_shards``: rows, state.

    The state is ``{}`` when none of those shards had any (the optimizer starts it as
    for a fresh parameter); an entry named in ``unread`` is the largest of the shards'.
    Call ``check_table`` first (with the same ``unread``).
    """
    rows = spec.shard_rows[k]
    weight = torch.empty(rows, *spec.row_shape, dtype=spec.dtype)
    state: dict = {}
    for s in from_shards:
        sh = saved["shards"][s]
        part, local = spec.locate(sh["ids"])
        mine = (part == k).nonzero().flatten()
        at = local[mine]
        del part, local
        weight[at] = sh["weight"][mine].to(spec.dtype)
        n = len(sh["ids"])
        for key, value in (sh.get("state") or {}).items():
            if _per_row(value, n):
                if key not in state:
                    state[key] = torch.zeros(rows, *value.shape[1:], dtype=value.dtype)
                state[key][at] = value[mine]
            elif key not in state or (key in unread and value > state[key]):
                state[key] = value.clone() if torch.is_tensor(value) else value
    return weight, state


def unread_counters(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """The per-shard entries of a table's state that ``optimizer``'s update does not read:
    Adagrad's ``step`` without ``lr_decay``, ``mpisync.RowWiseAdagrad``'s ``step``."""
    from .rowwise import RowWiseAdagrad
    optimizer = inner_of(optimizer, group)
    if type(optimizer) is RowWiseAdagrad or (type(optimizer) is torch.optim.Adagrad
                                             and not group.get("lr_decay")):
        return ("step",)
    return ()
