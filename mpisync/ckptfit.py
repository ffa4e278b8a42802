"""Whether a checkpoint fits a model and its ``SyncReplicasOptimizer``: the tables, the
model's entries and shapes, the optimizer's state (what ``mpisync.load`` checks before it
changes anything)."""
from __future__ import annotations

import torch

from .protocol.state import check_state
from .protocol.tables import table_info
from .tables import reshard
from .tables.hashtables import check_saved_hash_table

__all__ = ["fits", "unread"]


def _model(ck: dict, model: torch.nn.Module) -> str | None:
    mine = model.state_dict()
    saved = ck["model"]
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    if missing or unexpected:
        return (f"the model does not match the checkpoint's: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}")
    for k, v in mine.items():
        if tuple(v.shape) != tuple(saved[k].shape):
            return (f"the model does not match the checkpoint's: {k!r} has shape "
                    f"{list(v.shape)}, the checkpoint's {list(saved[k].shape)}")
    return None


def _tables(ck: dict, opt) -> str | None:
    mine = {t.name: t for t in opt.spec.tables if t.resident}
    saved = ck.get("tables", {})
    if set(mine) != set(saved):
        return f"the checkpoint has tables {sorted(saved)}, this optimizer {sorted(mine)}"
    for name, t in mine.items():
        s = saved[name]
        if (s["strategy"] == "hash") != (t.hashed is not None):
            return (f"table {name!r} was saved as a {s['strategy']!r} table, this one is a "
                    f"{t.strategy!r} table")
        if t.hashed is not None:
            problem = check_saved_hash_table(s, t)
            if problem:
                return problem
            continue                      # any number of rows, re-hashed on load
        problem = reshard.check_table(s, t, unread(opt, t.name))
        if problem:
            return problem
    return None


def unread(opt, name: str) -> tuple[str, ...]:
    """The state entries of table ``name`` its optimizer's update does not read."""
    for group in opt.wrapped.param_groups:
        for p in group["params"]:
            info = table_info(p)
            if info is not None and info.name == name:
                return reshard.unread_counters(opt.wrapped, group)
    return ()


def fits(ck: dict, model, opt) -> str | None:
    """Why the checkpoint ``ck`` cannot be loaded into ``model`` and ``opt`` (its tables,
    the model's entries and shapes, the optimizer's state), or None."""
    problem = _tables(ck, opt) or _model(ck, model)   # a table by name
    if problem:
        return problem
    order = opt.group_order()
    shapes = {n: tuple(p.shape) for n, p in opt.named_parameters()}
    return check_state(ck["optimizer"], opt.param_groups, order, shapes, {})
