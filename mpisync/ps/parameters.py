"""One shard's parameters on its ps rank: their buffers, their optimizer, what a step does."""
from __future__ import annotations

import numpy as np
import torch

from ..accumulate import ShardAccumulator
from ..native import kernels, torchstep
from ..protocol.layouts import conversions
from ..protocol.multi import sole_holder
from ..protocol.spec import JobSpec
from ..protocol.wire import (
    PARAM_HEADER_BYTES,
    Bucket,
    GradHeader,
    Kind,
    ParamField,
    ShardLayout,
    entry_views,
    region_views,
)
from .fused import Applier, only_params
from .slots import Slot, bucket_views, graded_dtype

__all__ = ["ShardParameters"]


class ShardParameters:
    """One ps rank's shard of one optimizer's parameters, and the arithmetic of a step.

    Holds the parameter buffer and its views (``param_buf``; ``send_buf``, what is sent to
    the workers: the parameter buffer itself unless ``wire_dtype``), the reduced-gradient
    buffer and its views, the optimizer rebuilt over the parameters (and the table shards'
    of ``rows``) with its ``Applier``. A step's parts are its methods: reduce a bucket's
    taken gradients (``reduce``), find non-finite ones (``nonfinite``), take the workers'
    writes (``assign``) and module buffers (``update_buffers``), step what the buckets did
    not (``step_rest``); and the optimizer state out and in (``state``, ``load``).
    """

    def __init__(self, spec: JobSpec, layout: ShardLayout, wire: ShardLayout,
                 buckets: tuple[Bucket, ...], wbuckets: tuple[Bucket, ...], segment, rows,
                 acc: ShardAccumulator, header: GradHeader):
        # ``segment``: the shared memory, whose parameter buffer is this one (None: none)
        self.spec, self.layout, self.buckets = spec, layout, buckets
        self.rows, self.acc, self.header = rows, acc, header
        self.param_buf = (np.zeros(PARAM_HEADER_BYTES + layout.nbytes, np.uint8)
                          if segment is None else segment.params)
        self.send_buf = self.param_buf if wire == layout else np.zeros(
            PARAM_HEADER_BYTES + wire.nbytes, np.uint8)
        self.param_fields = self.send_buf[:PARAM_HEADER_BYTES].view(np.int64)
        pt = torch.from_numpy(self.param_buf)
        self.to_wire = conversions(buckets, wbuckets, pt[PARAM_HEADER_BYTES:],
                                   torch.from_numpy(self.send_buf)[PARAM_HEADER_BYTES:],
                                   layout, wire, to_wire=True)
        self.data = pt[PARAM_HEADER_BYTES:]
        self.param_views = entry_views(pt, PARAM_HEADER_BYTES, layout.entries)
        self.params = [torch.nn.Parameter(v, requires_grad=v.dtype.is_floating_point)
                       for v in self.param_views]
        self.buffer_regions = region_views(pt, PARAM_HEADER_BYTES, layout.buffer_regions)
        self.grad_buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.grads = entry_views(self.grad_buf, 0, layout.entries)
        self.grad_views = bucket_views(self.grad_buf, buckets)
        part_of = dict(zip(spec.names, spec.parts))
        by_param: dict[str, list[torch.Tensor]] = {}
        for e, p in zip(layout.entries, self.params):
            by_param.setdefault(part_of[e.name][0], []).append(p)
        by_param.update(rows.params_by_name())
        self.optimizer = spec.recipe.build(by_param)
        rows.place_state(self.optimizer)
        self.name_of = {id(p): e.name for e, p in zip(layout.entries, self.params)}
        self.name_of.update(rows.names())
        self.table_params = self._table_params()
        regions = layout.regions
        places = []
        for e in layout.entries:
            r = next(k for k, (d, off, n) in enumerate(regions)   # (an empty one: n == 0)
                     if d == e.dtype and off <= e.offset <= off + n)
            size = e.dtype.itemsize
            a = (e.offset - regions[r][1]) // size
            places.append((r, a, a + e.nbytes // size))
        self.applier = Applier(      # a joint optimizer's: that of the dense parameters here
            sole_holder(self.optimizer, self.params), self.params, self.grads, places,
            region_views(pt, PARAM_HEADER_BYTES, regions),
            [v if graded_dtype(v.dtype) else None
             for v in region_views(self.grad_buf, 0, regions)],
            [range(b.first, b.stop) for b in buckets])

    def hold(self, updating: bool) -> None:
        """Whether the applier steps whole, sending parameters only once all are stepped:
        with ``nonfinite="skip"`` (a step is skipped whole or applied whole) and while
        ``opt.update()`` functions run after each step (``updating``: the workers get their
        results)."""
        hold = self.spec.nonfinite == "skip" or updating
        if hold != self.applier.hold:
            self.applier.hold = hold
            self.applier.sync()

    def _table_params(self) -> list[list[torch.Tensor]]:
        """Per param group, the table shards' parameters it holds here."""
        if self.optimizer is None or not self.rows.active:
            return []
        mine = set(self.rows.names())
        return [[p for p in g["params"] if id(p) in mine] for g in self.optimizer.param_groups]

    def set_version(self, step: int) -> None:
        """The version the workers read in the parameters' header: ``step``."""
        self.param_fields[ParamField.KIND] = Kind.PARAMS
        self.param_fields[ParamField.STEP] = step

    def to_wire_all(self) -> None:
        """Every bucket's parameters onto the wire's dtypes (where ``wire_dtype``)."""
        for pairs in self.to_wire:
            for dst, src in pairs:
                dst.copy_(src)

    # -- a step ---------------------------------------------------------------------------
    def reduce(self, b: Bucket, chosen: list[Slot]) -> tuple[bool, bool]:
        """Bucket ``b``'s taken gradients into the reduced ones: (whether that found every
        element finite, whether it stepped the bucket's parameters too). The compiled pass
        (a mean over a power of two, or a sum) checks finiteness, and for SGD, Adam, AdamW,
        Adagrad and RMSprop steps the parameters in it (``Applier.compiled_step``); with
        non-finite gradients and ``nonfinite="raise"`` the job ends with the error, as when
        a bucket before it was stepped already."""
        out = self.grad_views[b.index]
        if out is None or self.optimizer is None:
            return False, False
        grads = [s.views[b.index] for s in chosen]
        n = len(grads)
        mean = self.acc.reduction == "mean" and n > 1
        if kernels.available(out) and all(g.dtype == out.dtype for g in grads) and \
                (not mean or n & (n - 1) == 0):
            step = self.applier.compiled_step(b.index, out) if mean else None
            if step is not None:
                return step(grads), True
            return kernels.dense_mean(out, grads, mean), False
        self.acc.reduce([out], [[g] for g in grads], n)
        return False, False

    def step_rest(self, chosen: list[Slot]) -> None:
        """What the buckets did not step: the table shards, and every parameter where the
        applier steps whole."""
        if self.rows.active:
            self.rows.set_grads(chosen, self.optimizer)
        if self.applier.steps_whole:
            torchstep.step(self.optimizer)
        elif self.rows.active:
            with only_params(self.optimizer, self.table_params):
                torchstep.step(self.optimizer)
        if self.rows.active:
            self.rows.apply_rows(self.optimizer)

    def nonfinite(self, views, first: int, stop: int) -> list[int]:
        """Parameters ``[first, stop)`` whose reduced gradient holds NaN or Inf: one sum of
        each of ``views`` (their reduced gradients) first, as NaN and Inf stay in a sum;
        only when one is not finite, parameter by parameter."""
        if all(v is None or torch.isfinite(v.sum()) for v in views):
            return []
        present = self.applier.present
        return [i for i in range(first, stop) if present[i] and self.grads[i] is not None
                and graded_dtype(self.grads[i].dtype) and not torch.isfinite(
                    self.grads[i]).all()]

    def assign(self, chosen: list[Slot]) -> None:
        """Each written parameter takes the value of the lowest-index worker that wrote it."""
        done = set()
        for slot in chosen:                 # worker order, then arrival
            if slot.assign is None:
                continue
            _, _, _, mask = self.header.views(slot.assign)
            written = entry_views(torch.from_numpy(slot.assign), self.header.nbytes,
                                  self.layout.entries)
            for i in np.flatnonzero(mask):
                if i not in done:
                    self.param_views[i].copy_(written[i])
                    done.add(i)

    def update_buffers(self, chosen: list[Slot]) -> None:
        """Module buffers: the lowest-index worker's values, or their mean ("mean")."""
        mean = self.spec.buffer_mode == "mean" and len(chosen) > 1
        for r, out in enumerate(self.buffer_regions):
            if mean and out.dtype.is_floating_point:
                self.acc.reduce([out], [[s.buffers[r]] for s in chosen], len(chosen),
                                reduction="mean")
            else:
                out.copy_(chosen[0].buffers[r])

    # -- optimizer state ------------------------------------------------------------------
    def state(self) -> dict:
        """This shard's optimizer state, keyed by unit name (tables on the ps: not here)."""
        if self.optimizer is None:
            return {}
        resident = self.rows.resident_units()
        return {self.name_of[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v)
                                      for k, v in s.items()}
                for p, s in self.optimizer.state.items() if self.name_of[id(p)] not in resident}

    def groups(self) -> list[dict]:
        """The optimizer's param groups' settings (without their parameters)."""
        return [] if self.optimizer is None else [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def values(self) -> dict[str, torch.Tensor]:
        """``{name: value}`` of this shard's dense parameters, copies."""
        return {self.name_of[id(p)]: p.detach().clone() for p in self.params}

    def load(self, piece: dict) -> None:
        """Load optimizer state for this shard's parameters (``{name: state}``); the table
        shards' resident state is kept."""
        if self.optimizer is None:
            return
        sd = self.optimizer.state_dict()
        order = [self.name_of[id(p)] for g in self.optimizer.param_groups
                 for p in g["params"]]
        index = {name: i for i, name in enumerate(order)}
        resident = {index[n] for n in self.rows.resident_units()}
        kept = {i: s for i, s in sd["state"].items() if i in resident}
        sd["state"] = {index[n]: s for n, s in piece["state"].items()}
        sd["state"].update(kept)
        for group, saved in zip(sd["param_groups"], piece["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.load_state_dict(sd)
        self.applier.sync()
