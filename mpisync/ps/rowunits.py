"""One ps rank's table shards one at a time: what a shard holds here (``Unit``), its row
update waiting for the next settle (``Pending``), and what decides how its optimizer
steps it."""
from __future__ import annotations

import numpy as np
import torch

from ..native import kernels, plankernels
from ..native.plankernels import Plan
from ..protocol.multi import inner_of
from ..protocol.tables import TableSpec
from ..tables.rowopt import RowScratch
from ..tables.rowwise import RowWiseAdagrad
from .changes import Marks
from .hashrows import HashRows

__all__ = ["Pending", "Unit", "frozen", "place", "takes_sparse", "without_zeros"]


def takes_sparse(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether the optimizer, with this group's hyper-parameters, updates only gradient rows.

    Then the ps hands it a sparse gradient and only those rows change: SGD without
    momentum and weight decay, Adagrad without weight decay, SparseAdam,
    ``mpisync.RowWiseAdagrad``. Any other optimizer gets the dense gradient of the shard
    and updates every row, as it would the weight of a dense ``nn.Embedding``. Where
    ``optimizer`` joins several, the one that holds ``group`` decides.
    """
    optimizer = inner_of(optimizer, group)
    if isinstance(optimizer, (torch.optim.SparseAdam, RowWiseAdagrad)):
        return True
    if isinstance(optimizer, torch.optim.Adagrad):
        return not group.get("weight_decay")
    if isinstance(optimizer, torch.optim.SGD):
        return not group.get("momentum") and not group.get("weight_decay")
    return False


class Unit:
    """One table shard held here."""

    __slots__ = ("hashed", "k", "marks", "param", "scratch", "spec", "unit")

    def __init__(self, spec: TableSpec, k: int, param: torch.nn.Parameter, label: str = ""):
        self.spec, self.k, self.param = spec, k, param
        self.unit = spec.unit(k)
        self.hashed = None if spec.hashed is None else HashRows(spec, k, param, label)
        self.scratch = RowScratch()      # its reduced rows, kept until they are applied
        # the rows changed since the last incremental checkpoint read them (resident only;
        # a hash shard's: its slots, kept by its HashRows)
        self.marks = self.hashed.marks if self.hashed is not None else \
            Marks(spec.shard_rows[k]) if spec.resident else None


def without_zeros(ids: torch.Tensor, values: torch.Tensor, zeros: list[np.ndarray]) -> tuple:
    """A hash shard's pushed rows less those of ``zeros`` (ids it read as zeros)."""
    keep = torch.from_numpy(~np.isin(ids.numpy(), np.concatenate(zeros)))
    return ids[keep], values[keep], None


def frozen(group: dict) -> dict:
    """The hyper-parameters of a param group as they are now (tensors copied: the next
    step's values are written into them in place)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in group.items()}


class Pending:
    """A shard's row update that waits for ``RowShards.settle``: its gradient as the
    taken pieces (summed by ``sum()``) or as rows already summed, divided by ``div``."""

    __slots__ = ("div", "group", "ids", "pieces", "rows", "unit")

    def __init__(self, group: dict, unit: Unit, pieces: list | None, ids=None, rows=None,
                 div: float = 0):
        self.group, self.unit, self.pieces = group, unit, pieces
        self.ids, self.rows, self.div = ids, rows, div

    def sum(self) -> tuple[torch.Tensor, torch.Tensor | Plan]:
        """(ids, their gradient): the pieces planned once (``plankernels.plan``: ids in
        first-seen order, scratch until the next step) into a ``Plan`` that the row update
        reads in one pass, or the rows already summed."""
        if self.pieces is None:
            return self.ids, self.rows
        u, pieces = self.unit, []
        for ids, rows, bag in self.pieces:
            if len(ids):
                pieces.append((ids, None, None, rows))
            if bag is not None:
                part, grads = bag
                pieces.append((part.ids, part.bag, part.weights, grads))
        plan = plankernels.plan(pieces, u.scratch.plan_marks(u.param.shape[0]), u.scratch,
                                u.spec.row_shape)
        self.ids, self.rows, self.pieces = plan.ids, plan, None
        return self.ids, self.rows


def place(state: dict, shape: torch.Size) -> bool:
    """``state``'s tensors of a shard's ``shape`` copied into ``table_zeros``' memory (the
    old ones freed on return); whether there were any."""
    keys = [k for k, v in state.items() if torch.is_tensor(v) and v.shape == shape]
    for key in keys:
        state[key] = kernels.table_copy(state[key])
    return bool(keys)
