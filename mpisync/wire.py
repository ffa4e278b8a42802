"""Wire format: message tags, fixed headers and the fused per-ps buffer layouts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ALIGN",
    "PARAM_HEADER_BYTES",
    "Entry",
    "GradHeader",
    "HyperSchema",
    "Kind",
    "ShardLayout",
    "Tag",
    "build_layouts",
    "tensor_view",
]

ALIGN = 64
PARAM_HEADER_BYTES = 64   # int64[8]: kind, version, ...
TOKEN_WORDS = 4           # int64[4]: kind, global_step, params_follow, unused


class Tag:
    """MPI tags on mpisync's private communicator."""

    SETUP = 11      # pickled: chief -> ps (spec or error)
    GRAD = 12       # fused gradients (or a bare header for CLOSE): worker -> ps
    PARAMS = 13     # fused parameters: ps -> worker
    TOKEN = 14      # int64[4]: coordinator -> worker
    CTL = 15        # int64[4 + 2W]: coordinator -> ps
    ACK = 16        # int64[2]: ps -> coordinator, "step applied"
    REQ = 17        # pickled request: worker -> coordinator
    INFO = 18       # pickled reply: ps -> worker
    ERROR = 19      # pickled failure notice: any rank -> any rank
    CTL_OBJ = 20    # pickled payload following a CTL message


class Kind:
    """Message kinds, in the first int64 of every header."""

    GRAD = 1
    CLOSE = 2
    PARAMS = 3
    GO = 4          # token: compute a gradient at `global_step`
    STOP = 5        # token: training is over (no step can complete any more)
    DECIDE = 6      # ctl: apply step with these taken counts, then send params
    REPLY = 7       # ctl: send current params to these workers now
    SHUTDOWN = 8    # ctl: every worker has closed
    STATE = 9       # ctl: send your optimizer state to worker X
    LOAD = 10       # ctl: a pickled optimizer state follows; load it
    AVERAGES = 11   # ctl: send your parameters' moving averages to worker X


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    """One parameter inside a fused buffer's data region."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int        # bytes from the start of the data region
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    """The data region of one ps rank's fused buffer: entries grouped by dtype."""

    ps: int
    entries: tuple[Entry, ...]
    regions: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, offset, nbytes), contiguous
    nbytes: int


def build_layouts(
    names: list[str],
    shapes: list[tuple[int, ...]],
    dtypes: list[torch.dtype],
    owners: tuple[int, ...],
    num_ps: int,
) -> list[ShardLayout]:
    """Lay out each ps rank's parameters: one contiguous region per dtype, 64-byte aligned.

    Every rank calls this with the same inputs and gets the same layouts.
    """
    layouts = []
    for ps in range(num_ps):
        mine = [i for i, o in enumerate(owners) if o == ps]
        order = sorted({str(dtypes[i]) for i in mine})
        entries, regions, offset = [], [], 0
        for dname in order:
            start = offset
            dtype = None
            for i in mine:
                if str(dtypes[i]) != dname:
                    continue
                dtype = dtypes[i]
                numel = int(np.prod(shapes[i], dtype=np.int64)) if shapes[i] else 1
                nbytes = numel * dtype.itemsize
                entries.append(Entry(names[i], tuple(shapes[i]), dtype, offset, nbytes))
                offset += nbytes
            regions.append((dtype, start, offset - start))
            offset = _align(offset)
        layouts.append(ShardLayout(ps, tuple(entries), tuple(regions), offset))
    return layouts


def tensor_view(buf: torch.Tensor, base: int, dtype: torch.dtype, offset: int, nbytes: int,
                shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A typed view of ``nbytes`` bytes of the uint8 tensor ``buf`` at ``base + offset``."""
    start = base + offset
    t = buf[start:start + nbytes].view(dtype)
    return t if shape is None else t.view(shape)


@dataclass(frozen=True)
class HyperSchema:
    """Which numeric hyper-parameters of which param group travel in each gradient header.

    Each slot is (group index, key, kind, width) with kind "f" (float), "i" (int),
    "b" (bool) or "t" (tuple of floats). Other values (None, strings) must not change.
    """

    slots: tuple[tuple[int, str, str, int], ...]
    fixed: tuple[tuple[int, str, object], ...]

    @staticmethod
    def from_groups(groups: list[dict]) -> HyperSchema:
        slots, fixed = [], []
        for gi, group in enumerate(groups):
            for key in sorted(k for k in group if k != "params"):
                v = group[key]
                if isinstance(v, bool):
                    slots.append((gi, key, "b", 1))
                elif isinstance(v, int):
                    slots.append((gi, key, "i", 1))
                elif isinstance(v, float):
                    slots.append((gi, key, "f", 1))
                elif (isinstance(v, tuple) and v
                      and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
                    slots.append((gi, key, "t", len(v)))
                else:
                    fixed.append((gi, key, v))
        return HyperSchema(tuple(slots), tuple(fixed))

    @property
    def width(self) -> int:
        return sum(s[3] for s in self.slots)

    def encode(self, groups: list[dict], out: np.ndarray) -> None:
        """Write the groups' values into the float64 array ``out``; raise if a fixed one changed."""
        pos = 0
        for gi, key, kind, width in self.slots:
            v = groups[gi][key]
            if kind == "t":
                if not isinstance(v, tuple) or len(v) != width:
                    raise TypeError(f"param_groups[{gi}][{key!r}] must stay a tuple of "
                                    f"{width} numbers, found {v!r}")
                out[pos:pos + width] = v
            else:
                if isinstance(v, torch.Tensor):
                    v = v.item()
                if not isinstance(v, (int, float)):
                    raise TypeError(f"param_groups[{gi}][{key!r}] must stay a number, "
                                    f"found {v!r}")
                out[pos] = v
            pos += width
        for gi, key, v in self.fixed:
            if groups[gi].get(key, v) is not v and groups[gi].get(key) != v:
                raise TypeError(f"param_groups[{gi}][{key!r}] changed from {v!r} to "
                                f"{groups[gi][key]!r}; only numeric hyper-parameters may "
                                f"change during training")

    def decode(self, values: np.ndarray, groups: list[dict]) -> None:
        """Set the groups' hyper-parameters from ``values`` (the inverse of ``encode``)."""
        pos = 0
        for gi, key, kind, width in self.slots:
            if kind == "t":
                groups[gi][key] = tuple(float(x) for x in values[pos:pos + width])
            elif kind == "b":
                groups[gi][key] = bool(values[pos])
            elif kind == "i":
                groups[gi][key] = int(values[pos])
            else:
                groups[gi][key] = float(values[pos])
            pos += width


class GradHeader:
    """Layout of the header that leads every gradient message to one ps rank.

    int64[8] fields (kind, step, worker, seq, ...), then the hyper-parameters as
    float64, then one byte per entry of the shard: 1 if that gradient is present.
    """

    FIELDS = 8

    def __init__(self, hyper_width: int, num_entries: int):
        self.hyper_offset = 8 * self.FIELDS
        self.mask_offset = self.hyper_offset + 8 * hyper_width
        self.nbytes = _align(self.mask_offset + num_entries)
        self.hyper_width = hyper_width
        self.num_entries = num_entries

    def views(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(int64 fields, float64 hyper-parameters, uint8 mask) views into ``buf``."""
        fields = buf[:self.hyper_offset].view(np.int64)
        hyper = buf[self.hyper_offset:self.mask_offset].view(np.float64)
        mask = buf[self.mask_offset:self.mask_offset + self.num_entries]
        return fields, hyper, mask
