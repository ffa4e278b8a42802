"""Row-wise Adagrad: one accumulator per row of a table (FBGEMM's EXACT_ROWWISE_ADAGRAD)."""
from __future__ import annotations

from collections.abc import Callable
from typing import overload

import numpy as np
import torch
from torch.optim.optimizer import ParamsT, _get_scalar_dtype, _to_scalar

from ..native import kernels, plankernels
from ..native.plankernels import Plan

__all__ = ["RowWiseAdagrad", "rowwise_rows"]

BLOCK_ROWS = 2048
LANES = 16            # partial sums of a row's squares (_rows.c's LANES)


class RowWiseAdagrad(torch.optim.Optimizer):
    r"""Adagrad with one accumulator per row, as FBGEMM's and TorchRec's EXACT_ROWWISE_ADAGRAD.

    For a parameter of two or more dimensions, row ``i`` (``p[i]``, all but the first
    dimension) with gradient ``g[i]`` (of ``D`` elements) is updated as::

        g[i]    <- -g[i] if maximize;  g[i] + weight_decay * p[i] if weight_decay (L2)
        sum[i]  <- sum[i] + mean(g[i] ** 2)               # = sum(g[i] ** 2) / D
        p[i]    <- p[i] - (lr / (sqrt(sum[i]) + eps)) * g[i]

    which is FBGEMM's ``rowwise_adagrad`` (``g_avg_square = sum(g * g) / D``,
    ``momentum1[idx] += g_avg_square``, ``multiplier = lr / (sqrtf(momentum1[idx]) + eps)``,
    ``w -= multiplier * g``; its L2 ``weight_decay_mode`` folds ``weight_decay * w`` into
    the gradient the same way). ``state["sum"]`` has one element per row (shape
    ``(rows,)``), a factor ``D`` less memory than ``torch.optim.Adagrad``. A
    one-dimensional parameter (a bias) gets elementwise Adagrad: ``sum`` of its shape,
    ``sum += g * g``, the same update.

    With a sparse gradient (``nn.Embedding(sparse=True)``, or the rows mpisync's ps
    ranks reduce for an ``mpisync.Embedding``) only the rows present change, weight
    decay included, as in FBGEMM; a dense gradient updates every row, and gives the same
    result as the sparse one holding the same rows when ``weight_decay`` is 0. The state
    also counts steps (``state["step"]``, a float tensor, as Adagrad's).

    Args:
        params: parameters or param groups.
        lr: learning rate (a float or a one-element tensor).
        eps: added to the square root of the accumulator.
        initial_accumulator_value: the accumulators' initial value.
        weight_decay: L2 penalty, applied to the rows updated.
        maximize: maximize the objective instead.
    """

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 0.01, eps: float = 1e-10,
                 initial_accumulator_value: float = 0.0, weight_decay: float = 0.0,
                 maximize: bool = False) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"a tensor lr must have one element, got {lr.numel()}")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value)):
            if not 0.0 <= value:
                raise ValueError(f"{name} must be at least 0, got {float(value)}")
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay,
                                  "initial_accumulator_value": initial_accumulator_value,
                                  "maximize": maximize})

    def state_of(self, p: torch.Tensor) -> dict:
        """The state of ``p``, created on first use (``step`` 0, ``sum`` the initial value)."""
        state = self.state[p]
        if len(state) == 0:
            shape = p.shape[:1] if p.dim() > 1 else p.shape
            init = self._group_of(p)["initial_accumulator_value"]
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            state["sum"] = kernels.table_zeros(shape, p.dtype).fill_(init) \
                if p.device.type == "cpu" else torch.full(shape, init, dtype=p.dtype,
                                                          device=p.device)
        return state

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("the parameter is not in this optimizer's param groups")

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter with a gradient (dense or sparse)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p) or not p.dtype.is_floating_point:
                    raise TypeError(f"RowWiseAdagrad needs real floating-point parameters, "
                                    f"got {p.dtype}")
                state = self.state_of(p)
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()
                    if grad.sparse_dim() == 1:
                        rowwise_rows(state, group, p, grad.indices()[0], grad.values())
                        continue
                    grad = grad.to_dense()
                _rowwise_dense(state, group, p, grad)
        return loss


def _row_means(g: torch.Tensor) -> torch.Tensor:
    """Per row (first dimension) the mean of ``g ** 2``, summed as the compiled kernel sums:
    ``LANES`` partial sums, lane ``j`` adding the squares of columns ``j``, ``j + LANES``,
    ... in order, then halved (``lane[j] += lane[j + h]`` for ``h`` = ``LANES / 2``, ...,
    1), lane 0 divided by the row's width (a 1-D ``g`` has rows of one element)."""
    sq = (g * g).reshape(len(g), -1)
    width = sq.shape[1]
    full = width // LANES * LANES
    lane = torch.zeros(len(g), LANES, dtype=g.dtype, device=g.device)
    for c in range(0, full, LANES):
        lane += sq[:, c:c + LANES]
    lane[:, :width - full] += sq[:, full:]
    h = LANES // 2
    while h:
        lane[:, :h] += lane[:, h:2 * h]
        h //= 2
    return lane[:, 0].div_(width)


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root (numpy's, as C's ``sqrt``; torch's vectorised one
    on CPU may differ from it in the last bit)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sqrt(t.numpy()))
    return torch.sqrt(t)


def _multiplier(total: torch.Tensor, lr, eps: float) -> torch.Tensor:
    """``-(lr / (sqrt(sum) + eps))``, in the accumulator's dtype (``lr`` rounded to it first).

    The update adds ``g * multiplier``: the negation is exact, and a sum with ``alpha`` 1
    rounds once whichever kernel does it.
    """
    std = _sqrt(total).add_(eps)
    return torch.full_like(std, float(lr)).div_(std).neg_()


def _compiled(total: torch.Tensor, param: torch.Tensor, ids, rows) -> bool:
    """Whether ``mpisync.native.kernels`` updates these rows (a tensor or a ``Plan``;
    contiguous, one float dtype)."""
    if isinstance(rows, Plan):
        rows = rows.grads
    return kernels.available(param, rows) and rows.dtype == param.dtype == total.dtype and \
        param.is_contiguous() and total.is_contiguous() and \
        (ids is None or ids.dtype == torch.int64)


def _rowwise_dense(state: dict, group: dict, param: torch.Tensor, grad: torch.Tensor) -> None:
    """Every row of ``param`` with its dense gradient."""
    _update(state, group, param, None, grad)


def rowwise_rows(state: dict, group: dict, param: torch.Tensor, ids: torch.Tensor,
                 rows, div: float = 0, scratch=None) -> None:
    """The rows ``ids`` (unique) of ``param`` with their gradient ``rows`` (divided by
    ``div`` first where it is not 0), or a ``mpisync.native.plankernels.Plan`` of them
    (updated from in one pass where the compiled kernels can; else its rows, into
    ``scratch``'s buffer).

    Bitwise what the dense step does to those rows when the others' gradient is 0
    (and ``weight_decay`` is 0); ``state`` as ``RowWiseAdagrad.state_of`` makes it.
    """
    if isinstance(rows, Plan) and (group["weight_decay"] or param.dim() == 0 or
                                   not _compiled(state["sum"], param, ids, rows)):
        rows = rows.summed(scratch)      # the planned kernel takes neither
    _update(state, group, param, ids, rows, div)


def _update(state: dict, group: dict, param: torch.Tensor, ids: torch.Tensor | None,
            rows, div: float = 0) -> None:
    """One step on the rows ``ids`` of ``param`` (None: every row) with gradient ``rows``
    (a ``Plan`` only where the compiled kernel takes it: no decay, not a scalar).

    The compiled kernel and the torch code below compute the same thing in the same
    order: ``g`` (divided, negated for maximize, with weight decay), each row's mean of
    squares in column order, the accumulator, the multiplier with the correctly rounded
    square root, ``param + g * multiplier``; the results are bitwise equal.
    """
    state["step"] += 1
    total = state["sum"]
    if param.dim() == 0:                # a scalar: one row of one element
        param, rows, total = param.view(1), rows.reshape(1), total.view(1)
    lr, eps, decay = _to_scalar(group["lr"]), group["eps"], group["weight_decay"]
    sign = -1.0 if group["maximize"] else 1.0
    if decay:
        g = torch.div(rows, div) if div else rows
        g = torch.neg(g) if group["maximize"] else g
        old = param if ids is None else param.index_select(0, ids)
        rows, div, sign = g.add(old, alpha=decay), 0, 1.0
    if isinstance(rows, Plan):
        plankernels.rowwise(rows, sign, lr, eps, total, param, div)
        return
    if _compiled(total, param, ids, rows):
        kernels.rowwise_rows(ids, rows, sign, lr, eps, total, param, div)
        return
    blocks = [(None, rows)] if ids is None else \
        [(ids[lo:lo + BLOCK_ROWS], rows[lo:lo + BLOCK_ROWS])
         for lo in range(0, len(ids), BLOCK_ROWS)]
    for i, g in blocks:
        g = torch.div(g, div) if div else g
        g = torch.neg(g) if sign < 0 else g
        if i is None:
            mult = _multiplier(total.add_(_row_means(g)), lr, eps)
            param.add_(g.mul(mult.view(-1, *[1] * (g.dim() - 1))))
            continue
        total.index_add_(0, i, _row_means(g))
        mult = _multiplier(total.index_select(0, i), lr, eps)
        param.index_add_(0, i, g.mul(mult.view(-1, *[1] * (g.dim() - 1))))
