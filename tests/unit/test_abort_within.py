"""The abort that ends a failing rank, in one process: ``mpisync.ps_ranks.abort_within``
ends the rank even where ``MPI_Abort`` never returns (the jobs that fail and end every rank:
tests/mpi/test_errors_reach_every_rank.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

ABORT_THAT_NEVER_RETURNS = "#include <unistd.h>\nint MPI_Abort(void *c, int e) { for (;;) sleep(100); }\n"


def test_an_abort_that_never_returns_still_ends_the_rank(tmp_path):
    """The abort that ends a failing job lets go of the GIL while it waits, so the timer
    that ends a rank whose abort waits for good (seen with Open MPI's ULFM, once ranks had
    died) runs: here ``MPI_Abort`` itself never returns (a library preloaded in its place)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    (tmp_path / "abort.c").write_text(ABORT_THAT_NEVER_RETURNS)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "abort.so"),
                    str(tmp_path / "abort.c")], check=True, timeout=120)
    start = time.monotonic()
    probe = "from mpi4py import MPI\nfrom mpisync.ps_ranks import abort_within\nabort_within(2, 7)"
    run = subprocess.run([sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, LD_PRELOAD=str(tmp_path / "abort.so")))
    assert run.returncode == 7, run.stderr[-2000:]
    assert time.monotonic() - start < 100
