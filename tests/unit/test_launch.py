"""One-process tests of the launch helper: command lines and argument parsing, no MPI job."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from mpisync.launch import (
    ATTEMPT_ENV,
    NUM_PS_ENV,
    JobResult,
    detect_mpi_flavor,
    explain_status,
    find_mpiexec,
    host_map,
    main,
    mpiexec_command,
    parse_args,
    run_command,
    run_job,
)
from mpisync.restarts import launcher_status, restart_loop
from mpisync.runtime import failures

PROG = ["python", "train.py", "--epochs", "2"]


# --- mpiexec_command: Open MPI ---------------------------------------------------------


def test_openmpi_plain():
    cmd = mpiexec_command(PROG, 3, 2, mpiexec="mpirun", flavor="openmpi")
    assert cmd == ["mpirun", "-n", "5", "-x", f"{NUM_PS_ENV}=2", *PROG]


def test_openmpi_root_oversubscribe_hosts_env_extra():
    cmd = mpiexec_command(
        PROG,
        2,
        1,
        mpiexec="/opt/ompi/bin/mpirun",
        flavor="openmpi",
        hosts="a:2,b:1",
        env={"OMP_NUM_THREADS": "1"},
        extra=["--bind-to", "none"],
        as_root=True,
        oversubscribe=True,
    )
    assert cmd == [
        "/opt/ompi/bin/mpirun", "-n", "3",
        "--allow-run-as-root", "--oversubscribe",
        "-H", "a:2,b:1",
        "-x", f"{NUM_PS_ENV}=1", "-x", "MPISYNC_HOSTMAP=a:2,b:1", "-x", "OMP_NUM_THREADS=1",
        "--bind-to", "none",
        *PROG,
    ]  # fmt: skip


def test_openmpi_oversubscribed_ranks_are_not_bound_unless_asked():
    cmd = mpiexec_command(PROG, 3, 2, mpiexec="mpirun", flavor="openmpi", oversubscribe=True)
    assert cmd[:6] == ["mpirun", "-n", "5", "--oversubscribe", "--bind-to", "none"]
    cmd = mpiexec_command(PROG, 3, 2, flavor="openmpi", oversubscribe=True,
                          extra=["--bind-to", "core"])
    assert cmd.count("--bind-to") == 1 and "core" in cmd


def test_openmpi_flags_only_when_asked():
    cmd = mpiexec_command(PROG, 1, 1, flavor="openmpi", as_root=False, oversubscribe=False)
    assert "--allow-run-as-root" not in cmd
    assert "--oversubscribe" not in cmd
    assert "-H" not in cmd


@pytest.mark.parametrize("flavor, ft", [("openmpi", ["--with-ft", "ulfm"]), ("mpich", []),
                                        ("intel", [])])
def test_survive_worker_loss_asks_for_fault_tolerance_where_the_mpi_has_it(flavor, ft):
    cmd = mpiexec_command(PROG, 3, 1, mpiexec="m", flavor=flavor, survive_worker_loss=True)
    assert cmd[3:3 + len(ft)] == ft
    assert ("MPISYNC_SURVIVE_WORKER_LOSS=1" in cmd
            or cmd[cmd.index("MPISYNC_SURVIVE_WORKER_LOSS") + 1] == "1")
    assert parse_args(["--survive-worker-loss", "--workers", "3", "--ps", "1", "--",
                       "p"]).survive_worker_loss
    assert "--with-ft" not in mpiexec_command(PROG, 3, 1, flavor="openmpi")
    assert explain_status(3, flavor, survive_worker_loss=True).startswith(
        "the job trained to its end but lost workers (exit status 3)")


@pytest.mark.parametrize("flavor", ["openmpi", "mpich", "intel"])
def test_a_job_stopped_by_a_signal_is_explained_as_such(flavor):
    assert explain_status(75, flavor) == (
        "the job stopped after a signal (exit status 75): the chief wrote a checkpoint, "
        "named above; start it again to resume (--restarts does)")


# --- mpiexec_command: MPICH / Intel (Hydra) -----------------------------------------------


@pytest.mark.parametrize("flavor", ["mpich", "intel"])
def test_hydra_plain(flavor):
    cmd = mpiexec_command(PROG, 4, 2, flavor=flavor)
    assert cmd == ["mpiexec", "-n", "6", "-genv", NUM_PS_ENV, "2", *PROG]


@pytest.mark.parametrize("flavor", ["mpich", "intel"])
def test_hydra_hosts_env_and_no_openmpi_flags(flavor):
    cmd = mpiexec_command(
        PROG,
        2,
        2,
        flavor=flavor,
        hosts="n1,n2",
        env={"A": "x y"},
        as_root=True,
        oversubscribe=True,
    )
    assert cmd == [
        "mpiexec", "-n", "4",
        "-hosts", "n1,n2",
        "-genv", NUM_PS_ENV, "2", *host_map_env(flavor, "n1:1,n2:1,n1:1,n2:1"),
        "-genv", "A", "x y",
        *PROG,
    ]  # fmt: skip


def host_map_env(flavor, text):
    """MPICH's round of the hosts reaches the ranks; Intel MPI's placement is not known."""
    return ["-genv", "MPISYNC_HOSTMAP", text] if flavor == "mpich" else []


# --- hosts and hostfiles: the host map the ranks get --------------------------------------


@pytest.mark.parametrize("flavor, option", [("openmpi", "--hostfile"), ("mpich", "-f"),
                                            ("intel", "-f")])
def test_hostfile_is_passed_in_each_flavors_spelling(flavor, option):
    cmd = mpiexec_command(PROG, 1, 1, flavor=flavor, hostfile="/h")
    assert cmd[cmd.index(option) + 1] == "/h"
    assert not any("MPISYNC_HOSTMAP" in part for part in cmd)   # contents not read: no map


def test_hostfile_contents_give_the_host_map():
    cmd = mpiexec_command(PROG, 3, 1, flavor="openmpi", hostfile="/h",
                          hostfile_text="a slots=1  # the chief\nb slots=3\n")
    assert "MPISYNC_HOSTMAP=a:1,b:3" in cmd
    cmd = mpiexec_command(PROG, 3, 1, flavor="mpich", hostfile="/h",
                          hostfile_text="# hosts\na:1\nb:3\n")
    assert cmd[cmd.index("MPISYNC_HOSTMAP") + 1] == "a:1,b:3"


def test_hosts_or_hostfile_not_both():
    with pytest.raises(ValueError, match="not both"):
        mpiexec_command(PROG, 1, 1, hosts="a", hostfile="/h")


@pytest.mark.parametrize(
    "size, flavor, hosts, hostfile, expected",
    [
        (4, "mpich", "a:2,b:2", None, "a:2,b:2"),
        (4, "openmpi", "a:2,b:2", None, "a:2,b:2"),
        (4, "mpich", "a,b", None, "a:1,b:1,a:1,b:1"),            # Hydra goes round
        (4, "openmpi", "a,b", None, "a:2,b:2"),                   # Open MPI shares out
        (5, "mpich", "a:2,b:1", None, "a:2,b:1,a:2"),
        (5, "openmpi", "a:2,b:1", None, "a:3,b:2"),
        (3, "openmpi", "a:3,b:3", None, "a:3"),
        (4, "intel", "a:2,b:2", None, None),                      # placed by cores
        (4, "openmpi", None, "a\nb\n", None),                   # slots: the cores
        (4, "mpich", None, "a\nb\n", "a:1,b:1,a:1,b:1"),
        (4, "mpich", None, None, None),
    ],
)
def test_host_map(size, flavor, hosts, hostfile, expected):
    assert host_map(size, flavor, hosts, hostfile) == expected


@pytest.mark.parametrize(
    "flavor, hosts, hostfile, message",
    [
        ("mpich", "a:0", None, "expected a count >= 1, got '0'"),
        ("openmpi", "a,,b", None, "empty host name"),
        ("mpich", None, "a slots=2\n", "MPICH's hostfiles write 'host:N'"),
        ("openmpi", None, "a:2\n", "Open MPI's hostfiles write 'host slots=N'"),
        ("openmpi", None, "# nothing\n", "names no host"),
    ],
)
def test_host_lists_mpiexec_would_not_read(flavor, hosts, hostfile, message):
    with pytest.raises(ValueError, match=message):
        host_map(4, flavor, hosts, hostfile)


def test_default_flavor_is_mpich():
    assert mpiexec_command(["p"], 1, 1)[:3] == ["mpiexec", "-n", "2"]
    assert "-genv" in mpiexec_command(["p"], 1, 1)


def test_num_ps_always_passed_and_argv_last():
    for flavor in ("openmpi", "mpich"):
        cmd = mpiexec_command(["prog", "-n", "7"], 1, 3, flavor=flavor)
        assert cmd[-3:] == ["prog", "-n", "7"]
        assert any(NUM_PS_ENV in part for part in cmd)


def test_env_may_repeat_the_same_num_ps():
    cmd = mpiexec_command(["p"], 1, 2, flavor="openmpi", env={NUM_PS_ENV: "2"})
    assert cmd.count(f"{NUM_PS_ENV}=2") == 1


def test_argv_not_mutated():
    argv = ["p", "x"]
    extra = ["--foo"]
    mpiexec_command(argv, 1, 1, extra=extra)
    assert argv == ["p", "x"] and extra == ["--foo"]


# --- mpiexec_command: validation -------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, -1])
def test_bad_num_workers(workers):
    with pytest.raises(ValueError, match=f"num_workers must be >= 1, got {workers}"):
        mpiexec_command(PROG, workers, 1)


@pytest.mark.parametrize("num_ps", [0, -3])
def test_bad_num_ps(num_ps):
    with pytest.raises(ValueError, match=f"num_ps must be >= 1, got {num_ps}"):
        mpiexec_command(PROG, 1, num_ps)


@pytest.mark.parametrize("value", [1.0, "2", True])
def test_count_must_be_int(value):
    with pytest.raises(TypeError, match="num_workers must be an int"):
        mpiexec_command(PROG, value, 1)


def test_empty_argv():
    with pytest.raises(ValueError, match="argv is empty"):
        mpiexec_command([], 1, 1)


def test_unknown_flavor():
    with pytest.raises(ValueError, match="flavor must be one of"):
        mpiexec_command(PROG, 1, 1, flavor="unknown")


def test_conflicting_num_ps_in_env():
    with pytest.raises(ValueError, match=f"{NUM_PS_ENV}=3 but num_ps is 2"):
        mpiexec_command(PROG, 1, 2, env={NUM_PS_ENV: "3"})


@pytest.mark.parametrize("key", ["", "A=B"])
def test_bad_env_name(key):
    with pytest.raises(ValueError, match="bad environment variable name"):
        mpiexec_command(PROG, 1, 1, env={key: "1"})


# --- argument parsing ----------------------------------------------------------------------


def test_parse_with_double_dash():
    ns = parse_args(["--workers", "2", "--ps", "1", "--", "python", "t.py", "--ps", "9", "--"])
    assert (ns.workers, ns.ps) == (2, 1)
    assert ns.program == ["python", "t.py", "--ps", "9", "--"]
    assert ns.hosts is None and ns.hostfile is None
    assert ns.mpiexec is None and ns.timeout is None
    assert ns.flavor == "auto"


def test_parse_all_options():
    ns = parse_args(
        [
            "--workers=4", "--ps=2", "--hosts", "a:3,b:3", "--mpiexec", "/x/mpirun",
            "--timeout", "90", "--flavor", "openmpi", "--", "prog",
        ]
    )  # fmt: skip
    assert (ns.workers, ns.ps, ns.hosts, ns.mpiexec) == (4, 2, "a:3,b:3", "/x/mpirun")
    assert ns.timeout == 90.0 and ns.flavor == "openmpi" and ns.program == ["prog"]


def test_parse_hostfile():
    ns = parse_args(["--workers", "2", "--ps", "2", "--hostfile", "hf", "--", "p"])
    assert ns.hostfile == "hf" and ns.hosts is None


def test_a_hostfile_that_cannot_be_read_stops_before_mpiexec(tmp_path, capsys):
    fake = _fake_mpiexec(tmp_path, "HYDRA build details:")
    missing = tmp_path / "no-such-hostfile"
    status = main(["--workers", "1", "--ps", "1", "--mpiexec", fake, "--hostfile",
                   str(missing), "--", "p"])
    assert status == 2 and str(missing) in capsys.readouterr().err


def test_parse_without_double_dash():
    ns = parse_args(["--workers", "1", "--ps", "1", "python", "t.py", "--lr", "0.1"])
    assert ns.program == ["python", "t.py", "--lr", "0.1"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "2", "--ps", "1"],  # no program
        ["--workers", "2", "--ps", "1", "--"],  # empty program
        ["--ps", "1", "--", "p"],  # --workers missing
        ["--workers", "2", "--", "p"],  # --ps missing
        ["--workers", "0", "--ps", "1", "--", "p"],
        ["--workers", "2", "--ps", "-1", "--", "p"],
        ["--workers", "two", "--ps", "1", "--", "p"],
        ["--workers", "2", "--ps", "1", "--timeout", "0", "--", "p"],
        ["--workers", "2", "--ps", "1", "--flavor", "lam", "--", "p"],
        ["--workers", "2", "--ps", "1", "stray", "--", "p"],
        ["--workers", "2", "--ps", "1", "--hosts", "a", "--hostfile", "h", "--", "p"],
    ],
)
def test_parse_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


# --- finding and identifying mpiexec ------------------------------------------------------


def test_find_mpiexec_order(tmp_path):
    assert find_mpiexec("/given", environ={"MPIEXEC": "/env"}) == "/given"
    assert find_mpiexec(None, environ={"MPIEXEC": "/env"}) == "/env"


def test_detect_flavor_of_missing_program(tmp_path):
    assert detect_mpi_flavor(str(tmp_path / "no-such-mpiexec")) == "unknown"


def _fake_mpiexec(tmp_path, text):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{text}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    "text, flavor",
    [
        ("mpirun (Open MPI) 4.1.5", "openmpi"),
        ("HYDRA build details:", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "intel"),
        ("something else", "unknown"),
    ],
)
def test_detect_flavor_from_version_text(tmp_path, text, flavor):
    assert detect_mpi_flavor(_fake_mpiexec(tmp_path, text)) == flavor


def test_detect_flavor_of_venv_mpiexec():
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.access(mpiexec, os.X_OK):
        pytest.skip(f"no mpiexec beside {sys.executable}")
    assert detect_mpi_flavor(mpiexec) == "mpich"


# --- running ---------------------------------------------------------------------------------


def test_run_command_passes_exit_status():
    assert run_command([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def _alive(pid):
    """True if ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_run_command_timeout_kills_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    assert run_command([sys.executable, "-c", code], timeout=2) == 124
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # a killed process needs a moment to go
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


# --- --restarts: arguments, failure records, the restart loop -----------------------------


def test_restart_arguments_default_to_none_and_two_seconds():
    ns = parse_args(["--workers", "2", "--ps", "1", "--", "p"])
    assert (ns.restarts, ns.restart_backoff) == (0, 2.0)
    ns = parse_args(["--workers", "2", "--ps", "1", "--restarts", "3", "--restart-backoff", "0",
                     "--", "p"])
    assert (ns.restarts, ns.restart_backoff) == (3, 0.0)


@pytest.mark.parametrize("argv, says", [
    (["--restarts", "-1"], "argument --restarts: must be >= 0, got -1"),
    (["--restarts", "x"], "argument --restarts: expected a number of restarts, got 'x'"),
    (["--restart-backoff", "-2"], "argument --restart-backoff: must be a number of seconds"),
    (["--restart-backoff", "soon"], "argument --restart-backoff: expected a number of seconds"),
])
def test_bad_restart_arguments_are_refused_naming_them(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--workers", "2", "--ps", "1", *argv, "--", "p"])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def _record(rank, error="RuntimeError: boom", step=7, peer=False, label=None):
    return {"rank": rank, "label": label or f"worker {rank} (rank {rank} on h)", "error": error,
            "global_step": step, "peer": peer}


def test_failure_records_are_read_by_rank_and_the_origin_is_the_first_not_a_peer(tmp_path):
    assert failures.write_failure(tmp_path, 2, "ps 0 (rank 2 on h)", "PeerError: stopping", None,
                                  True) == str(tmp_path / "rank-2.json")
    failures.write_failure(tmp_path, 1, "worker 1 (rank 1 on h)", "ValueError: bad", 4, False)
    failures.write_failure(tmp_path, 0, "worker 0 (rank 0 on h)", "PeerError: stopping", 4, True)
    (tmp_path / "rank-3.json").write_text('{"rank": 3, "err')       # half written: skipped
    (tmp_path / "other.json").write_text("{}")
    records = failures.read_failures(tmp_path)
    assert [r["rank"] for r in records] == [0, 1, 2]
    assert records[1] == _record(1, "ValueError: bad", 4, label="worker 1 (rank 1 on h)")
    assert failures.origin(records) == records[1]
    assert failures.origin([records[0], records[2]]) is None        # peers only
    assert failures.read_failures(tmp_path / "missing") == []
    assert failures.describe(records[1]) == "worker 1 (rank 1 on h): ValueError: bad, at global step 4"
    assert failures.describe(records[2]) == "ps 0 (rank 2 on h): PeerError: stopping"
    assert failures.describe(None).startswith("no rank recorded an error")


def test_writing_a_record_never_raises(tmp_path):
    assert failures.write_failure(tmp_path / "missing", 0, "w", "E: x", 1, False) is None
    assert failures.write_failure(tmp_path, "?", "w", "E: x", 1, False) is None


def test_the_error_is_its_type_and_the_first_line_of_its_message():
    assert failures.error_text(RuntimeError, RuntimeError("boom\nat line 2")) == \
        "RuntimeError: boom"
    assert failures.error_text(KeyError, KeyError()) == "KeyError"


def test_the_same_failure_is_the_same_error_at_the_same_global_step():
    assert failures.same_failure(_record(0), _record(1, label="other"))
    assert not failures.same_failure(_record(0), _record(0, step=8))
    assert not failures.same_failure(_record(0), _record(0, error="RuntimeError: bang"))
    assert not failures.same_failure(None, _record(0))
    assert not failures.same_failure(None, None)     # no record: never the same way


class _Attempts:
    """A job that ends with ``statuses`` in turn, each attempt writing ``records[k]`` and,
    where ``stops[k]`` is a step, the chief's record of a polite stop there."""

    def __init__(self, statuses, records=(), signalled=None, stops=()):
        self.statuses, self.records, self.signalled = list(statuses), list(records), signalled
        self.stops = list(stops)
        self.envs: list[dict] = []

    def __call__(self, env):
        k = len(self.envs)
        self.envs.append(env)
        for record in (self.records[k] if k < len(self.records) else []):
            failures.write_failure(env["MPISYNC_FAILURE_DIR"], record["rank"], record["label"],
                                   record["error"], record["global_step"], record["peer"])
        if k < len(self.stops) and self.stops[k] is not None:
            failures.write_stop(env["MPISYNC_FAILURE_DIR"], self.stops[k])
        return JobResult(self.statuses[k], signalled=self.signalled)


def _loop(job, tmp_path, restarts=2, lost_ok=True):
    said, slept = [], []
    status = restart_loop(job, lambda s: f"the job failed with exit status {s}", restarts, 1.5,
                          str(tmp_path), say=said.append, sleep=slept.append, lost_ok=lost_ok)
    return status, said, slept


@pytest.mark.parametrize("survives", [True, False])
def test_status_3_ends_the_loop_only_where_the_job_survives_lost_workers(tmp_path, survives):
    """LOST_WORKERS_EXIT (3) is how a job that survived lost workers ends (done); without
    --survive-worker-loss it is a program's own status, a failure that is started again."""
    job = _Attempts([3, 0], [[_record(0)]])
    status, said, slept = _loop(job, tmp_path, lost_ok=survives)
    assert status == (3 if survives else 0)
    assert len(job.envs) == (1 if survives else 2) and len(slept) == (0 if survives else 1)
    assert said == [] if survives else said[0].startswith(
        "attempt 2 of 3: the job failed with exit status 3; what failed first: "), said


def test_restarts_until_success_each_attempt_numbered_with_its_own_directory(tmp_path):
    job = _Attempts([137, 1, 0], [[], [_record(0)]])
    status, said, slept = _loop(job, tmp_path)
    assert status == 0 and slept == [1.5, 1.5]
    assert [e[ATTEMPT_ENV] for e in job.envs] == ["0", "1", "2"]
    assert [e["MPISYNC_FAILURE_DIR"] for e in job.envs] == [
        str(tmp_path / f"attempt-{k}") for k in range(3)]
    assert said == [
        ("attempt 2 of 3: the job failed with exit status 137; what failed first: no rank "
         "recorded an error (an error before mpisync.init(): see the output above; or a rank "
         "killed, out of memory, a crash); starting the job again in 1.5 s"),
        ("attempt 3 of 3: the job failed with exit status 1; what failed first: worker 0 "
         "(rank 0 on h): RuntimeError: boom, at global step 7; starting the job again in "
         "1.5 s")]


def test_lost_workers_is_success_and_gives_up_after_the_restarts(tmp_path):
    assert _loop(_Attempts([3]), tmp_path)[:2] == (3, [])
    status, said, _ = _loop(_Attempts([1, 2, 4], [[_record(0)], [_record(0, step=8)]]),
                            tmp_path / "b")
    assert status == 4 and said[-1] == "gave up after 2 restarts"
    assert said[-2].startswith("the job failed with exit status 4; what failed first: no rank")


def test_the_same_failure_twice_stops_the_restarts(tmp_path):
    job = _Attempts([1, 1, 0], [[_record(1, peer=True), _record(2)]] * 2)
    status, said, slept = _loop(job, tmp_path)
    assert status == 1 and len(job.envs) == 2 and slept == [1.5]
    assert said[-1] == ("the job failed the same way twice (worker 2 (rank 2 on h): "
                        "RuntimeError: boom, at global step 7): not starting it again "
                        "(a bug is not a fault)")
    job = _Attempts([137, 137, 0])            # no records: never the same way
    assert _loop(job, tmp_path / "b")[0] == 0 and len(job.envs) == 3


def test_a_preempted_job_starts_again_at_once_not_counted(tmp_path):
    job = _Attempts([75, 75, 1, 0], [[], [], [_record(0)]], stops=[3, 6])
    status, said, slept = _loop(job, tmp_path, restarts=1)
    assert status == 0 and slept == [1.5] and len(job.envs) == 4
    assert said[0] == ("attempt 2 of 3: the job stopped after a signal and wrote a checkpoint "
                       "at global step 3 (exit status 75); starting it again at once")
    assert said[2].startswith("attempt 4 of 4: the job failed with exit status 1;")


def test_status_75_without_a_polite_stop_or_without_progress_counts_as_a_failure(tmp_path):
    """A program that exits 75 itself (no stop recorded) or stops again at the step it
    stopped at last time is restarted as a failure: counted, with the backoff, so that it
    cannot loop for ever."""
    status, said, slept = _loop(_Attempts([75] * 5), tmp_path, restarts=2)
    assert status == 75 and slept == [1.5, 1.5] and said[-1] == "gave up after 2 restarts"
    assert said[0] == ("attempt 2 of 3: the job exited with status 75 but recorded no polite "
                       "stop (mpisync.Checkpointer records one with its checkpoint); what "
                       "failed first: no rank recorded an error (an error before "
                       "mpisync.init(): see the output above; or a rank killed, out of "
                       "memory, a crash); starting the job again in 1.5 s")
    job = _Attempts([75, 75, 75, 75], stops=[4, 4, 4, 4])
    status, said, slept = _loop(job, tmp_path / "b", restarts=1)
    assert status == 75 and len(job.envs) == 3 and slept == [1.5]
    assert said[1].startswith("attempt 3 of 3: the job stopped after a signal again at global "
                              "step 4, no step since the last stop (exit status 75);")


def test_a_signal_to_the_launcher_ends_the_restarts(tmp_path):
    job = _Attempts([75, 0], signalled=signal.SIGTERM, stops=[2])
    status, said, slept = _loop(job, tmp_path)
    assert status == 75 and len(job.envs) == 1 and not slept
    assert said == [("the job stopped after a signal and wrote a checkpoint at global step 2 "
                     "(exit status 75); not starting it again: this launcher was sent SIGTERM")]


def test_a_job_ended_by_a_polite_signal_it_did_not_stop_on_exits_75_saying_so(tmp_path):
    """SIGUSR1 or SIGUSR2 passed on to a job whose ranks were still starting (no
    Checkpointer yet: the signal's default action ended them): the launcher's status is 75,
    resume from the newest checkpoint; after SIGTERM, a timeout, success or a polite stop
    the attempt's status stands."""
    job = _Attempts([138, 0], signalled=signal.SIGUSR1)
    status, said, slept = _loop(job, tmp_path)
    assert status == 75 and len(job.envs) == 1 and not slept
    assert said == [
        ("the job failed with exit status 138; not starting it again: this launcher was sent "
        "SIGUSR1"),
        ("exit status 75, not 138: this launcher passed SIGUSR1 on to the job, which ended by "
        "it before every rank could stop politely (a rank ends by the signal until its "
        "mpisync.Checkpointer is made); resume from the newest checkpoint")]
    said = []
    assert launcher_status(JobResult(12, signalled=signal.SIGUSR2), said.append) == 75
    assert said[0].startswith("exit status 75, not 12: this launcher passed SIGUSR2 on")
    said = []                          # the chief had stopped; a later signal ended the ranks
    assert launcher_status(JobResult(143, signalled=signal.SIGUSR1), said.append, 12) == 75
    assert said == [("exit status 75, not 143: this launcher passed SIGUSR1 on to the job, "
                     "which stopped politely at global step 12 with a checkpoint; a signal "
                     "ended its ranks while they exited; resume from that checkpoint")]
    said = []
    for result in (JobResult(143, signalled=signal.SIGTERM), JobResult(1),
                   JobResult(124, timed_out=True, signalled=signal.SIGUSR1),
                   JobResult(0, signalled=signal.SIGUSR1), JobResult(3, signalled=signal.SIGUSR1),
                   JobResult(75, signalled=signal.SIGUSR1)):
        assert launcher_status(result, said.append) == result.returncode
    assert said == []                  # none of these is turned into 75


def test_the_job_gets_a_signal_the_launcher_gets_and_the_result_names_it():
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
            "os.kill(os.getppid(), signal.SIGUSR1)\n"
            "time.sleep(60)\n")
    result = run_job([sys.executable, "-c", code], timeout=60)
    assert (result.returncode, result.signalled) == (75, signal.SIGUSR1)


FAKE_MPIEXEC = '''#!{python}
import os, subprocess, sys
if sys.argv[1:] == ["--version"]:
    print("HYDRA build details: fake"); sys.exit(0)
args, env = sys.argv[3:], dict(os.environ)
while args[0] == "-genv":
    env[args[1]] = args[2]; args = args[3:]
sys.exit(subprocess.call(args, env=env))
'''

FAILS_FIRST = '''import json, os, sys
attempt, where = os.environ["MPISYNC_ATTEMPT"], os.environ["MPISYNC_FAILURE_DIR"]
open(sys.argv[1], "a").write(attempt + " " + os.path.basename(where) + "\\n")
if attempt != "1":
    json.dump({{"rank": 0, "label": "worker 0", "error": "RuntimeError: boom",
               "global_step": 5, "peer": False}}, open(os.path.join(where, "rank-0.json"), "w"))
else:
    json.dump({{"global_step": 4}}, open(os.path.join(where, "stopped.json"), "w"))
sys.exit({{"0": 1, "1": 75}}.get(attempt, 1))
'''


def test_main_restarts_the_command_with_each_attempt_in_the_environment(tmp_path, capsys,
                                                                          monkeypatch):
    mpiexec = tmp_path / "fake-mpi"
    mpiexec.write_text(FAKE_MPIEXEC.format(python=sys.executable))
    mpiexec.chmod(0o755)
    prog, seen = tmp_path / "prog.py", tmp_path / "seen"
    prog.write_text(FAILS_FIRST.format())
    monkeypatch.setenv("MPISYNC_FAILURE_DIR", str(tmp_path / "records"))
    status = main(["--workers", "1", "--ps", "1", "--mpiexec", str(mpiexec), "--restarts", "3",
                   "--restart-backoff", "0", "--", sys.executable, str(prog), str(seen)])
    err = capsys.readouterr().err
    assert status == 1, err
    # attempt 0 fails, 1 is preempted (the failure before it is forgotten), 2 fails as 0
    # did, 3 fails the same way as 2: not started again
    assert seen.read_text().split("\n")[:-1] == [f"{k} attempt-{k}" for k in range(4)]
    assert "attempt 2 of 4: the job failed with exit status 1; what failed first: worker 0: " \
        "RuntimeError: boom, at global step 5; starting the job again in 0 s" in err
    assert "attempt 3 of 5: the job stopped after a signal" in err
    assert err.rstrip().endswith("the job failed the same way twice (worker 0: RuntimeError: "
                                 "boom, at global step 5): not starting it again (a bug is "
                                 "not a fault)")
    assert os.listdir(tmp_path / "records") == []      # the attempts' records are removed


RECORDS_AND_EXITS_0 = '''import json, os
json.dump({"rank": 2, "label": "ps 0", "error": "RuntimeError: lost workers",
           "global_step": 6, "peer": False},
          open(os.path.join(os.environ["MPISYNC_FAILURE_DIR"], "rank-2.json"), "w"))
'''


def test_an_mpiexec_that_says_0_after_a_rank_recorded_an_error_is_a_failure(tmp_path, capsys,
                                                                             monkeypatch):
    """Every job gets a directory for its ranks' failure records (not only under
    --restarts): an MPI that exits 0 though a rank ended by an uncaught error (Open MPI with
    ULFM, after ranks died, now and then) gives status 1, naming the error; the directory
    is removed after. A job that recorded nothing keeps its 0."""
    mpiexec = tmp_path / "fake-mpi"
    mpiexec.write_text(FAKE_MPIEXEC.format(python=sys.executable))
    mpiexec.chmod(0o755)
    prog = tmp_path / "prog.py"
    prog.write_text(RECORDS_AND_EXITS_0)
    monkeypatch.setenv("MPISYNC_FAILURE_DIR", str(tmp_path / "records"))
    base = ["--workers", "1", "--ps", "1", "--mpiexec", str(mpiexec), "--"]
    assert main([*base, sys.executable, str(prog)]) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        f"mpisync.launch: {mpiexec} exited with status 0, but a rank ended by an uncaught "
        f"error (ps 0: RuntimeError: lost workers, at global step 6): exit status 1"), err
    assert os.listdir(tmp_path / "records") == []
    assert main([*base, sys.executable, "-c", "pass"]) == 0
    assert "uncaught" not in capsys.readouterr().err
