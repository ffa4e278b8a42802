"""The recommender-scale benchmark's mpisync side, in one process: its byte count and a
few small steps of one plain process (the job of mpisync's ranks:
tests/mpi/test_recsys_bench_jobs.py).

TorchRec is not installed here (``make venv-peers`` puts it in its own virtualenv).
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from shared_recsys import ROOT, SMALL, run

from mpisync.protocol.rowsmsg import pack_rows

sys.path.insert(0, str(ROOT / "benchmarks"))
import recsys_bench


def test_rows_bytes_are_the_sizes_of_the_messages_mpisync_packs():
    ids = np.unique(np.random.default_rng(0).integers(0, 1000, 300))
    for num_ps in (1, 2, 3):
        want = {"lookup_ids_sent": 0, "lookup_rows_received": 0, "rows_pushed": 0}
        for j in range(num_ps):
            local = torch.from_numpy(ids[ids % num_ps == j] // num_ps)
            rows = torch.zeros(len(local), recsys_bench.DIM)
            if len(local):
                want["lookup_ids_sent"] += pack_rows(-1, 0, [(local, None)]).nbytes
                want["lookup_rows_received"] += pack_rows(0, 0, [(None, rows)]).nbytes
            want["rows_pushed"] += pack_rows(3, 4, [(local, rows)]).nbytes
        assert recsys_bench.rows_bytes(ids, num_ps) == want, num_ps


def test_one_process_run_reports_its_figures():
    got = run([sys.executable, "benchmarks/recsys_bench.py", "--kind", "local", *SMALL],
              timeout=60)
    assert got["batch"] == 128 and got["step_ms"] > 0 and got["peak_rss_mb"] > 0, got
