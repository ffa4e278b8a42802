"""Bucket and shard layouts of a job, in memory and on the wire: the same on every rank.

A worker packs its pushes and reads its pulls by these layouts; a ps rank receives and
sends by them. Both sides compute them from the spec alone, with no messages.
"""
from __future__ import annotations

import torch

from .spec import JobSpec
from .wire import (
    Bucket,
    ShardLayout,
    bucket_layout,
    build_layouts,
    region_views,
    tensor_view,
    wire_buckets,
    wire_dtypes,
)

__all__ = ["buckets_of", "conversions", "layouts_of", "wire_layouts_of"]


def layouts_of(spec: JobSpec) -> list[ShardLayout]:
    """Every ps rank's layout for ``spec`` (the same on every rank)."""
    return build_layouts(list(spec.names), list(spec.shapes), list(spec.dtypes), spec.owners,
                         spec.num_ps, spec.buffers)


def wire_layouts_of(spec: JobSpec) -> list[ShardLayout]:
    """Every ps rank's layout on the wire: ``layouts_of`` unless ``spec.wire_dtype``."""
    if spec.wire_dtype is None:
        return layouts_of(spec)
    return build_layouts(list(spec.names), list(spec.shapes),
                         wire_dtypes(spec.dtypes, spec.wire_dtype), spec.owners, spec.num_ps,
                         spec.buffers)


def buckets_of(spec: JobSpec, layout: ShardLayout, wire: ShardLayout
               ) -> tuple[tuple[Bucket, ...], tuple[Bucket, ...]]:
    """One ps rank's buckets in memory and on the wire (the same on every rank)."""
    buckets = bucket_layout(layout, spec.bucket_bytes)
    return buckets, buckets if wire == layout else wire_buckets(buckets, wire)


def conversions(buckets, wbuckets, mem: torch.Tensor, wire: torch.Tensor, layout: ShardLayout,
                wire_layout: ShardLayout, to_wire: bool, push: bool = False
                ) -> list[list[tuple]]:
    """Per bucket, the (destination, source) views that carry it between the memory layout
    (``mem``: the bytes of its data region) and the wire's (``wire``), in the direction
    ``to_wire`` says; no pairs when the two are one buffer. (A worker writes the module
    buffers straight into what it pushes: no pairs for them towards the wire there.)"""
    if mem.data_ptr() == wire.data_ptr():
        return [[] for _ in buckets]
    out = []
    for b, w in zip(buckets, wbuckets):
        if b.buffers and to_wire and push:
            pairs = []
        elif b.buffers:
            pairs = list(zip(region_views(wire, 0, wire_layout.buffer_regions),
                             region_views(mem, 0, layout.buffer_regions)))
        else:
            pairs = [(tensor_view(wire, 0, w.dtype, w.offset, w.nbytes),
                      tensor_view(mem, 0, b.dtype, b.offset, b.nbytes))]
        out.append(pairs if to_wire else [(m, w) for w, m in pairs])
    return out
