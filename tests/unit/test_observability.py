"""Watching a job, in one process: rank files of the timeline and their merge, the step
log's lines, where the log goes, and the progress lines (the jobs that are watched:
tests/mpi/test_observability_jobs.py)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from mpisync.observe import timeline
from mpisync.observe.watch import Progress
from mpisync.protocol.wire import Kind
from mpisync.ps.steplog import StepLog, log_path
from mpisync.stats import read, render, summarize


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


def _one_step_log(path, global_step: int = 0, loaded: int | None = None) -> None:
    log = StepLog(str(path), opt_id=0, num_workers=1, num_ps=1, replicas_to_aggregate=1,
                  asynchronous=False, global_step=global_step)
    if loaded is not None:
        log.loaded(loaded)
    step = global_step if loaded is None else loaded
    log.pushed(0, step, False, None, 1.0)
    log.decided(step, (1,), 1.1)
    log.step_applied(1.2)
    log.finish(step + 1)


def test_a_later_attempt_appends_to_the_step_log_from_the_step_it_loaded(tmp_path,
                                                                        monkeypatch):
    path = tmp_path / "s.jsonl"
    path.write_text("an older job's line\n")
    monkeypatch.delenv("MPISYNC_ATTEMPT", raising=False)
    _one_step_log(path)                                  # the first attempt truncates
    monkeypatch.setenv("MPISYNC_ATTEMPT", "2")
    _one_step_log(path, loaded=4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [("job" in r, r.get("step")) for r in records] == [(True, None), (False, 0),
                                                              (True, None), (False, 4)]
    assert (records[0]["job"]["attempt"], records[0]["job"]["global_step"]) == (0, 0)
    assert (records[2]["job"]["attempt"], records[2]["job"]["global_step"]) == (2, 4)


def _steps_log(path, steps: range, loaded: int | None = None) -> None:
    """One attempt of one worker and one ps applying ``steps``, from a load at ``loaded``."""
    log = StepLog(str(path), opt_id=0, num_workers=1, num_ps=1, replicas_to_aggregate=1,
                  asynchronous=False, global_step=0)
    if loaded is not None:
        log.loaded(loaded)
    for step in steps:
        log.pushed(0, step, False, None, 1.0 + step)
        log.decided(step, (1,), 1.1 + step)
        log.step_applied(1.2 + step)
    log.finish(steps[-1] + 1)


def test_the_summary_of_a_restarted_job_counts_each_global_step_once(tmp_path, monkeypatch):
    """Attempt 0 applies steps 0-4 and dies; attempt 1 resumes from the checkpoint at 3
    and applies 3-7: 8 global steps, 2 trained again, each attempt on a line of its own."""
    path = tmp_path / "s.jsonl"
    monkeypatch.delenv("MPISYNC_ATTEMPT", raising=False)
    _steps_log(path, range(5))
    monkeypatch.setenv("MPISYNC_ATTEMPT", "1")
    _steps_log(path, range(3, 8), loaded=3)
    job, lines = read(str(path))
    assert [a["attempt"] for a in job["attempts"]] == [0, 1] and job["attempt"] == 0
    assert [line["attempt"] for line in lines if line["applied"]] == [0] * 5 + [1] * 5
    summary = summarize(job, lines)
    assert (summary["steps"], summary["steps_trained_again"]) == (8, 2)
    assert (summary["first_step"], summary["last_step"]) == (0, 7)
    first, second = summary["attempts"]
    assert (first["from_step"], first["first_step"], first["last_step"], first["steps"],
            first["down_s"]) == (0, 0, 4, 5, None)
    assert (second["attempt"], second["from_step"], second["first_step"], second["last_step"],
            second["steps"]) == (1, 3, 3, 7, 5)
    assert second["down_s"] is not None
    assert summary["seconds"] == round(first["seconds"] + second["seconds"], 3)
    text = render(str(path), summary)
    assert "2 attempts (a restarted job); global steps trained again after a restart: 2" in text
    assert re.search(r"\n  attempt 1: from global step 3, steps 3\.\.7 \(5 applied\) in "
                     r"[\d.]+ s, started -?[\d.]+ s after the last step before it\n", text), text
    monkeypatch.delenv("MPISYNC_ATTEMPT")
    _steps_log(path, range(2))                  # one attempt: no attempt lines
    job, lines = read(str(path))
    summary = summarize(job, lines)
    assert len(summary["attempts"]) == 1 and summary["steps_trained_again"] == 0
    assert "attempt" not in render(str(path), summary)


def test_a_later_attempt_appends_to_the_timeline_and_marks_its_start(tmp_path,
                                                                   monkeypatch):
    path = str(tmp_path / "t.json")
    first = timeline.Timeline(path, 0, 1, "worker 0")
    first.span("push", 1.0, 1.5, step=0)
    first.close()                                        # the only rank: merged
    second = timeline.Timeline(path, 0, 1, "worker 0", attempt=1)
    second.span("rows", 2.0, 2.1, step=-1)               # no step yet: held back
    second.span("push", 2.2, 2.5, step=7)
    second.close()
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e["ph"] != "M"]
    assert [e["name"] for e in events] == ["push", "attempt", "rows", "push"]
    assert events[1]["args"] == {"attempt": 1, "global_step": 7}


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

    def register_load_state_dict_post_hook(self, hook):
        return SimpleNamespace(remove=lambda: None)

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


def test_progress_made_after_a_resume_counts_on_from_the_global_step(monkeypatch):
    monkeypatch.delenv("MPISYNC_PROGRESS", raising=False)
    opt, out = _FakeOptimizer(), io.StringIO()
    opt.global_step = 1000                           # as Checkpointer.resume() left it
    with Progress(opt, total=1003, every=2, file=out) as progress:
        for _ in range(3):
            opt.step()
            progress.report()
    lines = out.getvalue().splitlines()
    assert [re.search(r"step (\d+)/1003  global step (\d+)", s).groups() for s in lines] \
        == [("1002", "1002"), ("1003", "1003")]
