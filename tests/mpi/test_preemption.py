"""Preemption and time limits: a job sent SIGUSR1 stops politely with exit status 75 and a
checkpoint, and resumes from it; a job without a Checkpointer sent SIGTERM still ends.

tests/scripts/preemption.py under ``python -m mpisync.launch`` (2 workers + 1 ps).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
from mpi_helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from preemption import SIGNAL_AT
from restarts import STEPS

from mpisync.environ import PREEMPTED_EXIT

TIMEOUT = 150


def launch(mode: str, directory, stall_warning: str = "60") -> subprocess.CompletedProcess:
    """``preemption.py MODE DIRECTORY`` under the launcher; its output, exit status."""
    return subprocess.run(
        [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
         "--timeout", str(TIMEOUT), "--",
         sys.executable, str(SCRIPTS / "preemption.py"), mode, str(directory)],
        check=False, capture_output=True, text=True, timeout=TIMEOUT + 30,
        env=dict(os.environ, MPISYNC_TIMEOUT="120", OMP_NUM_THREADS="1",
                 MPISYNC_STALL_WARNING=stall_warning))


def test_sigusr1_stops_with_a_checkpoint_and_status_75_and_the_job_resumes(tmp_path):
    proc = launch("usr1", tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == PREEMPTED_EXIT, text
    found = re.findall(r"^mpisync: stopped by SIGUSR1 at global step (\d+); checkpoint "
                       r"(\S+); exit status 75$", text, re.MULTILINE)
    assert len(found) == 1, text                          # the chief's line, once
    step, path = int(found[0][0]), found[0][1]
    assert step == SIGNAL_AT + 1, text                     # the step the signal fell in
    assert path == str(tmp_path / f"ckpt-{step:09d}.pt"), text
    assert torch.load(path, weights_only=True)["global_step"] == step
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]
    assert "Traceback" not in text and "MPI_Abort" not in text, text
    assert "BAD TERMINATION" not in text and "RESULT" not in text, text
    assert "mpisync.launch: the job stopped after a signal (exit status 75)" in text, text

    again = launch("usr1", tmp_path)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text
    assert f"preemption.py: starts at global step {step}" in text, text
    assert text.count(f'"global_step": {STEPS}') == 2, text


def test_sigterm_to_every_rank_without_a_checkpointer_ends_the_job(tmp_path):
    proc = launch("term", tmp_path, stall_warning="10")
    text = proc.stdout + proc.stderr
    assert proc.returncode not in (0, PREEMPTED_EXIT), text
    assert "ran past --timeout" not in text and "MPISYNC_TIMEOUT" not in text, text
    assert "mpisync: stopped by" not in text and not os.listdir(tmp_path), text
