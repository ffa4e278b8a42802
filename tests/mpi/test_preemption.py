"""Preemption and time limits: a job sent SIGUSR1 or SIGUSR2 stops politely with exit status
75 and a checkpoint, and resumes from it; one sent SIGUSR1 before its ranks listen for it
exits 75 too, having written nothing; a job without a Checkpointer sent SIGTERM still ends.

tests/scripts/preemption.py under ``python -m mpisync.launch`` (2 workers + 1 ps; the ranks
forked by the suite's fork servers where it has them, as ``run_mpi``'s, but for the job
that signals its whole process group).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, rank_python

sys.path.insert(0, str(SCRIPTS))
from preemption import SIGNAL_AT
from restarts import STEPS

from mpisync.environ import PREEMPTED_EXIT

TIMEOUT = 150


def environment(stall_warning: str = "60") -> dict[str, str]:
    return dict(os.environ, MPISYNC_TIMEOUT="120", OMP_NUM_THREADS="1",
                MPISYNC_STALL_WARNING=stall_warning)


def command(mode: str, directory, env: dict[str, str]) -> list[str]:
    """The launcher's command line for ``preemption.py MODE DIRECTORY``: fresh ranks for
    ``term`` (a forked rank's process group is its fork server's, not the job's)."""
    python = [sys.executable] if mode == "term" else rank_python(3, env)
    return [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
            "--timeout", str(TIMEOUT), "--",
            *python, str(SCRIPTS / "preemption.py"), mode, str(directory)]


def launch(mode: str, directory, stall_warning: str = "60") -> subprocess.CompletedProcess:
    """``preemption.py MODE DIRECTORY`` under the launcher; its output, exit status."""
    env = environment(stall_warning)
    return subprocess.run(command(mode, directory, env), check=False, capture_output=True,
                          text=True, timeout=TIMEOUT + 30, env=env)


@pytest.mark.openmpi
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


def signal_when_ready(mode: str, directory, ready: str,
                      signum: int = signal.SIGUSR1) -> tuple[int, str]:
    """``preemption.py MODE DIRECTORY`` under the launcher, sent ``signum`` once each of the
    three ranks printed ``ready``; its exit status and output."""
    env = environment()
    launcher = subprocess.Popen(command(mode, directory, env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
    try:
        text, waiting = "", 0
        for line in launcher.stdout:          # until every rank waits
            text += line
            waiting += line.count(ready)          # two ranks may print on one line
            if waiting == 3:
                launcher.send_signal(signum)
                break
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    text += out
    assert waiting == 3, text
    return launcher.returncode, text


def test_sigusr1_before_any_rank_listens_exits_75_having_written_nothing(tmp_path):
    """A time limit's warning that comes while the ranks start (before mpisync.init(), so
    SIGUSR1 ends them): the launcher still exits 75 (Slurm's template requeues on it, and
    the job resumes from its newest checkpoint), saying why."""
    status, text = signal_when_ready("early", tmp_path, "preemption.py: not listening yet")
    assert status == PREEMPTED_EXIT, text
    assert text.rstrip().splitlines()[-1].startswith(
        "mpisync.launch: exit status 75, not "), text
    assert text.rstrip().endswith(
        ": this launcher passed SIGUSR1 on to the job, which ended by it before every rank "
        "could stop politely (a rank ends by the signal until its mpisync.Checkpointer is "
        "made); resume from the newest checkpoint"), text
    assert "ran past --timeout" not in text and not os.listdir(tmp_path), text


def test_sigusr2_after_init_before_the_checkpointer_stops_at_the_first_step(tmp_path):
    """Noted from mpisync.init() on: the Checkpointer made after the signal stops the job
    politely at its first maybe_save(), with a checkpoint the next job resumes from. SIGUSR2
    (``sbatch --signal=B:USR2``) reaches the ranks, not MPICH's mpiexec, which it would end."""
    status, text = signal_when_ready("init", tmp_path,
                                     "preemption.py: listening, no Checkpointer yet",
                                     signal.SIGUSR2)
    assert status == PREEMPTED_EXIT, text
    path = tmp_path / "ckpt-000000001.pt"
    assert re.findall(r"^mpisync: stopped by SIGUSR2 at global step (\d+); checkpoint (\S+); "
                      r"exit status 75$", text, re.MULTILINE) == [("1", str(path))], text
    assert "Traceback" not in text and "BAD TERMINATION" not in text, text
    assert os.listdir(tmp_path) == [path.name], text
    again = launch("usr1", tmp_path)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text
    assert "preemption.py: starts at global step 1" in text, text
    assert text.count(f'"global_step": {STEPS}') == 2, text
