"""Bags of ids as ``nn.EmbeddingBag`` takes them: checked, flattened, and their pooling."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Bags", "bags_of", "fewest_unique_to_pool", "pooled_bytes", "pooling_pays",
           "rows_bytes"]

POOL_CHOICES = (False, True, "auto")


@dataclass
class Bags:
    """One batch of bags, flattened: what a pooled lookup sends.

    ``ids[i]`` belongs to bag ``bag[i]`` with weight ``weights[i]`` (None: all 1), copies
    of the caller's; ``padding_idx`` entries and ids past the last bag are already left
    out. ``counts`` holds each bag's number of ids (for ``mode="mean"``), ``num_bags`` the
    output rows.
    """

    ids: torch.Tensor
    bag: torch.Tensor
    weights: torch.Tensor | None
    counts: torch.Tensor
    num_bags: int


def _where(label: str, name: str | None) -> str:
    return f"{label}: mpisync.EmbeddingBag {name!r}"


def bags_of(input: torch.Tensor, offsets: torch.Tensor | None,
            per_sample_weights: torch.Tensor | None, *, mode: str, include_last_offset: bool,
            padding_idx: int | None, dtype: torch.dtype, label: str = "this worker",
            name: str | None = None, flatten: bool = True) -> Bags | None:
    """Check a forward's arguments as ``nn.EmbeddingBag`` would; the flattened bags.

    Called before anything is sent, so that a bad batch stops this worker alone, with a
    message naming the table and the rank. Ids themselves are checked by the caller.
    With ``flatten=False`` only checks (the row path hands the arguments to torch).

    Raises:
        TypeError: offsets or per_sample_weights of the wrong type or dtype.
        ValueError: a wrong shape, per_sample_weights with ``mode`` other than "sum",
            offsets that do not start at 0, decrease, or run past the input.
    """
    where = _where(label, name)
    _check_input(where, input, offsets, include_last_offset)
    _check_weights(where, input, per_sample_weights, mode)
    if per_sample_weights is not None and per_sample_weights.dtype != dtype:
        raise TypeError(f"{where} got per_sample_weights of dtype {per_sample_weights.dtype}; "
                        f"as nn.EmbeddingBag, they must have the table's dtype {dtype}")
    if not flatten:
        return None
    return _flatten(input, offsets, per_sample_weights, include_last_offset, padding_idx, dtype)


def _check_input(where: str, input, offsets, include_last_offset: bool) -> None:
    if not torch.is_tensor(input):
        raise TypeError(f"{where} got input of type {type(input).__name__}; expected an "
                        f"integer tensor of ids")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError(f"{where} got 2-D input {list(input.shape)} with offsets; as "
                             f"nn.EmbeddingBag: offsets go with 1-D input only (each row of a "
                             f"2-D input is a bag)")
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError(f"{where} got 1-D input without offsets; as nn.EmbeddingBag: "
                             f"give offsets (where each bag starts) or a 2-D input")
        if not torch.is_tensor(offsets) or offsets.dim() != 1:
            raise ValueError(f"{where} got offsets of shape "
                             f"{list(getattr(offsets, 'shape', [])) or type(offsets).__name__}; "
                             f"expected a 1-D integer tensor")
        if offsets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{where} got offsets of dtype {offsets.dtype}; expected torch.int64 "
                            f"or torch.int32")
        if include_last_offset and len(offsets) == 0:
            raise ValueError(f"{where} got empty offsets with include_last_offset=True; "
                             f"expected at least one offset (the input's end)")
        _check_offsets(where, offsets, len(input))
        if include_last_offset and int(offsets[-1]) != len(input):
            raise ValueError(f"{where} got offsets[-1] = {int(offsets[-1])} with "
                             f"include_last_offset=True; it must be the input's length "
                             f"{len(input)} (the end of the last bag)")
    else:
        raise ValueError(f"{where} got input of shape {list(input.shape)}; expected 1-D "
                         f"(with offsets) or 2-D (bags of equal size)")


def _check_offsets(where: str, offsets: torch.Tensor, length: int) -> None:
    if not len(offsets):
        return
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"{where} got offsets starting at {first}; the first bag "
                         f"must start at 0")
    steps = offsets[1:] - offsets[:-1]
    if len(steps) and int(steps.min()) < 0:
        at = int(torch.nonzero(steps < 0)[0]) + 1
        raise ValueError(f"{where} got offsets that decrease: offsets[{at}] = "
                         f"{int(offsets[at])} after {int(offsets[at - 1])}; they must "
                         f"not decrease")
    if last > length:
        raise ValueError(f"{where} got offsets[-1] = {last}, beyond the input's "
                         f"length {length}")


def _check_weights(where: str, input, per_sample_weights, mode: str) -> None:
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError(f"{where} got per_sample_weights with mode={mode!r}; as "
                             f"nn.EmbeddingBag, per_sample_weights only go with mode='sum'")
        if not torch.is_tensor(per_sample_weights):
            raise TypeError(f"{where} got per_sample_weights of type "
                            f"{type(per_sample_weights).__name__}; expected a tensor")
        if tuple(per_sample_weights.shape) != tuple(input.shape):
            raise ValueError(f"{where} got per_sample_weights of shape "
                             f"{list(per_sample_weights.shape)}; expected the input's shape "
                             f"{list(input.shape)}")
        if not per_sample_weights.is_floating_point():
            raise TypeError(f"{where} got per_sample_weights of dtype "
                            f"{per_sample_weights.dtype}; expected a floating point dtype")


def _flatten(input, offsets, per_sample_weights, include_last_offset, padding_idx, dtype
             ) -> Bags:
    # copies of the caller's: kept for the backward and the push, which a loader reusing
    # its buffers would otherwise change under them (torch's own backward would refuse)
    ids = input.reshape(-1).to(torch.int64, copy=True)
    weights = None
    if per_sample_weights is not None:
        weights = per_sample_weights.detach().reshape(-1).to(dtype, copy=True)
    if input.dim() == 2:
        num_bags, size = input.shape
        bag = torch.arange(num_bags).repeat_interleave(size)
    else:
        offsets = offsets.long()
        num_bags = len(offsets) - 1 if include_last_offset else len(offsets)
        ends = torch.cat([offsets[1:num_bags], torch.tensor([len(ids)])]) \
            if not include_last_offset else offsets[1:]
        lengths = ends - offsets[:num_bags]
        bag = torch.arange(num_bags).repeat_interleave(lengths)
        if len(bag) < len(ids):            # include_last_offset: past the last bag, unused
            ids = ids[:len(bag)]
            weights = None if weights is None else weights[:len(bag)]
    if padding_idx is not None:
        keep = ids != padding_idx
        if not bool(keep.all()):
            ids, bag = ids[keep], bag[keep]
            weights = None if weights is None else weights[keep]
    counts = torch.bincount(bag, minlength=num_bags)
    return Bags(ids, bag, weights, counts, int(num_bags))


def rows_bytes(num_unique: int, row_bytes: int) -> int:
    """Bytes one worker moves for a forward's rows, roughly: ids out and rows back at the
    lookup, then ids and gradient rows with the push (message headers left out)."""
    return num_unique * (8 + row_bytes) * 2


def pooled_bytes(num_ids: int, num_bags: int, row_bytes: int, weight_bytes: int,
                 num_ps: int) -> int:
    """Bytes one worker moves for a forward pooled at the owners, roughly: each id (and
    weight) out once, at the lookup, with the bags' ``num_bags + 1`` offsets to each of
    ``num_ps`` ps ranks (a forward's bags come in order; the push names the lookup, as it
    does after one forward a step), and one ``num_bags`` x row block back from and out to
    each."""
    return num_ids * (8 + weight_bytes) + num_ps * ((num_bags + 1) * 8 + 2 * num_bags *
                                                    row_bytes)


def fewest_unique_to_pool(num_ids: int, num_bags: int, row_bytes: int, weight_bytes: int,
                          num_ps: int) -> int:
    """The fewest distinct ids for which ``pooling_pays``: a forward pools exactly when its
    ids hold at least this many distinct values (which a count that stops there can tell
    without sorting them)."""
    return pooled_bytes(num_ids, num_bags, row_bytes, weight_bytes, num_ps) // \
        rows_bytes(1, row_bytes) + 1


def pooling_pays(num_ids: int, num_unique: int, num_bags: int, row_bytes: int,
                 weight_bytes: int, num_ps: int) -> bool:
    """``pool_on_ps="auto"``: whether pooling at the owners moves fewer bytes than rows.

    Per id, pooling sends its int64 id (and weight) once, and per bag its offset and its
    pooled row to and from each of ``num_ps`` ps ranks; the rows path sends each unique id
    and its row twice (264 bytes each way for 64 float32). For 64 float32 on one ps rank
    and ids that rarely repeat, pooling pays from a little over one id a bag; ids repeated
    across the batch (few unique ones) favour the rows.
    """
    return pooled_bytes(num_ids, num_bags, row_bytes, weight_bytes, num_ps) < \
        rows_bytes(num_unique, row_bytes)
