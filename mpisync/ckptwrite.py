"""Writing one checkpoint on the chief: the dense state taken at the step, the tables read
from the ps ranks' snapshot, and the file written while training goes on.

``begin()`` runs while every worker waits between steps: it reads the dense state (the
model, the optimizer state, the schedulers) and asks each ps rank for a snapshot of its
table shards at this step (``mpisync.ps.snapshot``), which costs the ps ranks no copy of
a table. The file itself (the table shards, read from the snapshots one at a time, then
the dense state) is written by ``Writing.run()``: at once for ``mpisync.save``, or on a
thread beside training for a ``Checkpointer``, so that the other workers never wait for
a table's write. A failed write leaves no file (``ckptfile.atomic_write``) and drops what
the ps ranks kept.
"""
from __future__ import annotations

import copy
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import ckptchain, ckptfile, resumestate
from .ckptfile import FORMAT, VERSION

if TYPE_CHECKING:
    from .optimizer import SyncReplicasOptimizer

__all__ = ["Writing", "begin"]


def _tables_streamed(opt, w: ckptfile.Writer, changed: bool | None) -> dict:
    """Every ``mpisync.Embedding`` table, shard by shard as the snapshot kept it, each
    written as it arrives: whole, or (``changed``) the rows changed since the last file."""
    out = {}
    for t in opt.spec.tables:
        if not t.resident:
            continue
        shards = []
        for shard in opt._parts.tables.read_snapshot(t.name):
            if changed and t.hashed is None:
                shards.append(ckptchain.changed_shard(shard, w.tensor))
                del shard
                continue
            shards.append({"ids": w.tensor(shard["ids"]), "weight": w.tensor(shard["weight"]),
                           "state": {k: w.tensor(v) if torch.is_tensor(v) else v
                                     for k, v in (shard.get("state") or {}).items()}})
            if "counters" in shard:       # a hash shard: its rows' sighting counts, recency
                shards[-1]["counters"] = {k: w.tensor(v) if torch.is_tensor(v) else v
                                          for k, v in shard["counters"].items()}
                # and the ids seen but not admitted yet (admit_after above 1), whole
                shards[-1]["candidates"] = {k: w.tensor(v)
                                            for k, v in shard["candidates"].items()}
            if changed:     # a hash shard's changed rows: and the ids evicted (None: whole)
                removed = shard["removed"]
                shards[-1]["removed"] = None if removed is None else w.tensor(removed)
                shards[-1]["per_row"] = list(shard["per_row"])
            del shard                     # one shard in memory at a time
        out[t.name] = {"num_rows": t.num_rows, "row_shape": list(t.row_shape),
                       "dtype": str(t.dtype).removeprefix("torch."), "strategy": t.strategy,
                       "shards": shards}
        if changed:
            out[t.name]["incremental"] = True
    return out


def _model_state(model: torch.nn.Module, values: dict) -> dict:
    """``model.state_dict()`` with the ps ranks' parameter values of the saved step."""
    state = model.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    key_of = {}
    for key, v in model.state_dict(keep_vars=True).items():
        if id(v) in names:
            key_of[names[id(v)]] = key
    for name, value in values.items():
        found = key_of.get(name)
        if found is not None and tuple(state[found].shape) == tuple(value.shape):
            state[found] = value
    return state


class Writing:
    """One checkpoint file being written by the chief (``begin()`` made it)."""

    def __init__(self, path: str, opt, dense: dict, changed: bool | None, tables: bool):
        self.path, self.opt, self.dense = path, opt, dense
        self.changed, self.tables = changed, tables
        self.error: str | None = None
        self.thread: threading.Thread | None = None
        self.owner: Any = None          # the Checkpointer that saved it
        self.then: Callable[[], object] | None = None   # after a successful write

    def run(self) -> None:
        """Write the file; a failure is kept in ``error`` (the snapshot left is dropped)."""
        try:
            ckptfile.atomic_write(self.path, self._fill)
            if self.then is not None:
                self.then()
        except Exception as exc:  # noqa: BLE001 (every worker is told, see Checkpointer)
            self.error = f"{type(exc).__name__}: {exc}"
            if self.tables:
                try:
                    self.opt._parts.tables.rows.snapshot(("snap_end",),
                                                         aside=self.thread is not None)
                except Exception:  # noqa: BLE001, S110 (the write's error is the one told)
                    pass
        finally:
            self.dense = {}

    def _fill(self, f) -> None:
        w = ckptfile.Writer(f)
        try:
            tables = _tables_streamed(self.opt, w, self.changed) if self.tables else {}
            w.finish({**self.dense, "tables": tables})
        except BaseException:
            w.abort()
            raise

    def start(self) -> None:
        """Write on a thread beside training (``wait()`` ends it)."""
        self.thread = threading.Thread(target=self.run, name=f"mpisync-save-{self.path}",
                                       daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> str | None:
        """Wait for the file; what kept it from being written (naming it), or None."""
        if self.thread is not None:
            self.thread.join()
        return self.failure

    @property
    def failure(self) -> str | None:
        """What kept the file from being written, naming it; None while written or writing."""
        return None if self.error is None else f"{self.path} could not be written: {self.error}"


def begin(path: str, model: torch.nn.Module, opt: SyncReplicasOptimizer, extra: Any,
          worker_states: list, chain: tuple | None, aside: bool) -> Writing:
    """On the chief, between steps: the dense state now and the tables' snapshot; the
    file is written by the returned ``Writing``. ``chain``: (changed, base file, base id,
    this file's id), ``changed`` as ``table_shards`` takes it. ``aside``: the file is
    written while training goes on, so what it holds is copied now."""
    changed, base, base_id, file_id = chain or (None, None, None, ckptchain.file_id())
    state, values = opt.state_and_values(tables=False)
    order = opt.group_order()
    tables = any(t.resident for t in opt.spec.tables)
    dense = {"format": FORMAT, "version": VERSION if changed else 1, "file_id": file_id,
             "base": {"file": os.path.basename(base), "id": base_id} if changed else None,
             "global_step": int(state["mpisync"]["global_step"]),
             "model": _model_state(model, values), "optimizer": state,
             "table_index": {t.name: order.index(t.name) for t in opt.spec.tables
                             if t.resident and t.name in order},
             "extra": extra, "workers": opt.cluster.num_workers, "ps": opt.cluster.num_ps,
             "time": time.time(), "mpisync_version": ckptfile.mpisync_version(),
             "schedulers": resumestate.scheduler_states(opt), "worker_states": worker_states}
    if aside:                        # the model, the schedulers, ``extra`` change next step
        pickle.dumps(extra)          # what no file can hold fails now, on every worker
        dense = copy.deepcopy(dense)
    if tables:
        opt._parts.tables.rows.snapshot(("snap_begin", changed))
    return Writing(path, opt, dense, changed, tables)
