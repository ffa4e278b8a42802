"""Run a script under mpiexec in a subprocess with a timeout; parse its RESULT lines."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpisync.launch import detect_mpi_flavor, find_mpiexec, mpiexec_command

SCRIPTS = Path(__file__).parent / "scripts"


@dataclass
class Run:
    """What one mpiexec run left: exit code, output, and its RESULT records."""

    returncode: int
    stdout: str
    stderr: str
    results: list[dict] = field(default_factory=list)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def by_worker(self) -> dict[int, dict]:
        return {r["worker"]: r for r in self.results if r.get("role") == "worker"}

    def ps(self) -> list[dict]:
        return [r for r in self.results if r.get("role") == "ps"]


def run_mpi(script: str, workers: int, ps: int = 1, args=(), timeout: float = 120,
            env: dict[str, str] | None = None, expect_ok: bool = True) -> Run:
    """Launch ``workers + ps`` ranks of ``tests/scripts/<script>``; never hang the suite.

    The whole process group is killed when ``timeout`` passes, and the test fails with
    everything the ranks printed. With ``expect_ok`` the run must exit 0.
    """
    mpiexec = find_mpiexec()
    result_dir = tempfile.mkdtemp(prefix="mpisync-results-")
    extra_env = {"MPISYNC_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "RESULT_DIR": result_dir}
    extra_env.update(env or {})
    cmd = mpiexec_command(
        [sys.executable, str(SCRIPTS / script), *map(str, args)], workers, ps,
        mpiexec=mpiexec, flavor=detect_mpi_flavor(mpiexec), env=extra_env,
        as_root=os.geteuid() == 0, oversubscribe=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, **extra_env))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec run of {script} hung past {timeout} s\n--- stdout\n{out}\n"
                    f"--- stderr\n{err}")
    results = [json.loads(line) for f in sorted(Path(result_dir).glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    run = Run(proc.returncode, out, err, results)
    if expect_ok:
        assert run.returncode == 0, f"{script} exited {run.returncode}\n{run.output}"
    return run
