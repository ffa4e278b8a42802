"""Row updates of table shards: the taken rows merged, and the optimizer applied to them (no MPI).

A step of a table shard touches only the rows some taken gradient has. ``merge_rows`` sums
the pieces (each worker's sorted unique local ids and rows) into one sorted unique set,
and ``apply_rows`` runs the optimizer's update on those rows in one vectorised pass over
them and their optimizer state, in blocks that stay in cache, with the same kernels
torch's own sparse step uses, so the result is bitwise that of ``optimizer.step()`` with
the sparse gradient:

- ``torch.optim.SGD`` (no momentum, no weight decay): ``p[ids] += -lr * g``;
- ``torch.optim.Adagrad`` (no weight decay): ``sum[ids] += g * g``,
  ``p[ids] += -clr * g / (sqrt(sum[ids]) + eps)``, ``clr = lr / (1 + (step - 1) * lr_decay)``;
- ``torch.optim.SparseAdam``: torch's masked Adam on the rows;
- ``mpisync.RowWiseAdagrad``: its row-wise rule (see its docstring).

Where torch adds a sparse tensor times ``alpha`` to the rows (``p.add_(sparse, alpha=)``:
an ``axpy`` per row, which may fuse the multiply and the add), the same call is made on a
block's coalesced rows, so the products round as torch's do; a plain sum of rows
(``alpha`` 1, exact either way) is an ``index_add_``. The optimizer's ``state`` stays
torch's (same keys, tensors and step counters) and hyper-parameters are read from the
param group at each call, so LR schedules, ``state_dict`` and checkpoints are unchanged.
Anything else (another optimizer, a subclass, ``fused``/``differentiable``, complex or
integer rows, AMP scaling) is declined and left to ``optimizer.step()``.
"""
from __future__ import annotations

import math

import torch
from torch.optim.optimizer import _get_scalar_dtype, _get_value, _to_scalar

from ..native import kernels, plankernels
from ..native.plankernels import Plan
from ..protocol.multi import inner_of
from .rowwise import RowWiseAdagrad, rowwise_rows

__all__ = ["BLOCK_ROWS", "RowScratch", "apply_rows", "handles_rows", "merge_rows"]

BLOCK_ROWS = 2048         # rows a block of the update works on: its temporaries stay in cache


class RowScratch:
    """Buffers reused from step to step (the hot path allocates nothing new once warm).

    ``get(name, shape, dtype)`` returns a contiguous view of a buffer kept under ``name``
    that grows when asked for more (never shrinks); two names never share memory.
    """

    def __init__(self):
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.kept: dict[str, torch.Tensor] = {}
        self.marks: plankernels.PlanMarks | None = None

    def slots(self, num_rows: int) -> torch.Tensor:
        """The shard's slot array for ``mpisync.native.kernels`` (-1 everywhere between calls)."""
        return kernels.slots_for(self.kept, num_rows)

    def plan_marks(self, num_rows: int) -> plankernels.PlanMarks:
        """The shard's marks for ``plankernels.plan``, kept from step to step."""
        if self.marks is None or len(self.marks) != num_rows:
            self.marks = plankernels.PlanMarks(num_rows)
        return self.marks

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 0),
                              dtype=dtype)
            self.buffers[(name, dtype)] = buf
        return buf[:numel].view(shape)


# -- merging the taken rows ---------------------------------------------------------------
def _sorted_unique(ids: torch.Tensor) -> bool:
    return len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())


def merge_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int, count: int,
               how: str = "mean", scratch: RowScratch | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The taken rows summed per id, in the pieces' order, then reduced: ``(ids, rows)``.

    Each id's first row is copied and the later ones added in the pieces' order: what
    ``accumulate.reduce_rows`` (a COO coalesce) gives when its sort keeps that order
    (always for two pieces; its unstable sort may not for more), bitwise, without a
    general coalesce: one stable sort of the ids (runs already sorted), one gather of
    the first rows, one ``index_add_`` of the repeated ones.

    Args:
        pieces: per taken gradient, in reduction (worker) order, its local row ids (sorted,
            each once) and their rows.
        num_rows: the shard's rows; every id must lie in ``[0, num_rows)``.
        count: the number of gradients the step took (some may have no rows here).
        how: ``"mean"`` (the sum divided by ``count``), ``"per_row"`` (each row's sum
            divided by the number of pieces that have it) or ``"sum"``.
        scratch: buffers to reuse for the result (then valid until the next call with it).

    Returns:
        ``(ids, rows)`` sorted by id, or None when a piece's ids are not sorted and unique
        (the caller then coalesces in general).

    Raises:
        IndexError: an id outside ``[0, num_rows)``.
    """
    for ids, _ in pieces:
        if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= num_rows):
            bad = int(ids[0]) if int(ids[0]) < 0 else int(ids[-1])
            raise IndexError(f"row {bad} outside [0, {num_rows})")
        if not _sorted_unique(ids):
            return None
    row_shape, dtype = tuple(pieces[0][1].shape[1:]), pieces[0][1].dtype
    if len(pieces) == 1:
        ids, rows = pieces[0]
        if how in ("sum", "per_row") or count == 1:
            return ids, rows            # as they came: no copy (dividing by 1 changes nothing)
        return ids, torch.div(rows, count, out=_buffer(scratch, "merged", tuple(rows.shape),
                                                        dtype))
    if scratch is not None and how != "per_row" and kernels.available(
            *[r for _, r in pieces]) and all(i.dtype == torch.int64 for i, _ in pieces):
        return kernels.merge_pieces(pieces, count if how == "mean" and count != 1 else 0,
                                    lambda n: scratch.get("merged", (n, *row_shape), dtype))
    all_ids = torch.cat([i for i, _ in pieces])
    all_rows = torch.cat([r for _, r in pieces]) if scratch is None else torch.cat(
        [r for _, r in pieces], out=scratch.get("pieces", (len(all_ids), *row_shape), dtype))
    sorted_ids, order = torch.sort(all_ids, stable=True)
    first = torch.ones(len(all_ids), dtype=torch.bool)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    ids = sorted_ids[first]
    out = _buffer(scratch, "merged", (len(ids), *row_shape), dtype)
    torch.index_select(all_rows, 0, order[first], out=out)
    repeated = ~first
    if bool(repeated.any()):
        target = torch.cumsum(first, 0).sub_(1)[repeated]
        # in sorted order: each id's repeats in the pieces' order, added one after another
        out.index_add_(0, target, all_rows.index_select(0, order[repeated]))
    if how == "sum" or count == 1:
        return ids, out
    if how == "per_row":
        per_row = torch.bincount(torch.cumsum(first, 0).sub_(1), minlength=len(ids))
        out.div_(per_row.to(dtype).view(-1, *[1] * len(row_shape)))
    else:
        out.div_(count)
    return ids, out


def _buffer(scratch: RowScratch | None, name: str, shape: tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype) if scratch is None else scratch.get(name, shape, dtype)


# -- applying an optimizer to rows --------------------------------------------------------
_PLAIN = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam, RowWiseAdagrad)


def handles_rows(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> bool:
    """Whether ``apply_rows`` applies this optimizer's update to rows of ``param`` itself.

    True for exactly SGD (no momentum, no weight decay), Adagrad (no weight decay),
    SparseAdam and RowWiseAdagrad, on real floating-point parameters, without ``fused``,
    ``differentiable`` or AMP gradient scaling; otherwise ``optimizer.step()`` must.
    Where ``optimizer`` joins several, the one that holds ``group`` is asked.
    """
    optimizer = inner_of(optimizer, group)
    kind = type(optimizer)
    if kind not in _PLAIN or not param.dtype.is_floating_point or param.dim() < 1:
        return False
    if group.get("fused") or group.get("differentiable"):
        return False
    if getattr(optimizer, "grad_scale", None) is not None or \
            getattr(optimizer, "found_inf", None) is not None:
        return False
    if kind is torch.optim.SGD:
        return not group["momentum"] and not group["weight_decay"]
    if kind is torch.optim.Adagrad:
        step = optimizer.state.get(param, {}).get("step")
        return not group["weight_decay"] and (step is None or torch.is_tensor(step))
    return True


@torch.no_grad()
def apply_rows(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor,
               ids: torch.Tensor, rows: torch.Tensor, scratch: RowScratch | None = None,
               div: float = 0) -> None:
    """One step of ``optimizer`` on the rows ``ids`` of ``param``, whose gradient is ``rows``.

    Bitwise ``optimizer.step()`` with ``param.grad`` the coalesced sparse tensor of
    ``(ids, rows / div)`` (``rows`` where ``div`` is 0; and no other gradient in the
    group); the optimizer's state for ``param`` is created and advanced as torch's step
    would. Only for what ``handles_rows`` accepts.

    Args:
        ids: unique row ids (int64), in any order; rows: their gradient rows, or a
            ``mpisync.native.plankernels.Plan`` of them (its ``ids``): SGD, Adagrad and
            RowWiseAdagrad update from it in one pass, the others from its rows.
        scratch: buffers to reuse across calls.
        div: where not 0, ``rows`` are sums the gradient is divided from (the mean of
            the taken gradients), each element divided before anything else.
    """
    scratch = scratch or RowScratch()
    optimizer = inner_of(optimizer, group)
    kind = type(optimizer)
    if kind is RowWiseAdagrad:
        rowwise_rows(optimizer.state_of(param), group, param, ids, rows, div, scratch)
        return
    if kind not in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam):
        raise TypeError(f"apply_rows does not handle {kind.__name__}")
    if kind is torch.optim.SGD:
        _sgd(group, param, ids, rows, scratch, div)
    elif kind is torch.optim.Adagrad:
        _adagrad(optimizer, group, param, ids, rows, scratch, div)
    else:
        _sparse_adam(optimizer, group, param, ids, _divided(planned_rows(rows, scratch), div),
                     scratch)


def planned_rows(rows, scratch: RowScratch | None = None) -> torch.Tensor:
    """Gradient rows as they are, or a ``Plan``'s summed (into ``scratch``'s buffer)."""
    return rows.summed(scratch) if isinstance(rows, Plan) else rows


def _divided(rows: torch.Tensor, div: float) -> torch.Tensor:
    return torch.div(rows, div) if div else rows


def _blocks(ids: torch.Tensor, rows: torch.Tensor, maximize: bool, scratch: RowScratch):
    """(ids, gradient rows) block by block; negated into a scratch buffer for ``maximize``."""
    for lo in range(0, len(ids), BLOCK_ROWS):
        g = rows[lo:lo + BLOCK_ROWS]
        if maximize:
            g = torch.neg(g, out=scratch.get("neg", tuple(g.shape), g.dtype))
        yield ids[lo:lo + BLOCK_ROWS], g


def _add_rows(param: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, alpha) -> None:
    """``param[ids] += alpha * rows`` with torch's dense += sparse kernel (an axpy per row;
    it refuses values with strides, which a coalesced gradient never has)."""
    param.add_(torch.sparse_coo_tensor(ids[None], rows.contiguous(), param.shape,
                                       is_coalesced=True, check_invariants=False), alpha=alpha)


def _compiled(param: torch.Tensor, ids: torch.Tensor, rows, *state: torch.Tensor) -> bool:
    """Whether ``mpisync.native.kernels`` updates these rows (a tensor or a ``Plan``): one
    float dtype, the parameter and its state contiguous (the inputs are made so)."""
    if isinstance(rows, Plan):
        rows = rows.grads
    return kernels.available(param, rows) and ids.dtype == torch.int64 and \
        rows.dtype == param.dtype and all(
            t.dtype == param.dtype and t.is_contiguous() for t in (param, *state))


def _sgd(group: dict, param, ids, rows, scratch, div) -> None:
    lr = _to_scalar(group["lr"])
    sign = -1.0 if group["maximize"] else 1.0
    if _compiled(param, ids, rows) and isinstance(rows, Plan):
        plankernels.axpy(rows, sign, -lr, param, div)
        return
    rows = planned_rows(rows, scratch)
    if _compiled(param, ids, rows):
        kernels.axpy_rows(ids, rows, sign, -lr, param, div)
        return
    for i, g in _blocks(ids, _divided(rows, div), group["maximize"], scratch):
        _add_rows(param, i, g, -lr)


def _adagrad(optimizer, group: dict, param, ids, rows, scratch, div) -> None:
    state = optimizer.state[param]
    if len(state) == 0:      # as Adagrad._init_group
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        state["sum"] = _zeros_like(param).fill_(optimizer.defaults["initial_accumulator_value"])
    step_t, state_sum = state["step"], state["sum"]
    step_t += 1
    step = _get_value(step_t)
    lr = _to_scalar(group["lr"])
    clr = lr / (1 + (step - 1) * group["lr_decay"])
    eps = group["eps"]
    sign = -1.0 if group["maximize"] else 1.0
    if _compiled(param, ids, rows, state_sum) and isinstance(rows, Plan) and \
            plankernels.adagrad(rows, sign, eps, -clr, state_sum, param, div):
        return
    rows = planned_rows(rows, scratch)
    if _compiled(param, ids, rows, state_sum):
        # torch's sparse step: the gradient's rows and the new sums' rows, whole
        std = kernels.adagrad_sum_rows(ids, rows, sign, state_sum,
                                       scratch.get("b", tuple(rows.shape), rows.dtype), div)
        kernels.adagrad_apply_rows(ids, rows, std.sqrt_(), sign, eps, -clr, param, div)
        return
    for i, g in _blocks(ids, _divided(rows, div), group["maximize"], scratch):
        shape = tuple(g.shape)
        sq = torch.pow(g, 2, out=scratch.get("a", shape, g.dtype))
        state_sum.index_add_(0, i, sq)                  # torch: state_sum.add_(sparse g**2)
        std = torch.index_select(state_sum, 0, i, out=scratch.get("b", shape, g.dtype))
        std.sqrt_().add_(eps)
        torch.div(g, std, out=std)
        _add_rows(param, i, std, -clr)


def _zeros_like(param: torch.Tensor) -> torch.Tensor:
    """State of a table shard: zeros as torch makes them, in huge pages where the shard is
    contiguous (``kernels.table_zeros``)."""
    if param.device.type == "cpu" and param.is_contiguous():
        return kernels.table_zeros(param.shape, param.dtype)
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def _sparse_adam(optimizer, group: dict, param, ids, rows, scratch) -> None:
    state = optimizer.state[param]
    if len(state) == 0:      # as SparseAdam.step
        state["step"] = 0
        state["exp_avg"] = _zeros_like(param)
        state["exp_avg_sq"] = _zeros_like(param)
    state["step"] += 1
    step = state["step"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    beta1, beta2 = group["betas"]
    eps, lr = group["eps"], _to_scalar(group["lr"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    for i, g in _blocks(ids, rows, group.get("maximize", False), scratch):
        shape, dt = tuple(g.shape), g.dtype
        old_avg = torch.index_select(exp_avg, 0, i, out=scratch.get("a", shape, dt))
        avg_update = torch.sub(g, old_avg, out=scratch.get("b", shape, dt)).mul_(1 - beta1)
        exp_avg.index_add_(0, i, avg_update)
        old_sq = torch.index_select(exp_avg_sq, 0, i, out=scratch.get("c", shape, dt))
        sq_update = torch.pow(g, 2, out=scratch.get("d", shape, dt))
        sq_update.sub_(old_sq).mul_(1 - beta2)
        exp_avg_sq.index_add_(0, i, sq_update)
        numer = avg_update.add_(old_avg)
        denom = sq_update.add_(old_sq).sqrt_().add_(eps)
        update = torch.mul(numer.div_(denom), -step_size, out=numer)
        param.index_add_(0, i, update)
