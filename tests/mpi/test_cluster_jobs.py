"""What init() finds out about the ranks' nodes and machine, in jobs on this machine: the
ranks per machine against its cores and the wait spin, two names of one machine, and a
finalize that waits on a peer (the pure parts: tests/unit/test_cluster.py)."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
from mpi_helpers import _launcher, run_mpi

from mpisync.runtime.progress import SPIN_DEDICATED, SPIN_SHARED

# --- several ranks -------------------------------------------------------------------------


@pytest.fixture
def no_node_names(monkeypatch):
    """No node names from outside (a Slurm job, a map): the ranks find their own."""
    for name in ("MPISYNC_NODE", "SLURMD_NODENAME", "MPISYNC_HOSTMAP", "MPISYNC_PS_LAYOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_ranks_count_cores_of_their_host_and_pick_the_spin(monkeypatch, no_node_names):
    monkeypatch.delenv("MPISYNC_POLL_SPIN_US", raising=False)
    run = run_mpi("hostinfo.py", 2, 1)
    records = sorted(run.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1, 2]
    cores = set().union(*(r["affinity"] for r in records))
    for r in records:
        assert r["local_ranks"] == 3              # one host
        assert r["local_cores"] == len(cores)
        assert r["oversubscribed"] == (3 > len(cores))
        assert r["nodes"] == [socket.gethostname()] * 3 and r["ps_ranks"] == [2]
        if not torch.cuda.is_available():         # no GPU: every rank computes on the CPU
            assert (r["device"], r["cuda_aware"]) == ("cpu", False), r
    expected = SPIN_SHARED if len(cores) < 3 else SPIN_DEDICATED
    assert [r["spin"] for r in records[:2]] == [expected, expected]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_two_names_of_this_machine_are_two_nodes_where_mpiexec_makes_them_so(no_node_names):
    run = run_mpi("hostinfo.py", 2, 2, hosts="localhost:2,127.0.0.1:2")
    records = sorted(run.results, key=lambda r: r["rank"])
    for r in records:
        assert r["local_ranks"] == 4              # one machine, whatever the node names
    if _launcher()[1] == "openmpi":               # mpirun merges names of one machine
        assert records[0]["nodes"] == [socket.gethostname()] * 4, run.describe()
        assert "MPISYNC_HOSTMAP puts ranks 0 and 2" in run.output, run.describe()
        assert records[0]["ps_ranks"] == [2, 3]
    else:                                         # Hydra starts one proxy per name
        assert records[0]["nodes"] == ["localhost"] * 2 + ["127.0.0.1"] * 2, run.describe()
        assert records[0]["ps_ranks"] == [1, 3]   # one ps on each
        assert [r["host"] for r in records] == records[0]["nodes"]


def test_a_finalize_that_waits_on_a_peer_ends_after_the_grace():
    """mpi4py's ``MPI.Finalize`` holds the GIL while it waits, so a timer thread could
    never end it; ``finalize_within`` calls it with the GIL let go: the rank exits with
    its code after the grace, and the job with it, long before the peer would come."""
    start = time.monotonic()
    run = run_mpi("finalize_grace.py", workers=1, ps=1, timeout=50, expect_ok=False)
    assert run.returncode != 0 and time.monotonic() - start < 40, run.describe()
    assert [r["role"] for r in run.results] == ["finalizing"], run.describe()

