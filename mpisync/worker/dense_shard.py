"""This worker's side of one ps rank for the dense channel: fused buffers and requests."""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..errors import ProtocolError
from ..protocol.layouts import conversions
from ..protocol.wire import (
    FLAG_RESEND,
    PARAM_HEADER_BYTES,
    GradField,
    GradHeader,
    Kind,
    ParamField,
    ShardLayout,
    Tag,
    region_views,
)
from .devices import host_bytes

__all__ = ["DenseShard"]


class DenseShard:
    """This worker's side of one ps rank: the fused buffers and their persistent requests.

    A push is a header on ``Tag.GRAD`` and the buckets, in order, on ``Tag.DATA`` (the
    first ones sent from gradient hooks while backward runs, the rest at ``step()``); the
    pull is every bucket's parameters, then the parameter header, on ``Tag.PARAMS``. With
    a ``wire_dtype`` what travels (``gbuf``, ``pbuf``) is converted from and to the
    buffers the model's gradients and parameters live in (``gmem``, ``pmem``); without, the
    two are one.
    """

    __slots__ = ("abuf", "acks", "bases", "buckets", "buffer_pairs", "codes", "copies",
                 "data_sends", "due", "fields", "from_wire", "full_send", "gbuf", "gmem",
                 "head_send", "header", "idx", "mask", "pbuf", "pfields", "pmem", "ready",
                 "recvs", "seen", "segment", "sent", "to_wire", "versions", "words")

    def __init__(self, header: GradHeader, layout: ShardLayout, wire: ShardLayout, buckets,
                 wbuckets, comm, rank: int, tags: dict, shared=None, pinned: bool = False):
        self.header = header
        self.buckets = buckets
        h, ph = header.nbytes, PARAM_HEADER_BYTES
        self.segment = None
        if shared is not None:             # a ps rank of this machine: shared memory
            self.segment, i = shared
            self.gbuf = np.zeros(h, np.uint8)            # only the header travels
            self.pbuf = self.segment.params              # read from the ps's own buffer
            self.gmem = self.segment.slot(i)             # the gradients live there
            self.pmem = host_bytes(ph + layout.nbytes, pinned)
            self.ready, self.acks = self.segment.flags(i)
            # publications copied so far (a new segment starts at 0; the ps may have
            # published the first already), and what they will be once this pull's are in
            self.seen = [0] * len(buckets)
            self.due = [1] * len(buckets)
            self.copies = [(self.pmem[ph + b.offset:ph + b.offset + b.nbytes],
                            self.pbuf[ph + b.offset:ph + b.offset + b.nbytes])
                           for b in buckets]
            wire, wbuckets = layout, buckets
        else:
            self.gbuf = host_bytes(h + wire.nbytes, pinned)
            self.pbuf = host_bytes(ph + wire.nbytes, pinned)
            same = wire == layout
            self.gmem = self.gbuf[h:] if same else host_bytes(layout.nbytes, pinned)
            self.pmem = self.pbuf if same else host_bytes(ph + layout.nbytes, pinned)
        self.fields, self.words, self.codes, self.mask = header.views(self.gbuf)
        self.pfields = self.pbuf[:ph].view(np.int64)
        # each bucket's gradients are a tensor of their own: its version counter tells
        # whether they changed after the bucket was sent
        self.bases = [torch.from_numpy(self.gmem[b.offset:b.offset + b.nbytes]) for b in buckets]
        # tensors of their own too: converting into the model's parameters is no write
        # that the write tracker should see
        gwire = torch.from_numpy(self.gmem if self.segment else self.gbuf[h:])
        pwire = torch.from_numpy(self.pmem if self.segment else self.pbuf)[ph:]
        self.to_wire = conversions(buckets, wbuckets, torch.from_numpy(self.gmem), gwire,
                                   layout, wire, to_wire=True, push=True)
        self.from_wire = conversions(buckets, wbuckets, torch.from_numpy(self.pmem)[ph:], pwire,
                                     layout, wire, to_wire=False)
        # buffers travel both ways: their values into what is pushed, pulled into pmem
        self.buffer_pairs = list(zip(region_views(gwire, 0, wire.buffer_regions),
                                     region_views(torch.from_numpy(self.pmem), ph,
                                                  layout.buffer_regions)))
        self.head_send = comm.Send_init([self.gbuf[:h], MPI.BYTE], dest=rank, tag=tags[Tag.GRAD])
        self.data_sends, self.recvs, self.full_send = [], [], None
        if self.segment is None:
            self.data_sends = [comm.Send_init([self.gbuf[h + b.offset:h + b.offset + b.nbytes],
                                               MPI.BYTE], dest=rank, tag=tags[Tag.DATA])
                               for b in wbuckets]
            self.full_send = comm.Send_init([self.gbuf[h:], MPI.BYTE], dest=rank,
                                            tag=tags[Tag.FULL])
            self.recvs = [comm.Recv_init([self.pbuf[ph + b.offset:ph + b.offset + b.nbytes],
                                          MPI.BYTE], source=rank, tag=tags[Tag.PARAMS])
                          for b in wbuckets]
            self.recvs.append(comm.Recv_init([self.pbuf[:ph], MPI.BYTE], source=rank,
                                             tag=tags[Tag.PARAMS]))
        self.sent = 0                  # buckets sent so far in this push (a prefix)
        self.versions = [0] * len(buckets)
        self.abuf = None
        self.idx = np.zeros(0, np.int64)

    def send(self, k: int) -> None:
        """Start bucket ``k``'s send (on the wire's dtypes first)."""
        for dst, src in self.to_wire[k]:
            dst.copy_(src)
        self.data_sends[k].Start()

    def copy_published(self) -> bool:
        """Shared memory: copy the buckets the ps published since; whether every bucket
        of this pull is in (each pull that brings parameters brings each bucket once)."""
        ready, seen = self.ready, self.seen
        for k, (dst, src) in enumerate(self.copies):
            if seen[k] != int(ready[k]):
                seen[k] = int(ready[k])
                np.copyto(dst, src)     # raw memory: not a write the tracker should see
                self.acks[k] = seen[k]
        return seen == self.due

    def push(self, step: int, worker: int, seq: int, flags: int, has_grad: np.ndarray,
             resend: bool) -> None:
        """Start this push: the header (``has_grad`` of its parameters as the mask, the
        buffers' values), then the buckets not sent yet, in order, and with ``resend`` the
        buckets sent during backward again, with the whole region."""
        fields = self.fields
        fields[GradField.KIND], fields[GradField.STEP] = Kind.GRAD, step
        fields[GradField.WORKER], fields[GradField.SEQ] = worker, seq
        fields[GradField.FLAGS] = flags | (FLAG_RESEND if resend else 0)
        np.take(has_grad, self.idx, out=self.mask)
        for out, current in self.buffer_pairs:
            out.copy_(current)     # deliberate: the buffers' values travel with the step
        self.head_send.Start()
        for k in range(self.sent, len(self.data_sends)):
            self.send(k)
        if resend:
            for pairs in self.to_wire[:self.sent]:
                for dst, src in pairs:
                    dst.copy_(src)
            self.full_send.Start()

    def assignment(self, entries: list[int], step: int, worker: int, seq: int) -> np.ndarray:
        """The message that assigns the model's values of ``entries`` to the ps rank: the
        header, then every value as the model has it (one buffer, reused)."""
        if self.abuf is None:
            self.abuf = np.zeros(self.header.nbytes + self.gmem.nbytes, np.uint8)
        fields, _, _, mask = self.header.views(self.abuf)
        fields[GradField.KIND], fields[GradField.STEP] = Kind.ASSIGN, step
        fields[GradField.WORKER], fields[GradField.SEQ] = worker, seq
        mask[:] = 0
        mask[entries] = 1
        self.abuf[self.header.nbytes:] = self.pmem[PARAM_HEADER_BYTES:]
        return self.abuf

    def take_params(self, step: int, label: str, j: int) -> None:
        """The pulled parameters of ``step`` (this is ps ``j``) into the buffers the
        model's parameters live in, from the wire's dtypes.

        Raises:
            ProtocolError: the parameter header names another step.
        """
        sent = self.pfields[ParamField.STEP]
        if sent != step:
            raise ProtocolError(f"{label}: ps {j} sent parameters of step "
                                f"{int(sent)} with token {step}")
        for pairs in self.from_wire:
            for dst, src in pairs:
                dst.copy_(src)
