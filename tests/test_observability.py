"""Watching a job: the statistics log, the timeline and the chief's progress display.

One job (3 workers, 1 ps rank, ``MPISYNC_STATS`` set) trains with a sleeping backup
worker, its progress shown in lines, then with the chief's progress bar on a terminal;
the timeline, which records all of a job, has a job of its own.
"""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi_helpers import SCRIPTS, run_mpi

from mpisync.observe import timeline
from mpisync.observe.watch import Progress
from mpisync.protocol.wire import Kind
from mpisync.ps.steplog import StepLog, log_path
from mpisync.stats import read, render, summarize

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


# -- one process ---------------------------------------------------------------------------
def test_a_rank_file_cut_short_is_a_readable_trace_and_merges(tmp_path):
    path = str(tmp_path / "t.json")
    tl = timeline.Timeline(path, 0, 2, "worker 0 (rank 0 on n0)")
    tl.span("push", 1.0, 1.5, step=3)
    tl.instant("decide", 1.2, {"step": 3, "taken": [0]}, tid=1)
    tl.flush()
    with open(timeline.rank_path(path, 0), "a") as f:
        f.write(',{"name":"pull","ph":"X","pi')        # a crash in the middle of a write
    text = Path(timeline.rank_path(path, 0)).read_text()
    events = json.loads(text[:text.rindex("\n")] + "]")       # only the "]" is missing
    assert [e["name"] for e in events][-2:] == ["push", "decide"]
    assert timeline.merge(path) == 1
    merged = json.loads(Path(path).read_text())["traceEvents"]
    assert [e["name"] for e in merged] == ["process_name", "process_sort_index",
                                           "thread_name", "push", "decide"]
    push = merged[3]
    assert push["dur"] == 0.5e6 and push["args"] == {"step": 3}


def test_the_last_rank_to_close_merges_the_timeline(tmp_path):
    path = str(tmp_path / "t.json")
    ranks = [timeline.Timeline(path, r, 2, f"rank {r}") for r in range(2)]
    for r, tl in enumerate(ranks):
        tl.span("compute", 10.0 + r, 10.5 + r, step=0)
    ranks[1].close()
    assert not (tmp_path / "t.json").exists()
    ranks[0].close()
    events = json.loads(Path(path).read_text())["traceEvents"]
    assert sorted(e["pid"] for e in events if e["name"] == "compute") == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_a_full_timeline_stops_recording(tmp_path, monkeypatch):
    path = str(tmp_path / "t.json")
    tl = timeline.Timeline(path, 0, 1, "rank 0")
    monkeypatch.setattr(timeline, "current", tl)
    tl.max_bytes = 2000
    for i in range(600):
        tl.span("push", i, i + 0.5, step=i)
    assert timeline.current is None and tl.closed
    events = json.loads(Path(path).read_text())["traceEvents"]   # the only rank: merged
    assert events[-1]["name"] == "timeline full"
    assert 10 < len(events) < 600


def test_step_log_lines_wait_for_timings_and_the_open_step_ends_dropped(tmp_path):
    path = tmp_path / "s.jsonl"
    log = StepLog(str(path), opt_id=0, num_workers=2, num_ps=1, replicas_to_aggregate=1,
                  asynchronous=False, global_step=0)
    applied = np.array([Kind.APPLIED, 0, 0, 0, 1500, 500, 4096, 2048], np.int64)
    log.pushed(0, 0, False, None, 1.0)
    log.decided(0, (1, 0), 1.25)
    log.pushed(1, 0, True, None, 1.3)               # too late: dropped while applying
    log.applied(applied)
    log.step_applied(1.5)
    log.write_ready()
    assert read(str(path))[1] == []                 # their timings have not come yet
    log.pushed(0, 1, False, np.array([1000, 200, 3000, 400], np.uint32), 2.0)
    log.closed(1, np.array([5000, 100, 100, 100], np.uint32))
    log.finish(1)                                   # worker 0's push at 1 was never applied
    job, lines = read(str(path))
    assert job["num_workers"] == 2
    first, last = lines
    assert (first["step"], first["applied"], first["taken"], first["dropped"]) == (0, True, [0],
                                                                                   [1])
    assert first["decide_ms"] == 250.0 and first["apply_ms"] == [1.5]
    assert first["reduce_ms"] == [0.5] and first["bytes_in"] == [4096]
    by_worker = {p["worker"]: p for p in first["pushes"]}
    assert by_worker[0]["compute_ms"] == 1.0 and by_worker[0]["wait_ms"] == 3.0
    assert by_worker[1]["compute_ms"] == 5.0 and by_worker[1]["at"] == 0
    assert (last["step"], last["applied"], last["taken"], last["dropped"]) == (1, False, [], [0])
    assert last["pushes"][0]["compute_ms"] is None  # its timings never came
    summary = summarize(job, lines)
    assert summary["taken_per_worker"] == [1, 0] and summary["dropped_per_worker"] == [1, 1]


def test_log_path_follows_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv("MPISYNC_STATS", "run/stats.jsonl")
    assert log_path(None, 0) == "run/stats.jsonl"
    assert log_path(None, 2) == "run/stats.opt2.jsonl"
    assert log_path("mine.jsonl", 1) == "mine.jsonl"
    assert log_path(False, 0) is None
    monkeypatch.delenv("MPISYNC_STATS")
    assert log_path(None, 0) is None


class _FakeOptimizer:
    """What Progress reads of a SyncReplicasOptimizer."""

    def __init__(self, chief: bool = True):
        self.cluster = SimpleNamespace(is_chief=chief)
        self.spec = SimpleNamespace(asynchronous=False, replicas_to_aggregate=2)
        self.global_step = 0
        self.hooks = []

    def register_step_post_hook(self, hook):
        self.hooks.append(hook)
        return SimpleNamespace(remove=lambda: self.hooks.remove(hook))

    def step(self):
        self.global_step += 1
        for hook in list(self.hooks):
            hook(self, (), {})


def test_progress_lines_every_n_steps_and_off_by_one_flag(monkeypatch):
    monkeypatch.delenv("MPISYNC_PROGRESS", raising=False)
    opt, out = _FakeOptimizer(), io.StringIO()
    with Progress(opt, total=7, batch_size=8, every=3, file=out) as progress:
        for i in range(7):
            opt.step()
            progress.report(loss=float(i))
    lines = out.getvalue().splitlines()
    assert [re.search(r"step (\d+)/7", s).group(1) for s in lines] == ["3", "6", "7"]
    assert "loss 1 " in lines[0] and "global step 3" in lines[0] and "examples/s" in lines[0]
    assert not opt.hooks
    for kwargs, env in (({"enabled": False}, None), ({}, "0")):
        if env is not None:
            monkeypatch.setenv("MPISYNC_PROGRESS", env)
        opt, out = _FakeOptimizer(), io.StringIO()
        with Progress(opt, every=1, file=out, **kwargs):
            opt.step()
        assert out.getvalue() == "" and not opt.hooks
    monkeypatch.delenv("MPISYNC_PROGRESS")
    opt, out = _FakeOptimizer(chief=False), io.StringIO()
    Progress(opt, every=1, file=out)
    opt.step()
    assert out.getvalue() == "" and not opt.hooks    # other workers show nothing
