"""The suite's two tiers.

``make test`` runs every test. ``make check`` sets ``MPISYNC_TESTS_IN_PROCESS=1`` and runs
the tests that start no MPI job: a test (or the fixture it reads) that starts ``mpiexec``,
``mpirun``, ``horovodrun``, Slurm or ``python -m mpisync.launch`` is skipped at that call,
saying so, so the edit loop never waits for ranks to start.
"""
from __future__ import annotations

import os
import subprocess

import pytest

IN_PROCESS_ONLY = os.environ.get("MPISYNC_TESTS_IN_PROCESS") == "1"
# commands that start ranks (the first word, or any word for the module launcher)
LAUNCHERS = {"mpiexec", "mpirun", "mpiexec.hydra", "horovodrun", "srun", "sbatch",
             "local-cluster.sh"}


def starts_ranks(args) -> bool:
    """Whether a command line launches an MPI job or a Slurm cluster."""
    words = [str(args)] if isinstance(args, (str, bytes, os.PathLike)) else [str(a) for a in args]
    names = {os.path.basename(w) for w in words}
    return bool(names & LAUNCHERS) or "mpisync.launch" in words


if IN_PROCESS_ONLY:
    _popen_init = subprocess.Popen.__init__

    def _in_process_only(self, args, *rest, **kwargs):
        if starts_ranks(args):
            pytest.skip("starts MPI ranks: `make test` runs it")
        _popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = _in_process_only
