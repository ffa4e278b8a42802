"""Consolidated optimizer state: checked against the model, split by owning ps (no MPI)."""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["check_state", "merge_units", "split_state", "split_units"]


def _check_tables(saved: dict, tables: dict) -> str | None:
    """What makes saved tables not fit this optimizer's, or None."""
    for name, table in saved.items():
        t = tables.get(name)
        if t is None:
            return f"the state has table {name!r}, this optimizer has tables {sorted(tables)}"
        shards = table.get("shards", ())
        if len(shards) != t.num_shards or table.get("strategy") != t.strategy or \
                table.get("num_rows") != t.num_rows:
            return (f"table {name!r} was saved with {table.get('num_rows')} rows in "
                    f"{len(shards)} shards ({table.get('strategy')}), this one has "
                    f"{t.num_rows} rows in {t.num_shards} shards ({t.strategy}); a table loads "
                    f"into the same partitioning")
        for k, shard in enumerate(shards):
            if t.hashed is not None:        # a hash shard: the rows it held, by id
                if len(shard["weight"]) > t.shard_rows[k] or \
                        tuple(shard["weight"].shape[1:]) != t.row_shape:
                    return (f"shard {k} of hash table {name!r} has shape "
                            f"{list(shard['weight'].shape)}, expected at most "
                            f"{[t.shard_rows[k], *t.row_shape]}")
                continue
            if tuple(shard["weight"].shape) != (t.shard_rows[k], *t.row_shape):
                return (f"shard {k} of table {name!r} has shape {list(shard['weight'].shape)}, "
                        f"expected {[t.shard_rows[k], *t.row_shape]}")
    return None


def check_state(state_dict: dict, param_groups: list[dict], order: list[str],
                shape_of: dict[str, tuple], tables: dict | None = None) -> str | None:
    """What makes ``state_dict`` not fit the model, or None.

    Args:
        state_dict: torch's schema (``state`` numbered in param-group order, and
            ``param_groups``), plus mpisync's ``"mpisync"`` entry.
        param_groups: the optimizer's param groups.
        order: parameter names in param-group order.
        shape_of: each parameter's shape.
        tables: the optimizer's ``mpisync.Embedding`` tables, ``{name: TableSpec}``.
    """
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
        return "expected a dict with 'state' and 'param_groups', as state_dict() returns"
    if len(groups) != len(param_groups):
        return f"the state has {len(groups)} param groups, the optimizer {len(param_groups)}"
    for g, (mine, saved) in enumerate(zip(param_groups, groups)):
        if len(saved.get("params", ())) != len(mine["params"]):
            return (f"param group {g} has {len(saved.get('params', ()))} parameters in the "
                    f"state, {len(mine['params'])} in the optimizer")
    for i, st in state_dict["state"].items():
        if not 0 <= int(i) < len(order):
            return f"state for parameter #{i}, but the optimizer has {len(order)}"
        name = order[int(i)]
        for key, value in st.items():
            if torch.is_tensor(value) and value.dim() > 0 \
                    and tuple(value.shape) not in _state_shapes(shape_of[name]):
                return (f"state {key!r} of parameter #{i} ({name!r}) has shape "
                        f"{list(value.shape)}, the parameter {list(shape_of[name])}")
    problem = _check_tables(state_dict.get("mpisync", {}).get("tables", {}), tables or {})
    if problem:
        return problem
    for name, value in state_dict.get("mpisync", {}).get("averages", {}).items():
        if name not in shape_of or tuple(value.shape) != shape_of[name]:
            return (f"moving average {name!r} with shape {list(value.shape)} does not match "
                    f"a parameter of the model")
    return None


def _state_shapes(shape: tuple) -> tuple[tuple, ...]:
    """The shapes a parameter's state tensors may have: its own, or one value per row
    (``mpisync.RowWiseAdagrad``'s ``sum``) for a parameter of two or more dimensions."""
    return (tuple(shape), tuple(shape[:1])) if len(shape) > 1 else (tuple(shape),)


def split_state(state: dict[str, dict], averages: dict[str, torch.Tensor], groups: list,
                global_step: int, owner: Callable[[str], int], num_ps: int) -> list[dict]:
    """One piece per ps rank: the state and averages of the parameters it owns."""
    pieces = [{"state": {}, "averages": {}, "param_groups": groups, "global_step": global_step}
              for _ in range(num_ps)]
    for name, st in state.items():
        pieces[owner(name)]["state"][name] = st
    for name, value in averages.items():
        pieces[owner(name)]["averages"][name] = value
    return pieces


def _is_rows(value, rows: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows


def merge_units(by_unit: dict, parts: dict[str, tuple[str, int, int]]) -> dict:
    """Per-unit values (tensors, or state dicts of tensors) joined per parameter.

    A partitioned parameter's shards are concatenated along axis 0 in row order; a state
    entry that is not row-shaped (Adam's ``step``) is taken from the first shard.
    """
    out, split = {}, {}
    for unit, value in by_unit.items():
        name, start, _ = parts.get(unit, (unit, 0, 0))
        if unit == name:
            out[name] = value
        else:
            split.setdefault(name, []).append((start, unit, value))
    for name, pieces in split.items():
        pieces.sort(key=lambda piece: piece[0])
        values = [v for _, _, v in pieces]
        rows = [parts[u][2] - parts[u][1] for _, u, _ in pieces]
        if torch.is_tensor(values[0]):
            out[name] = torch.cat(values)
            continue
        out[name] = {k: torch.cat([v[k] for v in values]) if _is_rows(x, rows[0]) else x
                     for k, x in values[0].items()}
    return out


def _copy(value):
    """Each shard its own copy (Adam's ``step`` tensor is incremented in place per shard)."""
    return value.clone() if torch.is_tensor(value) else value


def split_units(by_name: dict, parts: dict[str, tuple[str, int, int]]) -> dict:
    """The inverse of ``merge_units``: a partitioned parameter's values cut into its shards."""
    units_of: dict[str, list[tuple[str, int, int]]] = {}
    for unit, (name, start, stop) in parts.items():
        if unit != name:
            units_of.setdefault(name, []).append((unit, start, stop))
    out = {}
    for name, value in by_name.items():
        if name not in units_of:
            out[name] = value
            continue
        total = max(stop for _, _, stop in units_of[name])
        for unit, start, stop in units_of[name]:
            if torch.is_tensor(value):
                out[unit] = value[start:stop].clone()
            else:
                out[unit] = {k: x[start:stop].clone() if _is_rows(x, total) else _copy(x)
                             for k, x in value.items()}
    return out
