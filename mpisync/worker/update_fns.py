"""The functions ``update()`` registers: agreed among the workers, run where parameters live."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ConfigError
from ..protocol.updates import ps_pieces, register, targets_of
from ..protocol.wire import Kind

__all__ = ["UpdateFunctions"]


class UpdateFunctions:
    """The registrations of ``SyncReplicasOptimizer.update()``: checked and agreed on every
    worker, handed to the ps ranks that own their targets, and to the ``LocalUpdate`` for
    the parameters the workers update (see ``mpisync.protocol.updates``)."""

    def __init__(self, spec, cluster, link, named: list[tuple[str, torch.Tensor]], local):
        self.spec, self.cluster, self.link, self.local = spec, cluster, link, local
        self.named = named
        self.registered: list = []        # on the ps ranks, and where the workers update
        self.on_ps = False                # whether the ps ranks run any

    def change(self, name_or_glob: str, fn: Callable | None, rows: str,
               receive: Callable[[], object]) -> None:
        """Register ``fn`` (None: remove) for ``name_or_glob``; collective over the workers.
        ``receive`` waits for ps 0's grant and the parameters that go with it."""
        from ..runtime.collectives import agree_call
        names = [n for n, _ in self.named]
        targets = targets_of(self.spec, {n: (tuple(p.shape), p.dtype) for n, p in self.named})
        frozen = [n for n in names if n not in targets]
        error, regs = None, self.registered
        try:
            regs = register(self.registered, name_or_glob, fn, rows, targets, frozen)
        except ConfigError as exc:
            error = str(exc)
        agree_call(self.cluster.helper_comm("update"), f"{self.cluster.label}: update()",
                   error, {"the number of registrations": str(len(regs)),
                           **{f"registration {i}": r.describe() for i, r in enumerate(regs)}})
        pieces = ps_pieces(regs, self.cluster.num_ps)
        if any(pieces) or self.on_ps:              # the ps ranks' functions change
            self.link.request(Kind.UPDATE, pieces)
            self.link.load_answer("update()")       # an error: every worker hears it
            receive()                               # a grant: go on with these parameters
            self.on_ps = any(pieces)
        by_name = dict(self.named)
        self.registered = regs
        local_updates = [(r.fn, t.tensor, by_name[t.tensor])
                         for r in regs for t in r.targets if t.ps is None]
        if self.local is not None:                  # where the workers update
            self.local.updates = local_updates
