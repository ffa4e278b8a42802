"""Each rank reports what init() found out about its node and machine, and its waits' spin."""
from __future__ import annotations

import os

from common import emit, make_optimizer, model

import mpisync

cluster = mpisync.init()
if cluster.is_ps:
    cluster.serve()
    spin = None
else:
    net = model()
    opt = mpisync.SyncReplicasOptimizer(make_optimizer("sgd", net.parameters()),
                                        named_parameters=net.named_parameters())
    spin = opt._poller.spin
    opt.close()
emit(rank=cluster.rank, local_ranks=cluster.local_ranks, local_cores=cluster.local_cores,
     oversubscribed=cluster.oversubscribed, affinity=sorted(os.sched_getaffinity(0)), spin=spin,
     nodes=list(cluster.nodes), host=cluster.host, ps_ranks=list(cluster.layout.ps_ranks),
     device=str(cluster.device), cuda_aware=cluster.cuda_aware)
