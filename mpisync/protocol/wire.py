"""Wire format: tags, the one vocabulary of message kinds, headers and fused buffer layouts."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ALIGN",
    "NOTICE_SKIPPED",
    "NOTICE_WORDS",
    "PARAM_HEADER_BYTES",
    "ROWS_HEAD",
    "TIMING_WORDS",
    "TOKEN_STATS",
    "TOKEN_WORDS",
    "WIRE_VERSION",
    "Bucket",
    "Control",
    "ControlField",
    "Entry",
    "GradField",
    "GradHeader",
    "HyperField",
    "Kind",
    "NoticeField",
    "ParamField",
    "RowsField",
    "ShardLayout",
    "Tag",
    "TimingWord",
    "TokenField",
    "bucket_layout",
    "build_layouts",
    "entry_views",
    "hyper_views",
    "hyper_words",
    "is_still_question",
    "pad8",
    "region_views",
    "rows_mark",
    "still_question",
    "tensor_view",
    "timing_view",
]

#: The version of the message layouts below: every rank of a job must use the same one
#: (``mpisync.init`` checks). Change it with any change to a layout or a message's meaning.
WIRE_VERSION = 5       # 2: Kind.UPDATE (opt.update()); 3: pushes in buckets, 16-bit wire;
                       # 4: pooled bags as offsets, a rows part of no gradient counted -1;
                       # 5: a push's pooled section may name the lookup of its parts
ALIGN = 64


# -- headers: the position of each field, by name -------------------------------------------
# Every reader and writer of a header names its fields through these classes (plain ints,
# like ``Tag``: indexing a numpy array with one costs what indexing it with a literal does,
# which an ``IntEnum`` member's lookup does not). Nothing outside this module indexes a
# header by number (tests/unit/test_layout.py checks).

class GradField:
    """int64 fields of the header that leads a gradient message (``GradHeader``), and of
    the bare header of an ASSIGN or CLOSE."""

    KIND = 0        # Kind.GRAD, Kind.ASSIGN or Kind.CLOSE
    STEP = 1        # the global step the gradient was computed at (CLOSE: the worker's last)
    WORKER = 2      # the sender's worker index
    SEQ = 3         # the sender's push count
    FLAGS = 4       # FLAG_* (GRAD only)
    TIMING = 5      # fields 5-6: TIMING_WORDS uint32 words (``timing_view``)
    TIMING_STOP = 7
    COUNT = 8       # field 7 is unused (0)


class ParamField:
    """int64 fields of the header that leads a ps rank's parameters (ps -> worker)."""

    KIND = 0        # Kind.PARAMS
    STEP = 1        # the global step the parameters are of
    COUNT = 8       # fields 2-7 are unused (0)


class TokenField:
    """int64 words of a token (coordinator -> worker)."""

    KIND = 0        # Kind.GO, GRANT, STOP, FAIL or HYPER
    STEP = 1        # the global step to compute at (HYPER: whose hyper-parameters to send)
    ARG = 2         # GO, GRANT: 1 if the step took this worker's gradient
    FLAGS = 3       # TOKEN_*
    COUNT = 4


class NoticeField:
    """int64 words of a notice (ps -> coordinator); the figures are APPLIED's, 0 unless timed."""

    KIND = 0        # Kind.APPLIED
    STEP = 1        # the step applied
    SENDER = 2      # the sender's ps index
    FLAGS = 3       # NOTICE_SKIPPED
    APPLY_US = 4    # time spent applying the step, microseconds
    REDUCE_US = 5   # time spent reducing its gradients, microseconds
    BYTES_IN = 6    # bytes received since the last notice
    BYTES_OUT = 7   # bytes sent since the last notice
    COUNT = 8


class ControlField:
    """int64 words before a control message's arrays (coordinator -> ps, ``Control``)."""

    KIND = 0        # Kind.DECIDE, REPLY, SHUTDOWN, STATE, AVERAGES, LOAD or UPDATE
    STEP = 1        # DECIDE: the step to apply
    ARG = 2         # STATE, AVERAGES: the worker to send to
    HAS_OBJ = 3     # a pickled payload follows on Tag.CTL_OBJ
    COUNT = 4


class HyperField:
    """int64 words of a worker's hyper-parameters message (worker -> coordinator, async)."""

    STEP = 0        # the step they are for
    WORDS = 1       # then the hyper-parameter words, then one uint8 code each (``hyper_views``)


class RowsField:
    """int64 words before a rows message's counts (``rowsmsg.pack_rows``,
    ``pooled.pack_parts``)."""

    STEP = 0        # the step (a rows lookup: -1)
    MARK = 0        # ... or, in ``pooled``'s messages, their negative mark in the same word
    SEQ = 1         # the sender's sequence number (``pooled``: a lookup's, which a push names)
    PARTS = 2       # the number of parts, whose counts follow
    COUNT = 3


class TimingWord:
    """uint32 words of a worker's timings of its previous step, microseconds (``timing_view``)."""

    COMPUTE = 0     # from the end of the previous step() to the start of this one
    PUSH = 1        # step() until every send was started
    WAIT = 2        # ... until the token arrived
    PULL = 3        # ... until the parameters were in the model
    COUNT = 4


PARAM_HEADER_BYTES = 8 * ParamField.COUNT
TOKEN_WORDS = TokenField.COUNT
NOTICE_WORDS = NoticeField.COUNT
NOTICE_SKIPPED = 1        # APPLIED's flag: the step's gradient was not finite, not applied
TIMING_WORDS = TimingWord.COUNT
ROWS_HEAD = RowsField.COUNT

class Tag:
    """MPI tags on mpisync's private communicator.

    ``SETUP`` and ``ERROR`` are the job's; every other tag belongs to one optimizer:
    ``Tag.of(Tag.GRAD, opt_id)``, so that several optimizers train side by side.
    """

    SETUP = 11      # pickled: chief -> ps (spec or error), then raw initial parameters
    DONE = 12       # empty: a worker leaves the job (cluster.close() or its exit)
    ERROR = 19      # pickled failure notice: any rank -> any rank
    GRAD = 0        # fused gradients, or a bare header (CLOSE): worker -> ps
    ASSIGN = 1      # parameters written on a worker between steps: worker -> ps
    PARAMS = 2      # fused parameters: ps -> worker
    TOKEN = 3       # TokenField words: coordinator -> worker
    CTL = 4         # Control words (ControlField first): coordinator -> ps
    CTL_OBJ = 5     # pickled payload following a Control message
    NOTICE = 6      # NoticeField words: ps -> coordinator ("step applied")
    REQ = 7         # pickled request: worker -> coordinator
    INFO = 8        # pickled reply: ps -> worker
    HYPER = 9       # HyperField words: worker -> coordinator, the hyper-parameters of a step
    INIT = 10       # raw initial parameters: chief -> ps
    SPARSE = 11     # rows message: a push's table rows and their gradients, worker -> ps
    LOOKUP = 12     # rows message: ids whose rows a worker needs, worker -> ps
    ROWS = 13       # rows message: the rows of a LOOKUP, ps -> worker
    CHANGED = 14    # rows message: rows of sparse tables changed since last sent, ps -> worker
    TABLE = 15      # pickled: a table shard read or written, worker <-> ps
    DATA = 16       # one bucket of a push's gradients, in bucket order: worker -> ps
    FULL = 17       # a push's whole gradient region again (FLAG_RESEND): worker -> ps
    SHM = 18        # pickled, at set-up: a worker's machine, a ps's shared segment, the answer
    SNAP = 20       # pickled: a checkpoint's snapshot of the tables, chief's writer <-> ps
    _BASE, _STRIDE = 32, 32

    @classmethod
    def of(cls, tag: int, opt_id: int) -> int:
        """The tag of ``tag`` for optimizer ``opt_id``."""
        return cls._BASE + cls._STRIDE * opt_id + tag


class Kind(enum.IntEnum):
    """Every message kind, from the coordinator's decisions to the headers on the wire."""

    GRAD = 1        # worker -> ps: gradients of a step
    CLOSE = 2       # worker -> ps: this worker leaves
    PARAMS = 3      # ps -> worker: parameters of a global step
    GO = 4          # token: parameters of `step` are on the way; compute at `step`
    GRANT = 5       # token: compute another gradient on the parameters you hold
    STOP = 6        # token: training is over, no step can complete any more
    DECIDE = 7      # ctl: apply `step` with the taken gradients, then send parameters
    REPLY = 8       # ctl: send the current parameters to these workers now
    SHUTDOWN = 9    # ctl: every worker has closed
    STATE = 10      # ctl / request: send your optimizer state to worker `arg`
    AVERAGES = 11   # ctl / request: send your moving averages to worker `arg`
    LOAD = 12       # ctl / request: load the state that follows
    STATS = 13      # request: the step statistics
    APPLIED = 14    # notice: ps -> coordinator, `step` is applied
    PUSHED = 15     # notice: the coordinator's shard got a gradient
    CLOSED = 16     # notice: the coordinator's shard got a CLOSE
    HYPER = 17      # token: send the hyper-parameters for step `step` / their reply
    ASSIGN = 18     # worker -> ps: parameters written on the worker
    FAIL = 19       # token: no step can complete (a reason follows on INFO)
    PARK = 20       # request: this worker is in a collective among the workers
    UNPARK = 21     # request: ... and left it
    STILL = 22      # request: ... and is still in it (asked by the coordinator)
    UPDATE = 23     # ctl / request: the functions opt.update() registered, for each ps


#: Flags in a gradient header.
FLAG_ASSIGN = 1       # an ASSIGN message with this push's written parameters was sent first
FLAG_SCHEDULED = 2    # the hyper-parameters follow the global step (async: ask for them)
FLAG_RESEND = 4       # a bucket changed after it was sent: the FULL message follows the buckets

#: Flags in a token's last word.
TOKEN_STATS = 1       # ps 0 keeps the statistics log: report step timings (TIMING_WORDS)


def timing_view(fields: np.ndarray) -> np.ndarray:
    """The TIMING_WORDS uint32 words (``TimingWord``) inside the int64 gradient header
    ``fields`` (``GradField.TIMING``)."""
    return fields[GradField.TIMING:GradField.TIMING_STOP].view(np.uint32)


def hyper_words(width: int) -> int:
    """The int64 words of a hyper-parameters message (``HyperField``) of ``width`` words."""
    return HyperField.WORDS + width + (width + 7) // 8


def hyper_views(msg: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 hyper words, uint8 codes) views into the hyper-parameters message ``msg``."""
    codes_at = HyperField.WORDS + width
    return msg[HyperField.WORDS:codes_at], msg[codes_at:].view(np.uint8)[:width]


def rows_mark(buf: np.ndarray) -> int | None:
    """The first word of a rows message or a ``pooled`` one (``RowsField.MARK``), None if
    ``buf`` is too short to hold it."""
    end = 8 * (RowsField.MARK + 1)
    if buf.nbytes < end:
        return None
    return int(buf[:end].view(np.int64)[RowsField.MARK])


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    """One tensor inside a fused buffer's data region."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int        # bytes from the start of the data region
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    """The data region of one ps rank's fused buffer.

    Parameters first, then buffers (BatchNorm statistics that travel with them); each
    part has one contiguous, 64-byte aligned region per dtype.
    """

    ps: int
    entries: tuple[Entry, ...]
    regions: tuple[tuple[torch.dtype, int, int], ...]        # parameters: (dtype, offset, nbytes)
    buffer_entries: tuple[Entry, ...]
    buffer_regions: tuple[tuple[torch.dtype, int, int], ...]
    nbytes: int


def _pack(items: list[tuple[str, tuple[int, ...], torch.dtype]], offset: int):
    """Entries and per-dtype regions for ``items`` from ``offset`` on; returns the end."""
    entries, regions = [], []
    for dname in sorted({str(d) for _, _, d in items}):
        start = offset
        dtype = None
        for name, shape, d in items:
            if str(d) != dname:
                continue
            dtype = d
            nbytes = int(np.prod(shape, dtype=np.int64)) * d.itemsize if shape else d.itemsize
            entries.append(Entry(name, tuple(shape), d, offset, nbytes))
            offset += nbytes
        regions.append((dtype, start, offset - start))
        offset = _align(offset)
    return tuple(entries), tuple(regions), offset


def build_layouts(names: list[str], shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                  owners: tuple[int, ...], num_ps: int,
                  buffers: tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...] = (),
                  ) -> list[ShardLayout]:
    """Lay out each ps rank's tensors: one contiguous region per dtype, 64-byte aligned.

    ``buffers`` are ``(name, shape, dtype, ps)``. Every rank calls this with the same
    inputs and gets the same layouts.
    """
    layouts = []
    for ps in range(num_ps):
        mine = [(n, s, d) for n, s, d, o in zip(names, shapes, dtypes, owners) if o == ps]
        entries, regions, offset = _pack(mine, 0)
        theirs = [(n, s, d) for n, s, d, o in buffers if o == ps]
        bentries, bregions, offset = _pack(theirs, offset)
        layouts.append(ShardLayout(ps, entries, regions, bentries, bregions, offset))
    return layouts


@dataclass(frozen=True)
class Bucket:
    """Consecutive entries of one ps rank's data region that travel as one message.

    ``first``/``stop`` index the layout's entries (parameters), ``offset``/``nbytes`` give
    the bytes from the data region's start; ``buffers`` marks the last bucket, which holds
    every module buffer (it has no gradient and travels at ``step()``).
    """

    index: int
    first: int
    stop: int
    offset: int
    nbytes: int
    dtype: torch.dtype | None
    buffers: bool = False


def bucket_layout(layout: ShardLayout, bucket_bytes: int) -> tuple[Bucket, ...]:
    """Cut one ps rank's data region into buckets, in the order backward fills them.

    Each dtype region is walked from its last entry (the parameter backward reaches first)
    to its first, a bucket closing before the entry that would take it past
    ``bucket_bytes`` (an entry larger than that gets a bucket of its own). The module
    buffers, if any, form one last bucket. Every rank computes the same buckets.
    """
    buckets: list[Bucket] = []
    entries = layout.entries
    at = 0
    for dtype, offset, nbytes in layout.regions:
        stop = at
        while stop < len(entries) and entries[stop].dtype == dtype:   # (empty ones too)
            stop += 1
        first, end = stop, stop            # the bucket being filled: entries [first, end)
        for k in range(stop - 1, at - 1, -1):
            size = entries[end - 1].offset + entries[end - 1].nbytes - entries[k].offset
            if end > first and size > bucket_bytes:
                buckets.append(_bucket(len(buckets), entries, first, end, dtype))
                end = first
            first = k
        if end > first:
            buckets.append(_bucket(len(buckets), entries, first, end, dtype))
        at = stop
    if layout.buffer_entries:
        buckets.append(_buffers_bucket(len(buckets), layout))
    return tuple(buckets)


def wire_buckets(buckets: tuple[Bucket, ...], wire: ShardLayout) -> tuple[Bucket, ...]:
    """The same buckets (the same entries) over ``wire``, a layout of the same entries in
    other dtypes (``wire_dtypes``): their bytes on the wire."""
    out = []
    for b in buckets:
        if b.buffers:
            out.append(_buffers_bucket(b.index, wire))
        else:
            out.append(_bucket(b.index, wire.entries, b.first, b.stop,
                               wire.entries[b.first].dtype))
    return tuple(out)


#: The floating-point dtypes a compressed wire (``wire_dtype``) carries as 16 bits.
COMPRESSIBLE = (torch.float32, torch.float64)


def wire_dtypes(dtypes, wire_dtype: torch.dtype | None) -> list[torch.dtype]:
    """Each parameter's dtype on the wire: ``wire_dtype`` for float32 and float64."""
    if wire_dtype is None:
        return list(dtypes)
    return [wire_dtype if d in COMPRESSIBLE else d for d in dtypes]


def _buffers_bucket(index: int, layout: ShardLayout) -> Bucket:
    """The last bucket: every module buffer of ``layout``, after its parameters."""
    start, last = layout.buffer_entries[0].offset, layout.buffer_entries[-1]
    return Bucket(index, len(layout.entries), len(layout.entries), start,
                  last.offset + last.nbytes - start, None, True)


def _bucket(index: int, entries, first: int, stop: int, dtype) -> Bucket:
    offset = entries[first].offset
    return Bucket(index, first, stop, offset,
                  entries[stop - 1].offset + entries[stop - 1].nbytes - offset, dtype)


def tensor_view(buf: torch.Tensor, base: int, dtype: torch.dtype, offset: int, nbytes: int,
                shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A typed view of ``nbytes`` bytes of the uint8 tensor ``buf`` at ``base + offset``."""
    start = base + offset
    t = buf[start:start + nbytes].view(dtype)
    return t if shape is None else t.view(shape)


def entry_views(buf: torch.Tensor, base: int, entries) -> list[torch.Tensor]:
    """A view of every entry, shaped, in the uint8 tensor ``buf`` from ``base`` on."""
    return [tensor_view(buf, base, e.dtype, e.offset, e.nbytes, e.shape) for e in entries]


def region_views(buf: torch.Tensor, base: int, regions) -> list[torch.Tensor]:
    """A flat view of every (dtype, offset, nbytes) region of ``buf`` from ``base`` on."""
    return [tensor_view(buf, base, d, off, n) for d, off, n in regions]


class GradHeader:
    """Layout of the header that leads every gradient message to one ps rank.

    int64 fields (``GradField``: kind, step, worker, seq, flags, then the worker's
    timings of its previous step, ``timing_view``), then, on the message to the
    coordinating ps only, the hyper-parameters (int64 words, then one uint8 type code
    each), then one byte per parameter of the shard: 1 if its gradient is present.
    """

    FIELDS = GradField.COUNT

    def __init__(self, hyper_width: int, num_entries: int):
        self.hyper_offset = 8 * self.FIELDS
        self.codes_offset = self.hyper_offset + 8 * hyper_width
        self.mask_offset = self.codes_offset + hyper_width
        self.nbytes = _align(self.mask_offset + num_entries)
        self.hyper_width = hyper_width
        self.num_entries = num_entries

    def views(self, buf: np.ndarray):
        """(int64 fields, int64 hyper words, uint8 codes, uint8 mask) views into ``buf``."""
        fields = buf[:self.hyper_offset].view(np.int64)
        words = buf[self.hyper_offset:self.codes_offset].view(np.int64)
        codes = buf[self.codes_offset:self.mask_offset]
        mask = buf[self.mask_offset:self.mask_offset + self.num_entries]
        return fields, words, codes, mask


class Control:
    """Layout of a coordinator -> ps message: int64 words.

    ``[kind, step, arg, has_obj (ControlField), taken[W], workers[W], hyper words[H],
    codes (H bytes)]``:
    ``taken`` counts each worker's gradients in a DECIDE, ``workers`` flags who gets
    parameters, and the hyper-parameters are those the step applies.
    """

    def __init__(self, num_workers: int, hyper_width: int):
        self.num_workers = num_workers
        self.hyper_width = hyper_width
        self.taken_at = ControlField.COUNT
        self.workers_at = self.taken_at + num_workers
        self.hyper_at = self.taken_at + 2 * num_workers
        self.codes_at = self.hyper_at + hyper_width
        self.words = self.codes_at + (hyper_width + 7) // 8

    def new(self, kind: int, step: int, arg: int = 0, taken=(), workers=(), hyper=None,
            has_obj: bool = False) -> np.ndarray:
        msg = np.zeros(self.words, np.int64)
        msg[ControlField.KIND], msg[ControlField.STEP] = kind, step
        msg[ControlField.ARG], msg[ControlField.HAS_OBJ] = arg, int(has_obj)
        if len(taken):
            msg[self.taken_at:self.workers_at] = taken
        for w in workers:
            msg[self.workers_at + w] = 1
        if hyper is not None:
            words, codes = hyper
            msg[self.hyper_at:self.codes_at] = words
            self.codes(msg)[:] = codes
        return msg

    def taken(self, msg: np.ndarray) -> tuple[int, ...]:
        return tuple(int(x) for x in msg[self.taken_at:self.workers_at])

    def workers(self, msg: np.ndarray) -> np.ndarray:
        return np.flatnonzero(msg[self.workers_at:self.hyper_at])

    def hyper(self, msg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return msg[self.hyper_at:self.codes_at], self.codes(msg)

    def codes(self, msg: np.ndarray) -> np.ndarray:
        return msg[self.codes_at:].view(np.uint8)[:self.hyper_width]


def pad8(n: int) -> int:
    """``n`` rounded up to a multiple of 8: each section of a message starts 8-aligned."""
    return (n + 7) // 8 * 8


def still_question(step: int, number: int) -> tuple:
    """ps 0's question (pickled, ``Tag.INFO``) to a worker it suspects of a deadlock:
    whether it is still in a collective among the workers. ``number`` names the question,
    and the answer (``Kind.STILL``) carries it back."""
    return ("still?", step, number)


def is_still_question(answer) -> bool:
    """Whether a message on ``Tag.INFO`` is ps 0's ``still_question`` (not an answer)."""
    return isinstance(answer, tuple) and len(answer) == 3 and answer[0] == "still?"
