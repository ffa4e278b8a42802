"""The one way tests start MPI jobs: mpisync.launch's run_job, a timeout, the RESULT records."""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpisync.launch import detect_mpi_flavor, find_mpiexec, mpiexec_command, run_job

SCRIPTS = Path(__file__).parent / "scripts"
FORKSERVER = Path(__file__).parent / "forkserver.py"
# What every job's ranks get beside the test's own variables.
JOB_ENV = {"MPISYNC_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}


@dataclass
class Run:
    """What one job left: exit code, output, its RESULT records, and how to rerun it."""

    returncode: int
    stdout: str
    stderr: str
    results: list[dict] = field(default_factory=list)
    command: str = ""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def by_worker(self) -> dict[int, dict]:
        return {r["worker"]: r for r in self.results if r.get("role") == "worker"}

    def by_case(self) -> dict[str, dict[int, dict]]:
        """Records of programs that run several cases: ``{case: {worker: record}}``."""
        out: dict[str, dict[int, dict]] = {}
        for r in self.results:
            if r.get("role") == "worker":
                out.setdefault(r["case"], {})[r["worker"]] = r
        return out

    def assert_every_case_ran(self, names, workers: int, steps) -> dict[str, dict[int, dict]]:
        """Each case's records, after checking every worker ran it to ``steps(name)`` (None:
        not checked here)."""
        by_case = self.by_case()
        assert sorted(by_case) == sorted(names), self.describe()
        for name, records in by_case.items():
            assert sorted(records) == list(range(workers)), name
            if steps(name) is not None:
                assert {r["global_step"] for r in records.values()} == {steps(name)}, name
        return by_case

    def ps(self) -> list[dict]:
        return sorted((r for r in self.results if r.get("role") == "ps"),
                      key=lambda r: r.get("ps", 0))

    def describe(self) -> str:
        return f"rerun with:\n  {self.command}\n--- output\n{self.output}"


@functools.cache
def _results_parent() -> str:
    """Where this test process's jobs leave their RESULT records and files (a test may read
    them after the job): one directory, removed when the process exits."""
    parent = tempfile.mkdtemp(prefix="mpisync-results-")
    atexit.register(shutil.rmtree, parent, True)
    return parent


@functools.cache
def _launcher() -> tuple[str, str]:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.fail("no mpiexec found: install an MPI (make venv installs MPICH from PyPI)")
    return mpiexec, detect_mpi_flavor(mpiexec)


def mpi_flavor() -> str:
    """The MPI the tests launch with: ``"mpich"`` (make test) or ``"openmpi"``."""
    return _launcher()[1]


def run_mpi(script: str, workers: int, ps: int = 1, args=(), timeout: float = 120,
            env: dict[str, str] | None = None, expect_ok: bool = True,
            hosts: str | None = None, fork: bool = True) -> Run:
    """Launch ``workers + ps`` ranks of ``tests/scripts/<script>``; never hang the suite.

    The whole process group is killed when ``timeout`` passes, and the test fails with
    everything the ranks printed and the command that reruns the job. With ``expect_ok``
    the job must exit 0. ``hosts`` goes to ``mpiexec`` as the launcher passes it. The ranks
    are forked by this process's fork servers where they can be (``_fork_servers``); with
    ``fork=False`` always fresh Pythons.
    """
    mpiexec, flavor = _launcher()
    result_dir = tempfile.mkdtemp(prefix="job-", dir=_results_parent())
    extra_env = dict(JOB_ENV, RESULT_DIR=result_dir, **(env or {}))
    program = [str(SCRIPTS / script), *map(str, args)]

    def command(python: list[str]) -> list[str]:
        return mpiexec_command(
            python + program, workers, ps, mpiexec=mpiexec, flavor=flavor, env=extra_env,
            as_root=os.geteuid() == 0, oversubscribe=True, hosts=hosts)

    job_env = dict(os.environ, **extra_env)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items()
                     if k != "RESULT_DIR") + " " + shlex.join(command([sys.executable]))
    forked = fork and _fork_servers(flavor, workers + ps, job_env)
    cmd = command([sys.executable, str(FORKSERVER), forked] if forked else [sys.executable])
    started = time.monotonic()
    job = run_job(cmd, timeout=timeout, env=job_env, capture=True)
    _log_launch(script, workers, ps, args, time.monotonic() - started)
    results = [json.loads(line) for f in sorted(Path(result_dir).glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    run = Run(job.returncode, job.stdout, job.stderr, results, shown)
    if job.timed_out:
        pytest.fail(f"the job of {script} ran past {timeout} s and was killed; "
                    f"{run.describe()}")
    if expect_ok and run.returncode != 0:
        pytest.fail(f"{script} exited {run.returncode}; {run.describe()}")
    return run


def rank_python(ranks: int, env: dict[str, str]) -> list[str]:
    """The command that starts a rank's Python in a job of ``ranks`` ranks that something
    other than ``run_mpi`` launches (``python -m mpisync.launch``), whose ranks see ``env``:
    a client of this process's fork servers where ranks can be forked (as ``run_mpi``'s),
    else this Python."""
    _, flavor = _launcher()
    forked = _fork_servers(flavor, ranks, env)
    return [sys.executable, str(FORKSERVER), forked] if forked else [sys.executable]


# Variables a rank reads only after the fork server forked it (mpisync's own, read at its
# import or later, the job's result directory, pytest's own): jobs that differ in these alone
# share fork servers.
_READ_AFTER_FORK = ("MPISYNC_", "RESULT_DIR", "PYTEST_")


@functools.cache
def _servers(environment: frozenset) -> tuple[str, dict[str, str], dict[int, subprocess.Popen]]:
    """The fork servers of one environment (what ranks read before the fork): a test
    process whose own environment changed (an MPI initialized in it sets variables) gets
    servers of its new one, not fresh ranks from then on."""
    where = tempfile.mkdtemp(prefix="ranks-", dir=_results_parent())
    return where, dict(environment), {}


def _fork_servers(flavor: str, ranks: int, job_env: dict[str, str]) -> str | None:
    """The directory of the fork servers (tests/forkserver.py) for this job's environment,
    one per rank index, started on first use; None where a job's ranks start as fresh
    Pythons: under an MPI other than MPICH and Open MPI, with ``MPISYNC_TEST_FORK_RANKS=0``,
    or under coverage.py (it would not follow the forks). The servers import torch with the
    job's environment but for what a rank reads only after the fork (``_READ_AFTER_FORK``),
    which they leave as this process had it when they started."""
    if (flavor not in ("mpich", "openmpi") or "coverage" in sys.modules
            or os.environ.get("MPISYNC_TEST_FORK_RANKS", "1") == "0"):
        return None
    before_fork = {n: v for n, v in job_env.items() if not n.startswith(_READ_AFTER_FORK)}
    where, server_env, servers = _servers(frozenset(before_fork.items()))
    starting = {}
    for index in range(ranks):
        if index not in servers or servers[index].poll() is not None:
            with open(os.path.join(where, f"{index}.log"), "ab") as log:
                starting[index] = subprocess.Popen(
                    [sys.executable, str(FORKSERVER), "serve", os.path.join(where, str(index)),
                     str(os.getpid())],
                    env=server_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=log, start_new_session=True)
    for index, server in starting.items():
        ready = select.select([server.stdout], [], [], 300)[0]     # import torch, loaded
        if not ready or server.stdout.readline().strip() != b"ready":
            server.kill()
            pytest.fail(f"the fork server for rank {index} did not start (log: "
                        f"{where}/{index}.log); MPISYNC_TEST_FORK_RANKS=0 starts fresh ranks")
        servers[index] = server
    return where


def _log_launch(script: str, workers: int, ps: int, args, seconds: float) -> None:
    """With ``MPISYNC_TEST_LAUNCH_LOG=file``, one JSON line per job this suite starts (the
    test, the script, its ranks and wall seconds): where the suite's time goes."""
    path = os.environ.get("MPISYNC_TEST_LAUNCH_LOG")
    if path:
        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                  "script": script, "workers": workers, "ps": ps,
                  "args": [str(a) for a in args], "seconds": round(seconds, 2)}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def failing(script: str, workers: int, ps: int = 1, args=(), timeout: float = 90,
            env: dict[str, str] | None = None, fork: bool = True) -> Run:
    """A job that must end non-zero, by itself, within ``timeout`` seconds: before the
    120 s MPISYNC_TIMEOUT that ``run_mpi`` sets, so a failure noticed only as a stall does
    not pass, with room for starting the ranks on a loaded machine (11-24 s seen with one
    other job beside the suite, 40-50 s with several)."""
    run = run_mpi(script, workers, ps, args, timeout=timeout, env=env, expect_ok=False,
                  fork=fork)
    assert run.returncode != 0, f"{script} exited 0; {run.describe()}"
    return run


def labels(workers: int, ps: int) -> list[str]:
    """How mpisync names every rank of a job with the default layout (the last ps)."""
    return ([f"worker {w} (rank {w}" for w in range(workers)]
            + [f"ps {j} (rank {workers + j}" for j in range(ps)])


def assert_every_rank_says(run: Run, pattern: str, ranks: list[str]) -> None:
    """Every rank in ``ranks`` printed a line matching ``pattern`` after its name."""
    missing = [who for who in ranks
               if not re.search(re.escape(who) + r"[^)]*\)[:,]? .*" + pattern, run.output)]
    assert not missing, (f"no line matching {pattern!r} from {missing}; {run.describe()}")


def assert_init_refuses_switch(name: str, value: str = "on") -> str:
    """``mpisync.init()`` in one process with ``name=value`` (not 1 or 0) ends with the
    ConfigError that names it, raised in ``init`` itself; returns stderr."""
    import subprocess
    run = subprocess.run([sys.executable, "-c", "import mpisync; mpisync.init()"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, **{name: value}))
    assert run.returncode != 0
    assert run.stderr.rstrip().splitlines()[-1] == (
        f"mpisync.errors.ConfigError: rank 0: {name}={value!r} is not 1 (on) or 0 (off); "
        "set it to 1 (on) or 0 (off) or unset it"), run.stderr[-2000:]
    assert "in init" in run.stderr, run.stderr[-2000:]
    return run.stderr
