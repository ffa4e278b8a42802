"""The recommender-scale benchmark's mpisync side: its byte count and a few small steps.

TorchRec is not installed here (``make venv-peers`` puts it in its own virtualenv); only
what mpisync and one plain process run is tested.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mpisync.protocol.wire import pack_rows

ROOT = Path(__file__).resolve().parents[1]
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


def run(command: list[str], timeout: float) -> dict:
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1",
                                             MPISYNC_TIMEOUT="60"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


SMALL = ["--rows", "5000", "--batch", "64", "--steps", "3", "--warmup", "1"]


@pytest.mark.slow      # 9 s on the quiet 2-core machine, 17 s on a busy one
def test_mpisync_run_reports_its_figures():
    got = run([sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
               "--timeout", "80", "--", sys.executable, "benchmarks/recsys_bench.py",
               "--kind", "mpisync", *SMALL], timeout=100)
    assert got["global_step"] == 4 and got["workers"] == 2 and got["ps"] == 1, got
    assert {"lookup", "head_loss", "backward", "opt_step"} <= set(got["phases_ms"]), got
    check = got["bytes_check"]
    assert check["stats_change"] == check["formula_change"], got
    moved = got["bytes_per_step"]
    assert moved["rows_pushed"] >= 264 * got["unique_ids_per_step"] > 0, got
    assert len(got["worker_peak_rss_mb"]) == 2 and len(got["ps_peak_rss_mb"]) == 1, got
    assert got["step_ms"] > 0 and "optimizer_step" in got["ps_profile_ms_per_call"][0], got


@pytest.mark.slow      # as the one above
def test_mpisync_pooled_run_counts_its_bytes():
    got = run([sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
               "--timeout", "80", "--", sys.executable, "benchmarks/recsys_bench.py",
               "--kind", "mpisync", "--pool-on-ps", *SMALL], timeout=100)
    assert got["global_step"] == 4 and got["pool_on_ps"] is True, got
    moved = got["bytes_per_step"]
    # 64 bags of 20 ids: each id and its bag out twice, 64 pooled rows back and out
    assert moved["lookup_received"] == 64 * 256, got
    assert moved["lookup_sent"] >= 16 * 64 * 20, got
    assert moved["pushed"] >= 16 * 64 * 20 + 64 * 256, got
    # the rows path sends 8 + 264 bytes a unique id (lookup, push): pooled, a third at most
    assert 3 * moved["worker_sent"] < 272 * got["unique_ids_per_step"], got


def test_one_process_run_reports_its_figures():
    got = run([sys.executable, "benchmarks/recsys_bench.py", "--kind", "local", *SMALL],
              timeout=60)
    assert got["batch"] == 128 and got["step_ms"] > 0 and got["peak_rss_mb"] > 0, got
