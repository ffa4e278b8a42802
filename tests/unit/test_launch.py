"""One-process tests of the launch helper: command lines and argument parsing, no MPI job."""

from __future__ import annotations

import os
import sys
import time

import pytest

from mpisync.launch import (
    NUM_PS_ENV,
    detect_mpi_flavor,
    explain_status,
    find_mpiexec,
    host_map,
    main,
    mpiexec_command,
    parse_args,
    run_command,
)

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
