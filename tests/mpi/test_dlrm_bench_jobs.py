"""The DLRM benchmark's mpisync side under mpisync's launcher: a few tiny steps of 2
workers and 1 ps rank (the one-process run and the driver: tests/unit/test_dlrm_bench.py).
"""
from __future__ import annotations

import sys

from shared_recsys import run

TINY = ["--tables", "3", "--rows", "200", "--dim", "8", "--batch", "32", "--steps", "2",
        "--warmup", "1"]


def test_mpisync_run_steps_the_examples_optimizers_and_counts_its_bytes(monkeypatch):
    # the dense gradients in the push (through shared memory only its header is counted)
    monkeypatch.setenv("MPISYNC_SHARED_MEMORY", "0")
    got = run([sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
               "--timeout", "80", "--", sys.executable, "benchmarks/dlrm_bench.py",
               "--kind", "mpisync", *TINY], timeout=100)
    # the default: Adam for the MLPs and RowWiseAdagrad for the tables, in one optimizer
    assert got["optimizer"] == "adam+rowwise", got
    assert got["optimizers"] == ["Adam", "RowWiseAdagrad"], got
    assert got["workers"] == 2 and got["ps"] == 1 and got["step_ms"] > 0, got
    assert len(got["worker_peak_rss_mb"]) == 2 and len(got["ps_peak_rss_mb"]) == 1, got
    moved = got["bytes_per_step"]
    # the last warm-up step's bytes and the last timed step's
    assert moved["steps_counted"] == 2, got
    # the push holds the MLPs' gradients and more; every table is looked up
    assert moved["pushed"] > moved["dense_params"] > 0, got
    assert moved["lookup_sent"] > 0 and moved["lookup_received"] > 0, got
