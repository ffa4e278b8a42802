"""The recommender-scale benchmark's mpisync side under mpisync's launcher: a few small
steps of 2 workers and 1 ps rank (its byte count and one plain process:
tests/unit/test_recsys_bench.py).

TorchRec is not installed here (``make venv-peers`` puts it in its own virtualenv).
"""
from __future__ import annotations

import sys

import pytest
from shared_recsys import SMALL, run


@pytest.mark.slow      # 9 s on the quiet 2-core machine, 17 s on a busy one
def test_mpisync_run_reports_its_figures():
    got = run([sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
               "--timeout", "80", "--", sys.executable, "benchmarks/recsys_bench.py",
               "--kind", "mpisync", "--pool-on-ps", "off", *SMALL], timeout=100)
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
               "--kind", "mpisync", *SMALL], timeout=100)
    # the library's default, "auto", pools bags of 20 ids that rarely repeat
    assert got["global_step"] == 4 and got["pool_on_ps"] == "auto" and got["pooled"], got
    moved = got["bytes_per_step"]
    # 64 bags of 20 ids: each id out once, at the lookup, with the bags' 65 offsets (the
    # bags come in order); 64 pooled rows back; the push names the lookup (3 words) before
    # the 64 gradient rows, after a rows message of no rows (the header and a count)
    ids_out = 8 * 64 * 20 + 8 * 65
    assert moved["lookup_received"] == 64 * 256, got
    assert moved["lookup_sent"] == ids_out + 8 * 6, got
    assert 64 * 256 + 8 * 3 < moved["pushed"] <= 64 * 256 + 8 * 3 + 256, got
    # the rows path sends 8 + 264 bytes a unique id (lookup, push): pooled, a third at most
    assert 3 * moved["worker_sent"] < 272 * got["unique_ids_per_step"], got
