"""``make check``'s tier: which command lines start ranks (tests/conftest.py), one process."""
from __future__ import annotations

import pytest
from conftest import starts_ranks


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
