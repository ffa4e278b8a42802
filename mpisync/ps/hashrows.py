"""One hash-table shard on a ps rank: ids to slots, admission, eviction, its optimizer state.

The shard's rows are a dense parameter of ``capacity`` slots that the wrapped optimizer
steps like any table shard; this module keeps the id -> slot map beside it
(``hashing.SlotMap``), turns the ids of lookups and row gradients into slots, writes the
initial rows of admitted ids and resets the optimizer state of their slots.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ProtocolError
from ..native import torchstep
from ..protocol import hashing
from ..protocol.multi import inner_of
from ..protocol.tables import TableSpec
from .changes import Marks, state_of

__all__ = ["HashRows", "fresh_state"]


def fresh_state(optimizer: torch.optim.Optimizer, group: dict, row_shape: tuple[int, ...],
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The optimizer state one new row gets: ``{key: row}`` for state of the row's shape.

    Found by stepping a fresh optimizer of the same class and hyper-parameters once over
    a one-row parameter of zeros with a zero gradient (what the slots hold before any
    gradient: Adagrad's ``initial_accumulator_value``, zeros for moments and buffers).
    """
    cls = type(inner_of(optimizer, group))
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in group.items() if k != "params" and k in accepted}
    probe = torch.nn.Parameter(torch.zeros(1, *row_shape, dtype=dtype))
    try:
        opt = cls([probe], **kwargs)
        grad = torch.zeros_like(probe)
        probe.grad = grad.to_sparse() if isinstance(opt, torch.optim.SparseAdam) else grad
        torchstep.step(opt)
    except (TypeError, ValueError, RuntimeError):
        return {}                  # an optimizer that cannot be probed: zeros are used
    return {k: v[0].clone() for k, v in opt.state[probe].items() if _per_row(v, probe)}


class HashRows:
    """Shard ``k`` of a hash table on this ps rank: its slot map beside its parameter.

    Lookups (``lookup``) are sightings unless they peek; admitted slots get their initial
    rows at once and their optimizer state reset before the optimizer next reads it
    (``settle``). Row gradients arrive with ids and become slot gradients when their step
    is applied (``to_slots``): a row evicted in between loses its part of that step.
    """

    def __init__(self, spec: TableSpec, k: int, param: torch.nn.Parameter, label: str):
        self.spec, self.k, self.param, self.label = spec, k, param, label
        h = spec.hashed
        self.slots = hashing.SlotMap(h.capacity, h.eviction, h.admit_after)
        self.fresh: list[np.ndarray] = []       # slots admitted since the last settle
        self._fresh_rows: dict | None = None
        # incremental checkpoints: the slots whose row, state or counts changed since the
        # last read_changed (lookups, steps, opt.update), and the ids and state entries that
        # read held (None: none yet, the next is whole)
        self.marks = Marks(len(param))
        self.read_ids: np.ndarray | None = None
        self.read_keys: tuple[str, ...] | None = None
        # a checkpoint's snapshot not read yet: keeps slots' rows before they change
        self.keep: Callable[[torch.Tensor | bool], None] | None = None

    def _check(self, ids: torch.Tensor, what: str) -> np.ndarray:
        a = ids.numpy()
        if len(a) > 1 and not (a[1:] > a[:-1]).all():
            raise ProtocolError(f"{self.label}: {what} of shard {self.spec.unit(self.k)} with "
                                f"ids not sorted and unique")
        if len(a) and (hashing.shard_of(ids, self.spec.num_shards) != self.k).any():
            raise ProtocolError(f"{self.label}: {what} of shard {self.spec.unit(self.k)} with "
                                f"ids of another shard")
        return a

    def lookup(self, ids: torch.Tensor, peek: bool) -> tuple[torch.Tensor, np.ndarray]:
        """The rows of ``ids`` (sorted, unique), zeros for ids without a row; and those ids
        (their gradients from this lookup are dropped, even if another worker's lookup
        admits them before the step)."""
        a = self._check(ids, "a lookup")
        if peek:
            slots = self.slots.peek(a)
        else:
            try:
                slots, new = self.slots.see(a)
            except ValueError as exc:
                raise ProtocolError(f"{self.label}: shard {self.spec.unit(self.k)}: {exc}"
                                    ) from None
            if len(new):
                admitted = self.slots.slot_id[new]
                if self.keep is not None:
                    self.keep(torch.from_numpy(new))
                with torch.no_grad():
                    self.param[torch.from_numpy(new)] = hashing.initial_rows(
                        admitted, self.spec.row_shape[0], self.spec.seed, self.spec.dtype,
                        self.spec.hashed.init_std)
                self.fresh.append(new)
            self.marks.mark(torch.from_numpy(slots[slots >= 0]))     # counts, recency
        out = torch.zeros(len(a), *self.spec.row_shape, dtype=self.spec.dtype)
        hit = torch.from_numpy(slots >= 0)
        out[hit] = self.param.detach()[torch.from_numpy(slots[slots >= 0])]
        return out, a[slots < 0]

    def to_slots(self, part: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, gradient rows) -> (slots, gradient rows) of the ids that have a row."""
        ids, rows = part
        if not len(ids):
            return part
        slots = torch.from_numpy(self.slots.peek(ids.numpy()))
        keep = slots >= 0
        if bool(keep.all()):
            return slots, rows
        return slots[keep], rows[keep]

    def settle(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Reset the optimizer state of the slots admitted since the last call."""
        if not self.fresh:
            return
        new = torch.from_numpy(np.concatenate(self.fresh))
        self.fresh = []
        state = optimizer.state.get(self.param) if optimizer is not None else None
        if not state:
            return                 # created on the optimizer's first step, fresh for all
        fresh = self._fresh(optimizer)
        if self.keep is not None:
            self.keep(new)
        with torch.no_grad():
            for key, value in state.items():
                if _per_row(value, self.param):
                    if key in fresh:
                        value[new] = fresh[key].to(value.dtype)
                    else:
                        value[new] = 0

    def _fresh(self, optimizer) -> dict:
        if self._fresh_rows is None:
            group = next(g for g in optimizer.param_groups
                         if any(p is self.param for p in g["params"]))
            self._fresh_rows = fresh_state(optimizer, group, self.spec.row_shape,
                                           self.spec.dtype)
        return self._fresh_rows

    # -- whole shards (checkpoints) ---------------------------------------------------------
    def read(self, optimizer, with_state: bool) -> dict:
        """The rows held, by id: ids, weight, optimizer state rows and the counts."""
        return self.rows_of(self.plan(optimizer, with_state, None), self.param,
                            state_of(optimizer, self.param), with_state)

    def read_changed(self, optimizer, with_state: bool, whole: bool) -> dict:
        """The rows changed since the last call (every row held with ``whole``, the first
        time, or where the optimizer's state entries are not those of the last call), and
        forget them: ``read()``'s entries for those ids, ``removed`` (the ids held at the
        last call and no longer: evicted) and ``per_row`` (the names of the per-row state
        entries); None for ``removed`` where every row is given."""
        return self.rows_of(self.plan(optimizer, with_state, not whole), self.param,
                            state_of(optimizer, self.param), with_state)

    def plan(self, optimizer, with_state: bool, changed: bool | None) -> dict:
        """Which rows a read gives, decided now (``changed`` None: ``read()``'s, else
        ``read_changed(whole=not changed)``'s, whose marks it clears): the ids held, their
        slots and counts, the rows picked of them, ``removed`` and ``per_row``."""
        self.settle(optimizer)
        got = self.slots.export()
        got["clock"] = self.slots.clock
        if changed is None:
            return {"got": got, "pick": slice(None)}
        state = state_of(optimizer, self.param)
        keys = tuple(state)
        if not changed or self.read_ids is None or (with_state and keys != self.read_keys):
            pick, removed = slice(None), None
        else:
            pick = torch.from_numpy(self.marks.changed.numpy()[got["slots"]])
            removed = torch.from_numpy(np.setdiff1d(self.read_ids, got["ids"],
                                                    assume_unique=True))
        if with_state:
            self.read_keys = keys
        self.read_ids = got["ids"]
        self.marks.clear()
        return {"got": got, "pick": pick, "removed": removed,
                "per_row": [k for k, v in state.items() if _per_row(v, self.param)]}

    def rows_of(self, plan: dict, weight: torch.Tensor, state: dict, with_state: bool,
                picked: bool = False) -> dict:
        """The rows ``plan`` picked, their values taken from ``weight`` and ``state`` (the
        shard's, by slot; with ``picked``, those rows already, in the plan's order: a
        snapshot's): ids, weight, counts, optimizer state (``with_state``); the
        candidates whole; and ``plan``'s ``removed`` and ``per_row`` where it has them."""
        got, pick = plan["got"], plan["pick"]
        slots = torch.from_numpy(got["slots"])[pick]
        if picked:                      # the snapshot's own copies, given once
            weight = weight.detach()
        else:
            weight = weight.detach()[slots]
            state = {k: (v[slots].clone() if _per_row(v, self.param) else
                         v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
        out = {"ids": torch.from_numpy(got["ids"])[pick], "weight": weight,
               "counters": {"count": torch.from_numpy(got["count"])[pick],
                            "last": torch.from_numpy(got["last"])[pick],
                            "clock": got["clock"]},
               "candidates": _candidates(got)}     # whole (none with admit_after=1)
        if with_state:
            out["state"] = state
        if "removed" in plan:
            out["removed"], out["per_row"] = plan["removed"], plan["per_row"]
        return out

    def write(self, saved: dict, optimizer) -> None:
        """Hold exactly the saved rows (ids, weight, state, counters) of this shard."""
        if self.keep is not None:
            self.keep(True)
        ids = saved["ids"].to(torch.int64)
        if len(ids) and (hashing.shard_of(ids, self.spec.num_shards) != self.k).any():
            raise ValueError(f"{self.label}: rows given to hash shard {self.spec.unit(self.k)} "
                             f"whose ids hash to another shard")
        counters = saved.get("counters") or {}
        n = len(ids)
        count = counters.get("count", torch.full((n,), self.spec.hashed.admit_after))
        last = counters.get("last", torch.zeros(n, dtype=torch.int64))
        cand = saved.get("candidates")
        if cand is not None and len(cand["ids"]) and \
                (hashing.shard_of(cand["ids"], self.spec.num_shards) != self.k).any():
            raise ValueError(f"{self.label}: candidates given to hash shard "
                             f"{self.spec.unit(self.k)} whose ids hash to another shard")
        slots = torch.from_numpy(self.slots.reload(
            ids.numpy(), np.asarray(count), np.asarray(last), int(counters.get("clock", 0)),
            None if cand is None else (np.asarray(cand["ids"]), np.asarray(cand["count"]),
                                       np.asarray(cand["last"]))))
        self.fresh = []
        self.read_ids = None                     # the next incremental read is whole
        with torch.no_grad():
            self.param.zero_()
            self.param[slots] = saved["weight"].to(self.spec.dtype)
        if optimizer is None or saved.get("state") is None:
            return
        state = optimizer.state[self.param]
        state.clear()
        fresh = self._fresh(optimizer) if saved["state"] else {}
        for key, value in saved["state"].items():
            if torch.is_tensor(value) and value.dim() and len(value) == n and \
                    tuple(value.shape[1:]) in (tuple(self.spec.row_shape), ()):
                full = torch.zeros(len(self.param), *value.shape[1:], dtype=value.dtype)
                if key in fresh:
                    full[:] = fresh[key].to(value.dtype)
                full[slots] = value
                state[key] = full
            else:
                state[key] = value.clone() if torch.is_tensor(value) else value

    def stats(self) -> dict[str, int]:
        return self.slots.stats()


def _candidates(got: dict) -> dict[str, torch.Tensor]:
    """The ids seen, not admitted yet, of a ``SlotMap.export``: ids, sightings, last seen."""
    return {"ids": torch.from_numpy(got["cand_ids"]),
            "count": torch.from_numpy(got["cand_count"]),
            "last": torch.from_numpy(got["cand_last"])}


def _per_row(value, param: torch.Tensor) -> bool:
    """State of each row: the parameter's shape, or one value a row (``RowWiseAdagrad``)."""
    return torch.is_tensor(value) and tuple(value.shape) in (tuple(param.shape),
                                                              tuple(param.shape[:1]))
