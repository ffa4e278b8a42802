"""What init() finds out about the host: ranks per host against cores, and the wait spin."""
from __future__ import annotations

import os

import pytest
from mpi_helpers import run_mpi

from mpisync.progress import SPIN_DEDICATED, SPIN_SHARED


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_ranks_count_cores_of_their_host_and_pick_the_spin(monkeypatch):
    monkeypatch.delenv("MPISYNC_POLL_SPIN_US", raising=False)
    run = run_mpi("hostinfo.py", 2, 1)
    records = sorted(run.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1, 2]
    cores = set().union(*(r["affinity"] for r in records))
    for r in records:
        assert r["local_ranks"] == 3              # one host
        assert r["local_cores"] == len(cores)
        assert r["oversubscribed"] == (3 > len(cores))
    expected = SPIN_SHARED if len(cores) < 3 else SPIN_DEDICATED
    assert [r["spin"] for r in records[:2]] == [expected, expected]
