"""Watching a job: the statistics log, the timeline and the chief's progress display.

One job (3 workers, 1 ps rank, ``MPISYNC_STATS`` set) trains with a sleeping backup
worker, its progress shown in lines, then with the chief's progress bar on a terminal;
the timeline, which records all of a job, has a job of its own. The parts that need no
job run in one process (tests/unit/test_observability.py).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi_helpers import SCRIPTS, run_mpi

from mpisync.stats import read, render

sys.path.insert(0, str(SCRIPTS))
from training_cases import case


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """The job's output, its workers' records by case, and where the log and the terminal
    went. The statistics log is the first optimizer's, ``MPISYNC_STATS`` itself."""
    out = tmp_path_factory.mktemp("watched")
    path, tty = out / "stats.jsonl", out / "tty.out"
    specs = [case("stats", "--replicas", 2, "--laggard", 2, "--sleep", 0.03, "--steps", 25,
                  "--progress", "--every", 5),
             case("tty", "--steps", 30, "--progress", "--tty", tty)]
    run = run_mpi("observe.py", 3, 1, [a for s in specs for a in ("--case", s)],
                  env={"MPISYNC_STATS": str(path)}, timeout=120 + 30 * len(specs))
    return run, run.assert_every_case_ran(["stats", "tty"], 3, lambda name: None), path, tty


def test_statistics_log_accounts_for_every_gradient_with_a_sleeping_backup(tmp_path, watched):
    png = tmp_path / "stats.png"
    run, by_case, path, _ = watched
    workers = by_case["stats"]
    job, lines = read(str(path))
    assert (job["num_workers"], job["num_ps"], job["replicas_to_aggregate"]) == (3, 1, 2)
    # taken + dropped over the log is every gradient each worker pushed, each once
    for w, rec in workers.items():
        assert sum(p["worker"] == w for line in lines for p in line["pushes"]) == rec["pushes"]
    applied = [line for line in lines if line["applied"]]
    assert [line["step"] for line in applied] == list(range(len(applied)))
    assert len(applied) == workers[0]["global_step"]
    for line in applied:
        assert len(line["taken"]) == 2 and len(set(line["taken"])) == 2, line
        for p in line["pushes"]:
            assert p["at"] == line["step"] if p["taken"] else p["at"] <= line["step"], line
        assert line["step_ms"] > 0 and line["decide_ms"] >= 0 and line["apply_ms"][0] >= 0
        assert line["bytes_in"][0] > 0 and line["bytes_out"][0] > 0
    assert all(not line["taken"] for line in lines if not line["applied"])
    # every push carries its worker's timings; the sleeping worker's compute shows the sleep
    pushes = [p for line in lines for p in line["pushes"]]
    assert all(p[k] is not None for p in pushes
               for k in ("compute_ms", "push_ms", "wait_ms", "pull_ms")), pushes
    lag = [p["compute_ms"] for p in pushes if p["worker"] == 2]
    assert np.median(lag) >= 30, lag
    assert sum(not p["taken"] for p in pushes if p["worker"] == 2) > 0
    # the reader agrees with opt.stats
    final = workers[0]
    try:
        import matplotlib  # noqa: F401
        plot = ["--png", str(png)]
    except ImportError:
        plot = []
        print("not checking the PNG: matplotlib is not installed (pip install matplotlib)")
    out = subprocess.run([sys.executable, "-m", "mpisync.stats", str(path), "--json", *plot],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["taken_per_worker"] == final["taken_per_worker"]
    assert summary["dropped_per_worker"] == final["dropped_per_worker"]
    assert summary["gradients_applied"] == final["gradients_applied"]
    assert summary["gradients_dropped"] == final["gradients_dropped"]
    assert "gradients: " in render(str(path), summary)
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # output is not a terminal: plain progress lines, from the chief only
    shown = re.findall(r"\[mpisync\] train: step (\d+)/25  global step (\d+)  loss [0-9.]+  "
                       r"[0-9.]+ steps/s  \d+ examples/s  elapsed", run.output)
    chief = workers[0]["pushes"]          # 25, or fewer if a step went on without it
    expected = list(range(5, chief + 1, 5)) + ([chief] if chief % 5 else [])
    assert [int(s) for s, _ in shown] == expected, run.output
    assert all(int(g) >= int(s) for s, g in shown)


def test_timeline_has_every_rank_and_a_sleep_shows_as_the_others_token_wait(tmp_path):
    path = tmp_path / "trace.json"
    run = run_mpi("observe.py", 3, 1, ["--steps", 12, "--laggard", 2, "--sleep-at", 5,
                                       "--progress"],
                  env={"MPISYNC_TIMELINE": str(path), "MPISYNC_PROGRESS": "0"})
    assert "[mpisync] train" not in run.output       # MPISYNC_PROGRESS=0: off
    trace = json.loads(path.read_text())             # plain JSON, Chrome's object format
    assert not list(tmp_path.glob("trace.json.rank*")), "the ranks' files were merged"
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2, 3], names
    assert names[0].startswith("worker 0 (rank 0") and names[3].startswith("ps 0 (rank 3")
    for e in events:
        assert e["ph"] in ("X", "i", "M") and isinstance(e["pid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] > 0, e

    def spans(pid, name):
        return [e for e in events if e["pid"] == pid and e["name"] == name and e["ph"] == "X"]

    for w, rec in run.by_worker().items():
        for phase in ("compute", "push", "token wait", "pull"):
            assert len(spans(w, phase)) == rec["pushes"], (w, phase)
    for phase in ("receive", "reduce", "apply", "send"):
        assert len(spans(3, phase)) == 12, phase
    decisions = [e for e in events if e["pid"] == 3 and e["name"] == "decide"]
    assert [e["args"]["step"] for e in decisions] == list(range(12))
    assert all(e["ph"] == "i" and e["tid"] == 1 for e in decisions)
    # worker 2 slept 1 s before its push at step 5: the others waited for the token then
    sleep = max(spans(2, "compute"), key=lambda e: e["dur"])
    assert sleep["dur"] >= 0.9e6 and sleep["args"]["step"] == 5, sleep
    for w in (0, 1):
        wait = max(spans(w, "token wait"), key=lambda e: e["dur"])
        assert wait["args"]["step"] == 5 and wait["dur"] >= 0.7e6, (w, wait)
        assert wait["ts"] < sleep["ts"] + sleep["dur"] and wait["ts"] + wait["dur"] > sleep["ts"]


def test_progress_bar_on_a_terminal(watched):
    out = watched[3]
    shown = out.read_bytes().decode("utf-8", "replace")
    assert "\r" in shown and "30/30" in shown and "step/s" in shown, shown
    assert "global step 30" in shown and "loss " in shown and "examples/s" in shown, shown
    assert "[mpisync] train:" not in shown, shown      # a bar, not lines
