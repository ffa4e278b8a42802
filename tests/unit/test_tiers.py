"""``make check``'s tier and the folders' rule (tests/conftest.py), in one process: which
command lines start ranks, and what becomes of a test that runs one in tests/unit/ or
tests/mpi/."""
from __future__ import annotations

import subprocess

import pytest
from conftest import TESTS, launch_verdict, starts_ranks

LAUNCH = ["mpiexec", "-n", "2", "python", "x.py"]


@pytest.mark.parametrize("args, shell", [
    (["mpiexec", "-n", "3", "python", "x.py"], False),
    (["/venv/bin/mpirun", "--oversubscribe", "-n", "2", "python", "x.py"], False),
    ("mpiexec -n 2 python x.py", True),
    (["sh", "-c", "cd /tmp && mpiexec -n 2 python x.py"], False),
    (["bash", "/repo/launch/slurm/local-cluster.sh", "start", "--nodes", "2"], False),
    (["python", "-m", "mpisync.launch", "--workers", "2", "--", "python", "x.py"], False),
    (["python", "-u", "-mmpisync.launch", "--workers", "2"], False),
    ([b"sbatch", b"--wait", b"job.sbatch"], False),
])
def test_a_command_that_starts_ranks_is_seen(args, shell):
    assert starts_ranks(args, shell)


@pytest.mark.parametrize("args, shell", [
    (["mpiexec", "--version"], False),
    (["python", "-m", "mpisync.launch", "--help"], False),
    (["python", "-c", "print('mpiexec')"], False),
    (["bash", "-x", "build.sh"], False),
    (["bash", "/repo/tools/other.sh"], False),
    ("ls /tmp", True),
])
def test_a_command_that_starts_none_is_let_through(args, shell):
    assert not starts_ranks(args, shell)


@pytest.mark.parametrize("in_process_only", [False, True])
def test_a_unit_test_that_starts_ranks_fails_in_either_tier(in_process_only):
    assert launch_verdict(TESTS / "unit" / "test_x.py", LAUNCH, False, in_process_only) == "fail"
    assert launch_verdict(TESTS / "unit" / "test_x.py", "mpiexec -n 2 true", True,
                          in_process_only) == "fail"


def test_an_mpi_test_that_starts_ranks_runs_or_is_skipped_in_the_in_process_tier():
    path = TESTS / "mpi" / "test_x_jobs.py"
    assert launch_verdict(path, LAUNCH, False, in_process_only=False) is None
    assert launch_verdict(path, LAUNCH, False, in_process_only=True) == "skip"


@pytest.mark.parametrize("in_process_only", [False, True])
def test_a_command_that_starts_none_runs_in_either_folder(in_process_only):
    for folder in ("unit", "mpi"):
        assert launch_verdict(TESTS / folder / "test_x.py", ["mpiexec", "--version"], False,
                              in_process_only) is None


def test_this_file_fails_where_it_would_start_ranks():
    """The check runs before anything starts: no mpiexec is needed to see it."""
    with pytest.raises(pytest.fail.Exception,
                       match=r"^unit/test_tiers\.py starts MPI ranks \(\['mpiexec', .*\): a test "
                             r"under tests/unit/ starts none; it belongs in tests/mpi/$"):
        subprocess.Popen(["mpiexec", "-n", "2", "true"])
