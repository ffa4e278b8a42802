"""The DLRM benchmark in one process: its defaults (examples/dlrm.py's optimizers), the
driver's jobs and summary, and a few tiny steps of the one-process run (the mpisync job:
tests/mpi/test_dlrm_bench_jobs.py).

TorchRec is not installed here (``make venv-peers`` puts it in its own virtualenv).
"""
from __future__ import annotations

import sys

from shared_recsys import ROOT, run

sys.path.insert(0, str(ROOT / "benchmarks"))
import dlrm_bench

TINY = ["--tables", "3", "--rows", "200", "--dim", "8", "--batch", "32", "--steps", "2",
        "--warmup", "1"]


def test_defaults_are_the_examples_optimizers_on_26_tables_of_64_wide_rows():
    args = dlrm_bench.parse_args([])
    assert (args.optimizer, args.lr, args.dense_lr) == ("adam+rowwise", 0.05, 0.003)
    assert (args.tables, args.rows, args.dim) == (26, 100_000, 64)


def test_driver_runs_two_mpisync_jobs_torchrec_and_one_process_with_the_same_flags():
    args = dlrm_bench.parse_args([*TINY, "--optimizer", "adagrad", "--all"])
    jobs = dict(dlrm_bench.configurations(args, peers=True))
    assert list(jobs) == ["mpisync_2w1p", "mpisync_2w2p", "torchrec", "local"]
    for name, command in jobs.items():
        tail = command[command.index("--kind"):]
        assert tail[1] == name.split("_")[0], command
        assert " ".join(TINY) in " ".join(tail), command
        assert tail[tail.index("--optimizer") + 1] == "adagrad", command
    assert [jobs[n][jobs[n].index("--ps") + 1] for n in ("mpisync_2w1p", "mpisync_2w2p")] \
        == ["1", "2"]
    assert jobs["torchrec"][0] == dlrm_bench.PEERS_PYTHON
    assert "torchrec" not in dict(dlrm_bench.configurations(args, peers=False))


def test_summary_gives_mpisyncs_step_over_the_others_and_keeps_failures():
    mine = {"kind": "mpisync", "step_ms": 30.0, "step_ms_p10": 25.0, "step_ms_p90": 40.0,
            "peak_rss_mb": [1, 2, 3], "worker_peak_rss_mb": [1, 2], "ps_peak_rss_mb": [3],
            "bytes_per_step": {"worker_sent": 10, "worker_received": 20}}
    other = {"kind": "torchrec", "step_ms": 40.0, "step_ms_p10": 35.0, "step_ms_p90": 50.0,
             "peak_rss_mb": [4, 5]}
    got = dlrm_bench.summary({"mpisync_2w1p": mine, "mpisync_2w2p": {"error": "exit 1"},
                              "torchrec": other, "local": {**other, "step_ms": 60.0}})
    assert got["mpisync_step_ratios"] == {"mpisync_2w1p": {"over_torchrec": 0.75,
                                                           "over_local": 0.5}}
    assert got["jobs"]["mpisync_2w2p"] == {"error": "exit 1"}
    assert got["jobs"]["mpisync_2w1p"]["bytes_sent_per_worker"] == 10
    assert got["jobs"]["torchrec"]["peak_rss_mb"] == [4, 5]


def test_one_process_run_steps_adam_and_rowwise_adagrad():
    got = run([sys.executable, "benchmarks/dlrm_bench.py", "--kind", "local", *TINY],
              timeout=120)
    assert got["optimizers"] == ["Adam", "RowWiseAdagrad"], got
    assert got["tables"] == 3 and got["step_ms"] > 0 and len(got["peak_rss_mb"]) == 1, got
