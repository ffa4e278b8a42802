"""A job that survives lost workers (Open MPI with ULFM): ranks killed with SIGKILL mid-run.

Runs in the Open MPI part of the suite (``make test-openmpi``); MPICH cannot survive a
lost rank, and test_errors_reach_every_rank.py checks that its job ends.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mpi_helpers import SCRIPTS, mpi_flavor, rank_python

from mpisync.launch import run_job
from mpisync.runtime.survival import LOST_WORKERS_EXIT

# also run under Open MPI (make test-openmpi)
pytestmark = pytest.mark.openmpi


@pytest.fixture(autouse=True, scope="module")
def _open_mpi_only():
    if mpi_flavor() != "openmpi":
        pytest.skip("surviving a lost rank needs Open MPI with ULFM (make test-openmpi)")


def survive(*args: str, timeout: float = 60):
    """3 workers (replicas_to_aggregate=2: one backup) and 1 ps, launched to survive."""
    result_dir = tempfile.mkdtemp(prefix="mpisync-results-")
    start = time.monotonic()
    env = dict(os.environ, MPISYNC_TIMEOUT="60", OMP_NUM_THREADS="1", RESULT_DIR=result_dir)
    job = run_job([sys.executable, "-m", "mpisync.launch", "--survive-worker-loss",
                   "--workers", "3", "--ps", "1", "--timeout", str(timeout), "--",
                   *rank_python(4, env), str(SCRIPTS / "survive.py"), *args],
                  timeout=timeout + 30, capture=True, env=env)
    records = [json.loads(line) for f in sorted(Path(result_dir).glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    return job, records, time.monotonic() - start


def test_a_killed_backup_worker_is_survived_and_reported_once():
    # it dies in backward, some buckets of its push sent, the rest and the header never
    job, records, _ = survive("--kill", "2", "--mid-backward")
    out = job.output
    assert job.returncode == LOST_WORKERS_EXIT, out
    assert "--with-ft ulfm" in out
    assert re.search(r"mpisync\.launch: the job trained to its end but lost workers \(exit "
                     r"status 3\)", out), out
    reports = re.findall(r"ps 0 \(rank 3 on [^)]*\): lost worker 2 \(rank 2 on [^)]*\) at "
                         r"global step \d+, its last gradient computed at step \d+; 2 of 3 "
                         r"workers left", out)
    assert len(reports) == 1, out
    workers = {r["worker"]: r for r in records if r["role"] == "worker"}
    (killed,) = [r for r in records if r["role"] == "killed"]
    assert sorted(workers) == [0, 1], out
    chief, other = workers[0], workers[1]
    assert chief["global_step"] == other["global_step"] == chief["ps_step"] == 30, out
    assert chief["params"] == other["params"] == chief["ps_params"], out
    (ps,) = [r for r in records if r["role"] == "ps"]
    lost = ps["stats"]["workers_lost"]
    assert [(v["worker"], v["rank"]) for v in lost] == [(2, 2)], lost
    assert 0 <= lost[0]["last_step"] < 30
    print(f"lost worker noticed {lost[0]['noticed_at'] - killed['at']:.2f} s after its kill")
    assert chief["workers_lost"] == other["workers_lost"] == lost
    assert ps["stats"]["global_step"] == 30


def test_more_workers_lost_than_backups_ends_the_job_naming_them():
    job, _, took = survive("--kill", "1,2", timeout=90)
    assert job.returncode not in (0, LOST_WORKERS_EXIT, 124), job.output
    assert re.search(r"ps 0 \(rank 3 on [^)]*\): RuntimeError: .*lost workers \[1, 2\] \(rank "
                     r"[12], rank [12]\): the 1 left cannot complete a step of 2 gradients",
                     job.output), job.output
    assert "ran past --timeout" not in job.output      # it ended by itself
    print(f"the job ended {took:.1f} s after its start")


def test_a_killed_ps_ends_the_job_naming_it():
    job, _, took = survive("--kill-ps", "--steps", "1000000", timeout=90)
    assert job.returncode not in (0, LOST_WORKERS_EXIT, 124), job.output
    assert re.search(r"worker \d \(rank \d on [^)]*\): \w+: ps 0 \(rank 3 on [^)]*\) lost",
                     job.output), job.output
    assert "ran past --timeout" not in job.output      # it ended by itself
    print(f"the job ended {took:.1f} s after its start")
