"""The Slurm batch template on a Slurm cluster of this machine: one node, then two.

``launch/slurm/local-cluster.sh start`` installs (apt) and starts munge, slurmctld and
slurmd; each test submits ``launch/slurm/train.sbatch``, waits for it, and checks
the job's exit code, Slurm's record of it (``sacct -c``: the job completion log), and the
example's output; one is signalled as before its time limit, requeues itself and resumes. The two-node tests come last, so that the cluster restarts once (with
``start --nodes 2``); a test asks for the size it needs, so any order works. Skipped,
saying why, only where root or apt is missing.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi_helpers import run_mpi

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "launch" / "slurm" / "local-cluster.sh"
TEMPLATE = ROOT / "launch" / "slurm" / "train.sbatch"


class LocalCluster:
    """The local cluster of this module: started with as many nodes as a test asks for."""

    nodes = 0

    def start(self, nodes: int) -> None:
        if nodes == self.nodes:
            return
        started = subprocess.run(["bash", str(CLUSTER), "start", "--nodes", str(nodes)],
                                 capture_output=True, text=True, timeout=600, check=False)
        assert started.returncode == 0, started.stdout + started.stderr
        self.nodes = nodes


#: The cluster's daemons are the machine's, not the checkout's: two suites (two checkouts)
#: on one machine take turns with it, the second waiting here for the first's tests.
MACHINE_LOCK = "/tmp/mpisync-local-slurm.lock"


@pytest.fixture(scope="module")
def local_cluster():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (apt-get, daemons)")
    if shutil.which("apt-get") is None and shutil.which("sbatch") is None:
        pytest.skip("neither Slurm nor apt-get to install it is here")
    with open(MACHINE_LOCK, "w") as lock:
        deadline = time.monotonic() + 420     # within pytest-timeout's 600 s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another suite held the local Slurm cluster ({MACHINE_LOCK}) "
                                "for 7 minutes", pytrace=False)
                time.sleep(1)
        try:
            yield LocalCluster()
        finally:
            subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120,
                           check=False)


@pytest.fixture
def slurm(local_cluster):
    local_cluster.start(1)


@pytest.fixture
def slurm_two_nodes(local_cluster):
    local_cluster.start(2)


def submit(tmp_path: Path, *options: str, cancel_on: str | None = None,
           **env: str) -> tuple[int, str, str]:
    """Submit the template with sbatch ``options`` and wait: (exit code, output, Slurm's
    State|ExitCode). A job whose output shows ``cancel_on`` is cancelled at once.

    The wait reads Slurm's job completion log (``sacct -c``) every half second: ``sbatch
    --wait`` polls at 2, 4, 8 and then 10 s, which leaves a job of a few seconds waited
    on for up to twice its length."""
    job, said = sbatch(tmp_path, *options, **env)
    deadline = time.monotonic() + 400
    record = ""
    while not record:
        time.sleep(0.5)
        record = completed(job)
        if not record and time.monotonic() > deadline:
            subprocess.run(["scancel", job], capture_output=True, timeout=60, check=False)
            record = f"not finished after 400 s (job {job})"
        if cancel_on and any(cancel_on in p.read_text(errors="replace")
                             for p in tmp_path.glob("job-*.out")):
            subprocess.run(["scancel", job], capture_output=True, timeout=60, check=False)
            cancel_on = None
    # errors="replace": slurmstepd's messages about a refused rank have held stray bytes
    text = "".join(p.read_text(errors="replace") for p in tmp_path.glob("job-*.out"))
    exit_code = re.fullmatch(r"\w+\|(\d+):(\d+)", record)
    rc = (int(exit_code.group(1)) or int(exit_code.group(2))) if exit_code else -1
    if exit_code and not rc and not record.startswith("COMPLETED|"):
        rc = 1                                  # cancelled (or failed) without a code
    return rc, text + said, record


def sbatch(tmp_path: Path, *options: str, **env: str) -> tuple[str, str]:
    """Submit the template with sbatch ``options``, its output in ``tmp_path/job-<id>.out``
    and ``env`` added to the job's: the job's id and sbatch's stderr."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "job-%j.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--time=00:05:00", f"--output={out}", *options,
         "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())]),
         str(TEMPLATE)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env=dict(os.environ, MPISYNC_VENV=str(Path(sys.executable).parents[1]),
                 MPISYNC_TIMEOUT="120"))
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout.strip().split(";")[0], submitted.stderr


def completed(job: str) -> str:
    """Slurm's State|ExitCode of ``job`` once it has ended, else ``""``."""
    found = subprocess.run(["sacct", "-c", "-j", job, "-n", "-P", "-o", "State,ExitCode"],
                           capture_output=True, text=True, timeout=60, check=False)
    lines = found.stdout.strip().splitlines()
    return lines[-1] if lines else ""


# Slurm 22.05's PMI-1 server (in its mpi/pmi2 plugin, which MPICH speaks PMI-1 to) takes
# each request in one read(): a rank's long put (its address, in segments of 1 KB) can
# arrive in pieces and be refused, on a quiet machine too (a third to a half of the jobs
# on two nodes), before MPI_Init returns; the job then aborts or hangs until its time limit.
# MPICH's PMI-2 client (MPIR_CVAR_PMI_VERSION=2) fails in MPI_Init under this Slurm. Such
# a job is cancelled as soon as its output shows the refusal and submitted again.
PMI_REFUSED = "mpi/pmi2: invalid client request"


def submit_training(tmp_path: Path, *options: str, patience: float = 240,
                    **env: str) -> tuple[int, str, str]:
    """``submit``, again when Slurm's PMI server refused a rank: for up to ``patience``
    seconds (a refused job is cancelled within seconds; while a build ran beside, eight in
    a row were refused), then the last refusal is the test's failure."""
    start, attempt = time.monotonic(), 0
    while True:
        rc, out, record = submit(tmp_path / f"try{attempt}", *options, cancel_on=PMI_REFUSED,
                                 **env)
        attempt += 1
        # a cancelled job may still leave sbatch's status 0: the output decides
        if PMI_REFUSED not in out or time.monotonic() - start > patience:
            return rc, out, record


@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_the_batch_template_trains_digits(slurm, tmp_path, launcher):
    rc, out, record = submit_training(tmp_path, LAUNCHER=launcher)
    assert rc == 0, out
    assert record == "COMPLETED|0:0", (record, out)
    assert f"2 workers + 1 ps, {launcher}" in out, out
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9, out


def test_a_job_whose_training_fails_fails_in_slurm(slurm, tmp_path):
    rc, out, record = submit(tmp_path, SCRIPT="tests/scripts/errors.py", ARGS="--case raise")
    assert rc != 0, out
    assert record.startswith("FAILED|"), (record, out)
    assert "ValueError: boom on purpose in user code" in out, out


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def test_a_job_warned_of_its_time_limit_requeues_and_resumes_bitwise(slurm, tmp_path):
    """``sbatch --requeue --signal=B:USR1@30`` of the template running
    tests/scripts/preemption.py (a Checkpointer, 12 deterministic steps), and mid-run
    ``scancel --signal=USR1 --batch``: what Slurm sends the batch shell 30 s before the
    time limit. The job saves a checkpoint, exits 75 and the template requeues it; Slurm
    holds a requeued job about three minutes (its BeginTime, while the stopped run's
    credential is revoked), which the test lifts after a few seconds as an operator would
    (``scontrol update StartTime=now``); the job resumes from the
    checkpoint and ends COMPLETED with the parameters of a run nothing stopped."""
    unbroken = tmp_path / "unbroken"
    (unbroken / "ckpt").mkdir(parents=True)
    run_mpi("restarts.py", 2, 1, args=["none", unbroken / "ckpt", unbroken / "final.pt"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    job, said = sbatch(tmp_path / "job", "--requeue", "--signal=B:USR1@30",
                       "--open-mode=append", SCRIPT="tests/scripts/preemption.py",
                       ARGS=f"slow {ckpt}")
    signalled = released = False
    held_since: float | None = None
    record, text = "", ""
    deadline = time.monotonic() + 400
    while not record.startswith(ENDED):
        time.sleep(0.5)
        text = "".join(p.read_text(errors="replace") for p in (tmp_path / "job").glob("*.out"))
        if not signalled and "preemption.py: starts at global step 0" in text:
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True,
                           capture_output=True, timeout=60)
            signalled = True
        if signalled and not released and "requeueing" in text:
            reason = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"],
                                    capture_output=True, text=True, timeout=60, check=False)
            held = reason.stdout.split() == ["PENDING", "BeginTime"]
            held_since = (held_since or time.monotonic()) if held else None
            # the stopped run's credential is revoked at the requeue, by the second: a
            # start in that same second is refused ("Job credential revoked", FAILED)
            if held_since and time.monotonic() - held_since > 3:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                               check=True, capture_output=True, timeout=60)
                released = True
        record = completed(job)
        if not record.startswith(ENDED) and time.monotonic() > deadline:
            subprocess.run(["scancel", job], capture_output=True, timeout=60, check=False)
            pytest.fail(f"job {job} not finished after 400 s ({record});\n{text}{said}")
    assert record == "COMPLETED|0:0", (record, text)
    stopped = re.findall(r"^mpisync: stopped by SIGUSR1 at global step (\d+); checkpoint "
                         r"\S+; exit status 75$", text, re.MULTILINE)
    assert len(stopped) == 1, text
    assert "train.sbatch: the job stopped politely and saved a checkpoint; requeueing" in text
    assert f"preemption.py: starts at global step {stopped[0]}" in text, text
    assert 0 < int(stopped[0]) < 12, text
    final, expected = torch.load(ckpt / "final.pt"), torch.load(unbroken / "final.pt")
    assert sorted(final) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(final[name], value), (name, final[name] - value)


def nodes_of_ps(out: str) -> dict[int, str]:
    """The node of each ps, from the digits example's "ranks by node" lines."""
    found = {}
    for node, roles in re.findall(r"^  (\S+): (.*)$", out, re.MULTILINE):
        for index in re.findall(r"ps (\d+) \(rank", roles):
            found[int(index)] = node
    return found


# srun on two nodes: Slurm 22.05's PMI server (PMI_REFUSED above) refused MPICH's address
# put in every try for minutes (46 in a row) from some checkouts and not from others, the
# same day, the machine quiet; UCX_TLS=self,sm,tcp got it through once, and failed the
# next time with no transport between the ranks. The two-node world itself is proven by
# the mpiexec case; srun's refusal is Slurm's, so the case may fail, not hide a pass, and
# it is tried for twenty seconds, not four minutes (a checkout that is refused is refused
# every time).
SRUN_TWO_NODES = pytest.param("srun", marks=pytest.mark.xfail(
    reason="Slurm 22.05's PMI server refuses MPICH's address put from some checkouts",
    strict=False))


@pytest.mark.parametrize("launcher", ["mpiexec", SRUN_TWO_NODES])
def test_two_nodes_get_a_ps_each(slurm_two_nodes, tmp_path, launcher):
    rc, out, record = submit_training(tmp_path, "--nodes=2", "--ntasks-per-node=2",
                                      "--ntasks=4", LAUNCHER=launcher, NUM_PS="2",
                                      ARGS="--epochs 3",
                                      patience=20 if launcher == "srun" else 240)
    assert rc == 0, out
    assert record == "COMPLETED|0:0", (record, out)
    assert f"on n[1-2]: 2 workers + 2 ps, {launcher}" in out, out
    assert float(re.search(r"test accuracy: ([0-9.]+)", out).group(1)) >= 0.9, out
    assert nodes_of_ps(out) == {0: "n1", 1: "n2"}, out

