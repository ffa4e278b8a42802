"""``python -m mpisync.launch --restarts 2``: a job whose rank dies starts again, resumes from
its newest checkpoint and ends bitwise where an unbroken run ends; a job that fails the same
way twice is not started a third time.

Each case is one launcher run of tests/scripts/restarts.py (2 workers + 1 ps, deterministic,
a checkpoint every 3 global steps, 12 steps; each attempt's ranks forked by the suite's fork
servers where it has them, as ``run_mpi``'s); the unbroken run is one plain job. The killed
ranks are killed in turn in one run: the ps, then the chief, then a worker that is not the
chief, one per attempt (under MPICH and Open MPI).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, rank_python, run_mpi

sys.path.insert(0, str(SCRIPTS))
from restarts import EACH, EVERY, RAISE_AT, STEPS

#: One attempt's limit (--timeout); a run's is that for each attempt and a minute.
ATTEMPT_TIMEOUT = 150


def launch(mode: str, tmp_path, restarts: int = 2) -> tuple[subprocess.CompletedProcess, str]:
    """``restarts.py MODE`` under the launcher with ``--restarts RESTARTS``; its output, the
    chief's final parameters' file."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    ckpt.mkdir()
    env = dict(os.environ, MPISYNC_TIMEOUT="120", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
         "--restarts", str(restarts), "--restart-backoff", "0", "--timeout",
         str(ATTEMPT_TIMEOUT), "--",
         *rank_python(3, env), str(SCRIPTS / "restarts.py"), mode, str(ckpt), str(out)],
        check=False, capture_output=True, text=True,
        timeout=(restarts + 1) * ATTEMPT_TIMEOUT + 60, env=env)
    return proc, str(out)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final parameters of a run that nothing stopped (a plain job)."""
    tmp = tmp_path_factory.mktemp("unbroken")
    (tmp / "ckpt").mkdir()
    run_mpi("restarts.py", 2, 1, args=["none", tmp / "ckpt", tmp / "final.pt"])
    return torch.load(tmp / "final.pt")


@pytest.mark.openmpi
def test_a_killed_ps_chief_or_worker_restarts_the_job_which_resumes_bitwise(tmp_path, unbroken):
    """The ps, the chief, then worker 1 die by SIGKILL, one per attempt: each attempt starts
    from the newest checkpoint before its kill, and the last ends where an unbroken run
    ends, bitwise."""
    proc, out = launch("kill-each", tmp_path, restarts=len(EACH))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    attempts = len(EACH) + 1
    for n in range(2, attempts + 1):
        assert f"mpisync.launch: attempt {n} of {attempts}: the job failed with exit status" \
            in text, text
    assert text.count("no rank recorded an error") == len(EACH), text
    assert "made no mpisync.Checkpointer" not in text, text       # it makes one
    assert "restarts.py: attempt 0 starts at global step 0" in text, text
    for n, (victim, step) in sorted(EACH.items()):
        last = (step // EVERY) * EVERY            # the newest checkpoint before the kill
        assert f"restarts.py: attempt {n + 1} starts at global step {last}" in text, \
            (victim, text)
    assert f"attempt {attempts + 1}" not in text, text
    assert f"restarts.py: attempt {attempts}" not in text, text
    assert text.count(" -n 3 ") == attempts, text
    final = torch.load(out)
    assert sorted(final) == sorted(unbroken)
    for name, value in unbroken.items():
        assert torch.equal(final[name], value), (name, final[name] - value)


@pytest.mark.openmpi
def test_a_job_that_fails_the_same_way_twice_is_not_started_again(tmp_path):
    proc, out = launch("raise", tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "mpisync.launch: attempt 2 of 3:" in text, text
    assert text.rstrip().splitlines()[-1].startswith(
        "mpisync.launch: the job failed the same way twice (worker 0 (rank 0 on "), text
    assert text.rstrip().endswith(
        f"): RuntimeError: boom, at global step {RAISE_AT}): not starting it again "
        "(a bug is not a fault)"), text
    assert "restarts.py: attempt 1 starts at global step 3" in text, text
    assert "attempt 3" not in text and "restarts.py: attempt 2" not in text, text
    assert text.count(" -n 3 ") == 2, text          # two attempts started
    assert not os.path.exists(out) and RAISE_AT < STEPS


def test_a_signal_between_attempts_ends_the_launcher_saying_so(tmp_path):
    """SIGTERM, or SIGUSR1 (a time limit's warning), during ``--restart-backoff``: no
    attempt is started again, the launcher says why and ends with 128 + 15, or with 75
    (resume from the newest checkpoint), leaving no failure records behind."""
    for sig, status in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGUSR1, 75)):
        parent = tmp_path / sig.name
        launcher = subprocess.Popen(
            [sys.executable, "-m", "mpisync.launch", "--workers", "1", "--ps", "1",
             "--restarts", "2", "--restart-backoff", "60", "--timeout", "60", "--",
             sys.executable, "-c", "raise SystemExit(1)"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, MPISYNC_FAILURE_DIR=str(parent)))
        try:
            text = ""
            for line in launcher.stdout:          # until the backoff starts
                text += line
                if "starting the job again in 60 s" in line:
                    launcher.send_signal(sig)
                    break
            out, _ = launcher.communicate(timeout=60)
        finally:
            launcher.kill()
        text += out
        assert launcher.returncode == status, text
        assert text.rstrip().splitlines()[-1].startswith(
            f"mpisync.launch: {sig.name} between attempts: not starting the job again"), text
        assert text.count(" -n 2 ") == 1, text          # one attempt started
        assert list(parent.iterdir()) == [], text
