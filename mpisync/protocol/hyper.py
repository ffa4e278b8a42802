"""Hyper-parameters on the wire: every numeric value of the param groups, exact and typed."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["HyperCodec"]

FLOAT, INT, BOOL = 1, 2, 3
TENSOR = 16                    # + index into _DTYPES: a 0-dim tensor of that dtype
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_TENSOR_CODE = {dtype: TENSOR + i for i, dtype in enumerate(_DTYPES)}


def _is_leaf(v) -> bool:
    """A value that travels: a real number or a 0-dim tensor of a real dtype."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and v.dtype in _TENSOR_CODE
    return isinstance(v, numbers.Real)


def _encode_leaf(v, where: str) -> tuple[int, int]:
    """(code, int64 bits) of one value; floats keep their float64 bits, exactly."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype not in _TENSOR_CODE:
            raise TypeError(f"{where} must stay a number or a one-element tensor, found a "
                            f"tensor of shape {list(v.shape)} and dtype {v.dtype}")
        code = _TENSOR_CODE[v.dtype]
        v = v.item()
    elif isinstance(v, (bool, np.bool_)):
        return BOOL, int(v)
    elif isinstance(v, numbers.Integral):
        code = INT
    elif isinstance(v, numbers.Real):
        code = FLOAT
    else:
        raise TypeError(f"{where} must stay a number, found {v!r}")
    if isinstance(v, float) or code == FLOAT:
        return code, int(np.float64(v).view(np.int64))
    return code, int(v)


def _decode_leaf(code: int, bits: np.int64, current):
    """The value that ``(code, bits)`` encodes; a tensor of the same dtype is filled in place."""
    if code == FLOAT:
        return float(bits.view(np.float64))
    if code == INT:
        return int(bits)
    if code == BOOL:
        return bool(bits)
    dtype = _DTYPES[code - TENSOR]
    value = float(bits.view(np.float64)) if dtype.is_floating_point else int(bits)
    if isinstance(current, torch.Tensor) and current.dtype == dtype and current.numel() == 1:
        current.fill_(value)         # as torch's schedulers do: whoever holds it sees the change
        return current
    return torch.tensor(value, dtype=dtype)


@dataclass(frozen=True)
class HyperCodec:
    """Which values of which param group travel with each step, and how.

    Built from the param groups as the optimizer was created. Each slot is
    ``(group, key, container, length)``: ``container`` is ``None`` for one value, or
    ``"tuple"``/``"list"`` for a sequence of ``length`` values (Adam's ``betas``). A value
    is a number (``bool``, ``int``, ``float``) or a one-element tensor (filled in place on
    the ps, so it keeps its shape there), and its type travels
    with it, so an ``int`` that a scheduler turns into a ``float``, or a tensor changed in
    place, arrives exactly as the worker holds it. Other values (``None``, strings) are
    ``fixed``: they must not change. Keys that appear later (a scheduler's ``initial_lr``)
    stay on the worker.
    """

    slots: tuple[tuple[int, str, str | None, int], ...]
    fixed: tuple[tuple[int, str, object], ...]

    @staticmethod
    def from_groups(groups: list[dict]) -> HyperCodec:
        slots, fixed = [], []
        for gi, group in enumerate(groups):
            for key in sorted(k for k in group if k != "params"):
                v = group[key]
                if _is_leaf(v):
                    slots.append((gi, key, None, 1))
                elif isinstance(v, (tuple, list)) and v and all(_is_leaf(x) for x in v):
                    slots.append((gi, key, type(v).__name__, len(v)))
                else:
                    fixed.append((gi, key, v))
        return HyperCodec(tuple(slots), tuple(fixed))

    @property
    def width(self) -> int:
        """Number of values per step."""
        return sum(s[3] for s in self.slots)

    def encode(self, groups: list[dict], words: np.ndarray, codes: np.ndarray) -> None:
        """Write every value's bits into ``words`` (int64) and its type into ``codes`` (uint8).

        Raises:
            TypeError: a value changed its kind (a number became a string, a tuple changed
                length), or a fixed value changed.
        """
        pos = 0
        for gi, key, container, length in self.slots:
            where = f"param_groups[{gi}][{key!r}]"
            v = groups[gi].get(key, _MISSING)
            if container is None:
                codes[pos], words[pos] = _encode_leaf(v, where)
            else:
                if not isinstance(v, (tuple, list)) or len(v) != length:
                    raise TypeError(f"{where} must stay a {container} of {length} numbers, "
                                    f"found {v!r}")
                for i, x in enumerate(v):
                    codes[pos + i], words[pos + i] = _encode_leaf(x, f"{where}[{i}]")
            pos += length
        for gi, key, v in self.fixed:
            now = groups[gi].get(key, _MISSING)
            if now is not v and now != v:
                raise TypeError(f"param_groups[{gi}][{key!r}] changed from {v!r} to {now!r}; "
                                f"only numbers, 0-dim tensors and tuples of them may change "
                                f"during training")

    def decode(self, words: np.ndarray, codes: np.ndarray, groups: list[dict]) -> None:
        """Set the groups' values from ``words`` and ``codes`` (the inverse of ``encode``)."""
        pos = 0
        for gi, key, container, length in self.slots:
            group = groups[gi]
            if container is None:
                group[key] = _decode_leaf(int(codes[pos]), words[pos], group.get(key))
            else:
                old = group.get(key)
                old = old if isinstance(old, (tuple, list)) and len(old) == length else \
                    (None,) * length
                values = [_decode_leaf(int(codes[pos + i]), words[pos + i], old[i])
                          for i in range(length)]
                group[key] = tuple(values) if container == "tuple" else values
            pos += length

    def values(self, groups: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(words, codes) of ``groups`` in fresh arrays (off the step's path)."""
        words, codes = np.zeros(self.width, np.int64), np.zeros(self.width, np.uint8)
        self.encode(groups, words, codes)
        return words, codes


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
