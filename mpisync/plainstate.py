"""A checkpoint read back in one process: the state for a plain model and torch optimizer."""
from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from . import ckptchain, ckptfile

__all__ = ["plain_state"]


def _tables_whole(tables: dict) -> Iterator[tuple[str, torch.Tensor, dict]]:
    for name, t in tables.items():
        if t["strategy"] == "hash":
            continue                      # rows by id, no dense form
        shards = t["shards"]
        num_rows = t["num_rows"]
        dtype = getattr(torch, t["dtype"])
        weight = torch.empty(num_rows, *t["row_shape"], dtype=dtype)
        state: dict = {}
        for sh in shards:
            weight[sh["ids"]] = sh["weight"].to(dtype)
            for key, value in (sh.get("state") or {}).items():
                if torch.is_tensor(value) and value.dim() and len(value) == len(sh["ids"]):
                    if key not in state:
                        state[key] = torch.zeros(num_rows, *value.shape[1:], dtype=value.dtype)
                    state[key][sh["ids"]] = value
                elif key not in state:
                    state[key] = value
        yield name, weight, state


def plain_state(path: str | os.PathLike, model: torch.nn.Module | None = None
                ) -> tuple[dict, dict]:
    """``(model_state, optimizer_state)`` for a one-process model and torch optimizer.

    The recipe to continue a distributed run in one process, with ``nn.Embedding`` in
    place of ``mpisync.Embedding`` (the tables are assembled whole here)::

        model_state, opt_state = mpisync.plain_state(path)
        model.load_state_dict(model_state)
        optimizer.load_state_dict(opt_state)   # the same param groups as in the job

    The table's optimizer state goes to the table's place in the param groups, which
    the job's optimizer numbered as here. ``model`` is not needed; it is accepted so
    that a call can name it. An incremental checkpoint is read with its chain of bases
    (from the same directory), merged one shard at a time.

    Raises:
        FileNotFoundError, ValueError: the file or a base of its chain is missing or not
            a complete checkpoint (the message names it).
    """
    ck = ckptfile.read(os.fspath(path))
    files = ckptchain.chain(os.fspath(path), ck)
    ck = dict(ck, tables=ckptchain.merged_tables(files)) if len(files) > 1 else ck
    model_state = {k: v.clone() for k, v in ck["model"].items()}
    opt_state = dict(ck["optimizer"])
    opt_state["state"] = {int(k): v for k, v in opt_state["state"].items()}
    table_index = ck.get("table_index", {})
    for name, weight, state in _tables_whole(ck.get("tables", {})):
        model_state[name] = weight
        if name in table_index and state:
            opt_state["state"][table_index[name]] = state
    opt_state.pop("mpisync", None)
    return model_state, opt_state
