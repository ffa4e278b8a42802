"""A parameter that gets no gradient on some steps is skipped, as torch skips it."""
from __future__ import annotations

import sys

import torch
from common import emit


def run(distributed: bool) -> list[float]:
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.Adam([a, b], lr=0.1)
    if distributed:
        import mpisync

        cluster = mpisync.init()
        if cluster.is_ps:
            cluster.serve()
            return []
        opt = mpisync.SyncReplicasOptimizer(opt, named_parameters=[("a", a), ("b", b)],
                                            placement="round_robin")
    for step in range(8):
        opt.zero_grad()
        loss = (a ** 2).sum() + ((b ** 2).sum() if step % 2 else 0)
        loss.backward()
        opt.step()
    if distributed:
        opt.close()
    return [*a.tolist(), *b.tolist()]


if __name__ == "__main__":
    values = run(sys.argv[1] == "mpi")
    if values:
        emit(role="worker", worker=0, values=values, reference=run(False))
