"""Functions applied where a parameter lives, after every applied step (``opt.update``).

A function registered with ``opt.update(name_or_glob, fn)`` reaches each ps rank pickled,
by reference (a module-level function, or a ``functools.partial`` or instance of a
module-level class holding plain data), and runs there after the optimizer's step and the
table rows' update, before the moving averages: what ``optimizer.step(); fn(p)`` does in
one process. It gets what its rank holds, in place:

- a parameter whole on one ps (or kept by the workers with ``dense="allreduce"``, where
  every worker runs it after its own step): the whole tensor;
- a partitioned parameter: each shard (a range of rows) on its own;
- an embedding table (``mpisync.Embedding``, ``HashEmbedding``: its slots, empty ones
  zero; a sparse ``nn.Embedding``'s weight): each shard's rows, or with
  ``rows="touched"`` only the rows the step changed, gathered into a ``(k, ...)`` tensor
  and written back (after one first pass over every row).

So a function that works row by row (max-norm, non-negativity, clipping) is exact on
shards; one that looks at the whole tensor at once (a global norm) sees each shard
alone. ``rows="touched"`` is exact for row-wise constraints that leave a row that already
satisfies them unchanged (idempotent), at a cost that follows the rows a step touches
instead of the table's size. ``fn`` may change its argument in place (and return None
or it) or return a new tensor of the same shape, which is copied in.
"""
from __future__ import annotations

import fnmatch
import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError

__all__ = ["ROWS", "Registration", "Target", "Updates", "apply_fn", "check_fn", "problem",
           "ps_pieces", "register", "targets_of"]

#: Which rows of a table shard ``fn`` gets: all of them, or those the step changed.
ROWS = ("all", "touched")


@dataclass(frozen=True)
class Target:
    """What ``fn`` runs on for one parameter: a unit on a ps, or the workers' tensor."""

    unit: str                     # unit name on its ps (the parameter's name for the workers')
    tensor: str                   # the parameter's name
    ps: int | None                # None: the workers update it (dense="allreduce")
    shape: tuple[int, ...]        # what fn sees (a table shard: all its rows)
    dtype: torch.dtype
    table: bool = False           # a table's shard: rows= applies


@dataclass(frozen=True)
class Registration:
    """One ``opt.update`` call, checked: its pattern, function and what it matched."""

    pattern: str
    fn: Callable
    data: bytes                   # fn pickled: what the ps ranks load
    rows: str
    targets: tuple[Target, ...]

    def describe(self) -> str:
        """What every worker must have registered alike."""
        digest = hashlib.sha256(self.data).hexdigest()[:12]
        return f"{self.pattern!r} -> {_name(self.fn)} (pickled {digest}), rows={self.rows!r}"


def _name(fn) -> str:
    """How messages name a function (a partial by the function it wraps)."""
    inner = getattr(fn, "func", None)
    if inner is not None:
        return f"partial({_name(inner)})"
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def register(registrations: list[Registration], pattern: str, fn, rows: str,
             targets: dict[str, list[Target]], frozen: list[str]) -> list[Registration]:
    """The registrations after ``opt.update(pattern, fn, rows)``: ``fn`` checked (it
    pickles, and runs on a stand-in of what it gets) and appended, or with ``fn=None``
    those of ``pattern`` removed. Raises ConfigError naming what is wrong."""
    if fn is None:
        kept = [r for r in registrations if r.pattern != pattern]
        if len(kept) == len(registrations):
            raise ConfigError(f"nothing is registered for {pattern!r} (registered: "
                              f"{[r.pattern for r in registrations]})")
        return kept
    if rows not in ROWS:
        raise ConfigError(f"rows must be one of {ROWS}, got {rows!r}")
    data = check_fn(fn)
    matched = match(pattern, targets, frozen)
    for tensor in dict.fromkeys(t.tensor for t in matched):
        dry_run(fn, next(t for t in matched if t.tensor == tensor))
    return [*registrations, Registration(pattern, fn, data, rows, tuple(matched))]


def targets_of(spec, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
               ) -> dict[str, list[Target]]:
    """Every parameter an optimizer updates, in model order, with the targets ``fn`` gets.

    ``shapes`` gives each parameter's shape and dtype (for those the workers keep).
    """
    out: dict[str, list[Target]] = {n: [] for n in shapes}
    for unit, (name, _, _), shape, dtype, owner in zip(spec.names, spec.parts, spec.shapes,
                                                         spec.dtypes, spec.owners):
        out[name].append(Target(unit, name, owner, tuple(shape), dtype))
    for t in spec.tables:
        out[t.name] = [Target(t.unit(k), t.name, t.owners[k], (rows, *t.row_shape), t.dtype,
                              True) for k, rows in enumerate(t.shard_rows)]
    for name in spec.allreduce:
        shape, dtype = shapes[name]
        out[name].append(Target(name, name, None, tuple(shape), dtype))
    return {n: ts for n, ts in out.items() if ts}


def check_fn(fn) -> bytes:
    """``fn`` pickled, after checking that a ps rank can load it; ConfigError naming why not."""
    if not callable(fn):
        raise ConfigError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
    name = _name(fn)
    if getattr(fn, "__name__", "") == "<lambda>":
        raise ConfigError("fn is a lambda, which cannot reach the ps ranks; define a function "
                          "at module level (functools.partial adds arguments)")
    if "<locals>" in name:
        raise ConfigError(f"fn {name} is defined inside a function, so the ps ranks cannot "
                          f"import it; define it at module level (functools.partial adds "
                          f"arguments)")
    try:
        data = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - whatever pickle raises, the message names it
        raise ConfigError(f"fn {name} cannot be sent to the ps ranks ({type(exc).__name__}: "
                          f"{exc}); use a module-level function, or a functools.partial or "
                          f"instance of a module-level class holding plain data") from None
    return data


def match(pattern: str, targets: dict[str, list[Target]], frozen: list[str]) -> list[Target]:
    """The targets of every parameter ``pattern`` (a name or a glob) names, in model order."""
    if not isinstance(pattern, str):
        raise ConfigError(f"name_or_glob must be a str, got {type(pattern).__name__}")
    names = [n for n in targets if fnmatch.fnmatchcase(n, pattern)]
    if not names:
        if pattern in frozen:
            raise ConfigError(f"parameter {pattern!r} is in no param group of the optimizer: "
                              f"it is never updated, so nothing runs after its steps")
        raise ConfigError(f"{pattern!r} names none of the optimizer's parameters "
                          f"({', '.join(list(targets)[:8])}{', ...' if len(targets) > 8 else ''})")
    return [t for n in names for t in targets[n]]


def dry_run(fn, target: Target) -> None:
    """Run ``fn`` on a stand-in of what it gets (zeros; two rows of a table's shard)."""
    shape = target.shape
    if target.table or (target.ps is not None and shape and target.unit != target.tensor):
        shape = (min(2, shape[0]), *shape[1:])
    stand_in = torch.zeros(shape, dtype=target.dtype)
    try:
        apply_fn(fn, stand_in, target.unit)
    except Exception as exc:  # noqa: BLE001 - reported on every worker, naming fn
        raise ConfigError(f"fn raised {type(exc).__name__}: {exc} on a stand-in of "
                          f"{target.unit!r} (zeros of shape {list(shape)}, {target.dtype})"
                          ) from None


def apply_fn(fn, t: torch.Tensor, what: str) -> None:
    """``fn(t)``: in place, or its result (a tensor of ``t``'s shape) copied into ``t``."""
    with torch.no_grad():
        out = fn(t)
        if out is None or out is t:
            return
        if not torch.is_tensor(out) or tuple(out.shape) != tuple(t.shape):
            got = list(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ValueError(f"fn returned {got} for {what!r} of shape {list(t.shape)}; return "
                             f"None (after changing it in place) or a tensor of its shape")
        t.copy_(out)


def ps_pieces(registrations: list[Registration], num_ps: int) -> list[list[tuple]]:
    """For each ps: ``(fn pickled, rows, units)`` of each registration with units there."""
    pieces: list[list[tuple]] = [[] for _ in range(num_ps)]
    for reg in registrations:
        for j in range(num_ps):
            units = [t.unit for t in reg.targets if t.ps == j]
            if units:
                pieces[j].append((reg.data, reg.rows, units))
    return pieces


def problem(pieces: list[list[tuple]]) -> str | None:
    """Why a ps rank cannot load the registered functions, or None (run on ps 0)."""
    for piece in pieces:
        for data, _, _ in piece:
            try:
                pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - any failure: the workers are told
                return (f"the ps ranks cannot load a function given to opt.update(): "
                        f"{type(exc).__name__}: {exc}. Define it where every rank runs it (at "
                        f"module level, not only in the workers' branch)")
    return None


class Updates:
    """The registered functions of one ps rank's units, run after each applied step."""

    def __init__(self) -> None:
        self.items: list[list] = []    # [fn, rows, [(unit, tensor, table unit index)], fresh]

    def set(self, piece: list[tuple], tensors: dict[str, tuple[torch.Tensor, int | None]]
            ) -> None:
        """Replace the registrations with ``piece`` (from ``ps_pieces``); ``tensors`` maps
        each unit held here to its tensor and, for a table shard, its index among them."""
        self.items = [[pickle.loads(data), rows, [(u, *tensors[u]) for u in units], True]
                      for data, rows, units in piece]

    def refresh(self) -> None:
        """After a load (or a table written): the next run gives every row to each function,
        ``rows="touched"`` included, as after its registration."""
        for item in self.items:
            item[3] = True

    def run(self, table_rows=None, step: int | None = None) -> None:
        """Every function over its tensors; ``table_rows`` (the ps's ``RowShards``) gives
        the rows a step touched and takes the rows a function changed.

        Raises:
            RuntimeError: a function raised; the message names it, the tensor and the step.
        """
        if self.items and table_rows is not None:
            table_rows.settle()          # the step's row updates, made after its notice
        for item in self.items:
            fn, rows, targets, fresh = item
            for unit, t, n in targets:
                try:
                    if n is None:
                        apply_fn(fn, t, unit)
                    else:
                        _run_on_shard(fn, unit, t, n, rows == "touched" and not fresh,
                                      table_rows)
                except Exception as exc:
                    after = "" if step is None else f" after global step {step}"
                    raise RuntimeError(f"the function {_name(fn)} given to opt.update() failed "
                                       f"on {unit!r}{after}: {type(exc).__name__}: {exc}"
                                       ) from exc
            item[3] = False


def _run_on_shard(fn, unit: str, t: torch.Tensor, n: int, touched: bool, table_rows) -> None:
    """``fn`` over one table shard: all its rows, or those the step touched."""
    ids = table_rows.touched(n) if touched else True
    if ids is None:
        return
    table_rows.before_update(n, ids)
    if ids is True:
        held = not table_rows.units[n].spec.resident      # the workers hold a copy
        before = t.clone() if held else None
        apply_fn(fn, t, unit)
        if held:
            changed = (t != before).reshape(len(t), -1).any(1).nonzero().reshape(-1)
            table_rows.changed_by_update(n, changed)
        else:                           # a shard on the ps only: its checkpoint marks
            table_rows.changed_by_update(n, True)
        return
    rows = t[ids]
    apply_fn(fn, rows, unit)
    t[ids] = rows
