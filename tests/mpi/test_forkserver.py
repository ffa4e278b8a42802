"""Ranks forked by the suite's fork servers (tests/forkserver.py) start and end as fresh ones.

Each job runs twice, forked and as fresh Pythons, and the ranks must see the same
arguments, directory, environment, ``__main__`` and buffering, and end the same way: exit
status, output, an error's message and traceback. Only what a fork shares differs: torch is
imported already. The ranks of one job still draw different random numbers and hash strings
differently, as separate processes do.
"""
from __future__ import annotations

import os
import sys

import pytest
from mpi_helpers import failing, labels, run_mpi

pytestmark = pytest.mark.openmpi


@pytest.fixture(autouse=True, scope="module")
def _forking():
    """Where the suite starts fresh ranks only (under coverage.py, which would not follow
    the forks, or with ``MPISYNC_TEST_FORK_RANKS=0``) there is nothing to compare."""
    if "coverage" in sys.modules or os.environ.get("MPISYNC_TEST_FORK_RANKS", "1") == "0":
        pytest.skip("the suite forks no ranks here (coverage.py, or MPISYNC_TEST_FORK_RANKS=0)")
ENV = {"MPISYNC_FORKED_MARK": "seen"}
SAME = ("rank", "name", "argv", "cwd", "path0", "mark", "stdout_line_buffered",
        "stderr_line_buffered", "stdout_fd", "main")


def _both(end: str, expect_ok: bool):
    jobs = {}
    for fork in (True, False):
        if expect_ok:
            jobs[fork] = run_mpi("forked.py", 2, 1, [end], env=ENV, fork=fork)
        else:
            jobs[fork] = failing("forked.py", 2, 1, [end], env=ENV, fork=fork)
    return jobs[True], jobs[False]


def _ranks(run) -> list[dict]:
    return sorted((r for r in run.results if r.get("role") == "rank"), key=lambda r: r["rank"])


def test_forked_ranks_see_what_fresh_ones_see_and_differ_among_themselves():
    forked, fresh = _both("ok", expect_ok=True)
    assert [r["forked"] for r in _ranks(forked)] == [True] * 3, forked.describe()
    assert [r["forked"] for r in _ranks(fresh)] == [False] * 3, fresh.describe()
    for a, b in zip(_ranks(forked), _ranks(fresh)):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
    assert _ranks(forked)[0]["mark"] == "seen" and _ranks(forked)[0]["name"] == "__main__"
    for run in (forked, fresh):
        for key in ("hash", "draw"):
            assert len({r[key] for r in _ranks(run)}) == 3, (key, run.describe())
        for rank in range(3):
            assert f"stdout of rank {rank}" in run.stdout
            assert f"stderr of rank {rank}" in run.stderr


def test_forked_ranks_end_with_the_exit_status_and_error_fresh_ones_end_with():
    forked, fresh = _both("exit", expect_ok=False)
    assert forked.returncode == fresh.returncode == 3
    assert "stdout of rank 2" in forked.stdout
    forked, fresh = _both("raise", expect_ok=False)
    assert forked.returncode == fresh.returncode != 0
    worker = labels(2, 1)[1]
    for run in (forked, fresh):
        assert f"ValueError: broken on purpose on {worker}" in run.output, run.describe()
        trace = run.output[run.output.index("Traceback (most recent call last):"):]
        # the traceback starts at the script's own frame, as Python's does
        assert trace.splitlines()[1].strip().startswith('File "'), trace
        assert "forked.py" in trace.splitlines()[1] and "runpy" not in trace, trace
