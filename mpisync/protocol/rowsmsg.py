"""A rows message (no MPI): per part, int64 local row ids and/or the rows' values.

What a rows lookup and its reply, and a push's rows of the table shards, are made of
(``mpisync.worker.rows``, ``mpisync.ps.rows``); the head's words are ``wire.RowsField``'s,
and ``mpisync.protocol.pooled`` follows a push's rows message with its pooled section.
"""
from __future__ import annotations

import numpy as np
import torch

from .wire import ROWS_HEAD, RowsField, pad8

__all__ = ["absent_parts", "pack_rows", "rows_counts", "unpack_rows"]


def pack_rows(step: int, seq: int, parts: list[tuple[torch.Tensor | None, torch.Tensor | None]],
              absent: list[bool] | None = None) -> np.ndarray:
    """One message of rows: per part, int64 local row ids and/or the rows' values.

    Layout: int64 ``[step, seq, n, count_0 .. count_n-1]``, then each part's ids (int64),
    then each part's values (padded to 8 bytes). A part is ``(ids, values)``; either may
    be None when the receiver knows what it would be. ``absent[i]``: part ``i`` (empty)
    stands for no gradient at all, not for one without rows here: its count is -1
    (``absent_parts``; ``unpack_rows`` reads it as empty).
    """
    counts = [len(ids) if ids is not None else (len(v) if v is not None else 0)
              for ids, v in parts]
    head = 8 * (ROWS_HEAD + len(parts))
    size = head + sum(8 * c for (ids, _), c in zip(parts, counts) if ids is not None)
    size += sum(pad8(v.numel() * v.element_size()) for _, v in parts if v is not None)
    buf = np.empty(size, np.uint8)
    words = buf[:head].view(np.int64)
    words[RowsField.STEP], words[RowsField.SEQ], words[RowsField.PARTS] = step, seq, len(parts)
    words[RowsField.COUNT:] = counts if absent is None else \
        [-1 if a and c == 0 else c for a, c in zip(absent, counts)]
    out = torch.from_numpy(buf)
    at = head
    for ids, _ in parts:
        if ids is not None and len(ids):
            out[at:at + 8 * len(ids)].view(torch.int64).copy_(ids)
            at += 8 * len(ids)
    for _, v in parts:
        if v is not None:
            n = v.numel() * v.element_size()
            if n:
                out[at:at + n].view(v.dtype).view(v.shape).copy_(v)
            at += pad8(n)
    return buf


def rows_counts(buf: np.ndarray, n: int) -> list[int]:
    """The row count of each of a rows message's ``n`` parts, as its head holds them (-1:
    an ``absent`` part of ``pack_rows``)."""
    return buf[8 * ROWS_HEAD:8 * (ROWS_HEAD + n)].view(np.int64).tolist()


def absent_parts(buf: np.ndarray) -> list[bool]:
    """Which parts of a rows message stand for no gradient at all (``pack_rows``'
    ``absent``)."""
    return [c < 0 for c in rows_counts(buf, int(buf[:8 * ROWS_HEAD].view(np.int64)[
        RowsField.PARTS]))]


def unpack_rows(buf: np.ndarray, rows: list[tuple[torch.dtype, tuple[int, ...]] | None],
                with_ids: bool) -> tuple[int, int, list[tuple[torch.Tensor | None,
                                                            torch.Tensor | None]]]:
    """The inverse of ``pack_rows``: ``(step, seq, parts)``, views into ``buf``.

    ``rows`` gives each part's value dtype and row shape, or None for parts without values.

    Raises:
        ValueError: the message does not have the parts or the bytes expected.
    """
    words = buf[:8 * ROWS_HEAD].view(np.int64)
    step, seq = int(words[RowsField.STEP]), int(words[RowsField.SEQ])
    n = int(words[RowsField.PARTS])
    if n != len(rows):
        raise ValueError(f"a rows message with {n} parts, expected {len(rows)}")
    counts = [max(c, 0) for c in rows_counts(buf, n)]
    t = torch.from_numpy(buf)
    at = 8 * (ROWS_HEAD + n)
    ids = []
    for c in counts:
        ids.append(t[at:at + 8 * c].view(torch.int64) if with_ids else None)
        at += 8 * c if with_ids else 0
    parts = []
    for i, (c, r) in enumerate(zip(counts, rows)):
        if r is None:
            parts.append((ids[i], None))
            continue
        dtype, shape = r
        nbytes = c * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        parts.append((ids[i], t[at:at + nbytes].view(dtype).view(c, *shape)))
        at += pad8(nbytes)
    if at != buf.nbytes:
        raise ValueError(f"a rows message of {buf.nbytes} bytes, expected {at}")
    return step, seq, parts
