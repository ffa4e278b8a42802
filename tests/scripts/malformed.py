"""A worker sends a ps rank a message that does not fit (on mpisync's own communicator, as
a bug or a stray program would): the ps must refuse it with a ProtocolError, and the job end
on every rank, not overrun a buffer or hang."""
from __future__ import annotations

import numpy as np
import torch
from common import dataset, make_optimizer, model, run
from mpi4py import MPI

import mpisync
from mpisync.protocol.wire import Tag


def worker(cluster):
    net = model()
    opt = mpisync.SyncReplicasOptimizer(make_optimizer("sgd", net.parameters()),
                                        named_parameters=net.named_parameters())
    x, y = dataset(64, seed=cluster.worker_index)
    for i in range(50):
        if i == 3 and cluster.is_chief:     # a gradient message 4 KiB too long
            size = opt._dense.shards[0].gbuf.nbytes + 4096
            cluster.p2p_comm.Send([np.zeros(size, np.uint8), MPI.BYTE],
                                  dest=cluster.ps_rank(0), tag=Tag.of(Tag.GRAD, 0))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[:16]), y[:16]).backward()
        opt.step()
    opt.close()
    return {"global_step": opt.global_step}


if __name__ == "__main__":
    run(worker)
