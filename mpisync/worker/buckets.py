"""Gradient hooks that hand over buckets of parameters as backward fills them (no MPI)."""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["GradBuckets"]


class GradBuckets:
    """Backward's gradients, bucket by bucket, the way DDP and Horovod start their sends.

    ``buckets[k]`` lists the parameters of bucket ``k`` (a parameter may count toward
    several, e.g. the shards of a partitioned one). Each bucket has a lane, and the buckets
    of one lane are handed out in index order: ``on_full(k)`` runs once bucket ``k`` is
    full and every earlier bucket of its lane was handed out (a collective needs every
    worker to start its buckets in one order; a ps rank receives a worker's buckets in
    order). A bucket is full when each of its parameters that takes gradients has
    accumulated one in this backward pass (``register_post_accumulate_grad_hook``); one
    holding a parameter that had no hook yet (frozen when hooked, unfrozen since) fills
    only at backward's end. At backward's end ``on_end()`` runs (torch's engine callback).
    ``on_again(k, param)`` runs when a parameter gets a second gradient in one backward,
    ``on_hook(handed_out)`` after every hook (whether it handed a bucket out).

    ``backwards`` counts the backward passes since ``new_step()``.
    """

    def __init__(self, buckets: list[list[torch.Tensor]], lanes: list[int],
                 on_full: Callable[[int], None], on_end: Callable[[], None],
                 on_again: Callable[[int, torch.Tensor], None] | None = None,
                 on_hook: Callable[[bool], None] | None = None):
        self.buckets = buckets
        self.lanes = lanes
        self.order = {lane: [k for k, b in enumerate(buckets) if lanes[k] == lane]
                      for lane in dict.fromkeys(lanes)}
        self.on_full, self.on_end = on_full, on_end
        self.on_again, self.on_hook = on_again, on_hook
        self.of_param: dict[int, list[int]] = {}
        for k, params in enumerate(buckets):
            for p in params:
                self.of_param.setdefault(id(p), []).append(k)
        self.left = [0] * len(buckets)
        self.started = [False] * len(buckets)
        self.next = dict.fromkeys(self.order, 0)     # per lane: index into its order
        self.in_backward = False
        self.backwards = 0
        self.fired: set[int] = set()
        self.hooked: set[int] = set()
        self.hooks: list = []
        # the parameters without a hook yet: only these are looked at again
        self.unhooked = list({id(p): p for params in buckets for p in params}.values())
        self.hook_new()

    def hook_new(self) -> None:
        """Hooks on the parameters that take gradients now (a frozen one gets its hook
        once it is unfrozen; until then its buckets wait for backward's end)."""
        if not self.unhooked:
            return
        still = []
        for p in self.unhooked:
            if p.requires_grad:
                self.hooked.add(id(p))
                self.hooks.append(p.register_post_accumulate_grad_hook(self._ready))
            else:
                still.append(p)
        self.unhooked = still

    def new_step(self) -> None:
        """The step's first backward is still to come."""
        self.backwards = 0

    def begin(self) -> None:
        """A backward pass starts (its first gradient is in, or the caller knows)."""
        self.in_backward = True
        self.backwards += 1
        self.fired.clear()
        for k, params in enumerate(self.buckets):
            if any(p.requires_grad and id(p) not in self.hooked for p in params):
                self.left[k] = len(params) + 1          # never full before the end
            else:
                self.left[k] = sum(1 for p in params if p.requires_grad)
        self.reset()
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def reset(self) -> None:
        """No bucket is handed out yet."""
        self.started = [False] * len(self.buckets)
        self.next = dict.fromkeys(self.order, 0)

    def _ready(self, param: torch.Tensor) -> None:
        if not self.in_backward:
            self.begin()
        ks = self.of_param[id(param)]
        if id(param) in self.fired:        # a second time in one backward
            if self.on_again is not None:
                self.on_again(ks[0], param)
            return
        self.fired.add(id(param))
        handed = False
        for k in ks:
            self.left[k] -= 1
            if self.left[k] <= 0:
                handed |= self._hand_out(self.lanes[k])
        if self.on_hook is not None:
            self.on_hook(handed)

    def _hand_out(self, lane: int, every: bool = False) -> bool:
        """Hand out the lane's next buckets while they are full (``every``: all that are
        left); whether any was."""
        order, handed = self.order[lane], False
        while self.next[lane] < len(order) and (every or self.left[order[self.next[lane]]] <= 0):
            k = order[self.next[lane]]
            self.next[lane] += 1
            self.started[k] = True
            self.on_full(k)
            handed = True
        return handed

    def flush(self) -> None:
        """Hand out every bucket not handed out yet, lane by lane in order."""
        for lane in self.order:
            self._hand_out(lane, every=True)

    def _end(self) -> None:
        self.in_backward = False
        self.on_end()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
