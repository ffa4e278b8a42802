"""An ``EmbeddingBag``'s rows path on a worker: the batch's unique rows pooled per bag.

The rows path looks up the batch's unique rows and pools them here with
``F.embedding_bag`` over the ids' positions among them. Torch's backward of that (its
dense backward, for rows that are one tensor) sorts every id and accumulates row by
row; what the push needs is only each unique row's gradient, which is each bag's
gradient (divided by its size for ``"mean"``, times the id's weight where there are
weights) added into the rows of its ids. ``pool`` computes the forward with
``F.embedding_bag`` and that backward with one ``index_select`` and one ``index_add_``:
a few times faster for the many small tables of a recommender, and the same gradient
within float rounding (the additions into a row follow the ids' order here; torch's
follow its sort). ``mode="max"`` and weights that need a gradient keep torch's backward.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ..protocol.bags import Bags

__all__ = ["pool"]


def pool(rows: torch.Tensor, index: torch.Tensor, unique: torch.Tensor, bags: Bags | None,
         offsets: torch.Tensor | None, mode: str, per_sample_weights: torch.Tensor | None,
         padding_idx: int | None, include_last_offset: bool) -> torch.Tensor:
    """``F.embedding_bag(index, rows, offsets, ...)``: ``index`` the input's ids as
    positions in ``unique`` (sorted), ``bags`` the input flattened (``bags_of``; None:
    torch's own backward), ``padding_idx`` a position in ``unique`` or None."""
    plain = bags is not None and mode in ("sum", "mean") and rows.requires_grad and \
        torch.is_grad_enabled() and (per_sample_weights is None or
                                     not per_sample_weights.requires_grad)
    if not plain:
        return F.embedding_bag(index, rows, offsets, mode=mode,
                               per_sample_weights=per_sample_weights, padding_idx=padding_idx,
                               include_last_offset=include_last_offset)
    return _Pool.apply(rows, index, unique, bags, offsets, mode, per_sample_weights,
                       padding_idx, include_last_offset)


class _Pool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, unique, bags, offsets, mode, weights, padding_idx,
                include_last_offset):
        ctx.rows_shape, ctx.bags, ctx.mode, ctx.unique = rows.shape, bags, mode, unique
        ctx.index = index
        return F.embedding_bag(index, rows, offsets, mode=mode, per_sample_weights=weights,
                               padding_idx=padding_idx,
                               include_last_offset=include_last_offset)

    @staticmethod
    def backward(ctx, grad):
        bags: Bags = ctx.bags
        if ctx.mode == "mean":
            grad = grad / bags.counts.clamp(min=1).to(grad.dtype).unsqueeze(1)
        each = grad.index_select(0, bags.bag)
        if bags.weights is not None:
            each = each * bags.weights.to(grad.dtype).unsqueeze(1)
        # each kept id's row: the input's positions in ``unique`` where no id was left out
        # (no padding, none past the last bag), else looked up
        at = ctx.index.reshape(-1) if ctx.index.numel() == len(bags.ids) else \
            torch.searchsorted(ctx.unique, bags.ids)
        out = torch.zeros(ctx.rows_shape, dtype=grad.dtype).index_add_(0, at, each)
        return out, None, None, None, None, None, None, None, None
