"""The suite's two folders and two tiers.

``tests/unit/`` holds the tests that start no MPI ranks, ``tests/mpi/`` those that do (an
MPI job, the launcher, Slurm, Horovod); ``tests/scripts/`` holds the programs the jobs run.
A test under ``tests/unit/`` that starts ranks fails at that call, saying it belongs in
``tests/mpi/``.

``make test`` runs every test. ``make check`` sets ``MPISYNC_TESTS_IN_PROCESS=1`` and runs
the tests that start no MPI job: a test (or the fixture it reads) that starts ``mpiexec``,
``mpirun``, ``horovodrun``, Slurm or ``python -m mpisync.launch`` is skipped at that call,
saying so, so the edit loop never waits for ranks to start.

Both run on two pytest processes (``-n``, pytest-xdist), each file whole on one of them
(``--dist loadfile``: a module's fixtures run once); the files that start the most jobs are
handed out first, so that neither process is left alone with a long file at the end.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

IN_PROCESS_ONLY = os.environ.get("MPISYNC_TESTS_IN_PROCESS") == "1"
TESTS = Path(__file__).resolve().parent
UNIT = TESTS / "unit"           # no test here starts ranks
# programs that start ranks (by their name: any path to them)
LAUNCHERS = {"mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpiexec.openmpi",
             "mpirun.mpich", "mpirun.openmpi", "prterun", "horovodrun", "srun", "sbatch",
             "local-cluster.sh"}
# what a launcher is asked that starts nothing (the MPI flavour is read from --version)
ASKS_ONLY = {"--version", "-V", "--help", "-h", "-info"}
SHELLS = {"sh", "bash", "dash"}
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}


def _commands(words: list[str]) -> list[list[str]]:
    """The commands of a command line: itself, and those of a shell's ``-c`` string; a
    shell given a script file runs that script (``bash local-cluster.sh start``)."""
    if len(words) >= 2 and os.path.basename(words[0]) in SHELLS:
        if len(words) >= 3 and words[1] == "-c":
            return _commands_of_shell(words[2])
        if not words[1].startswith("-"):
            return [words[1:]]
    return [words]


def _commands_of_shell(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS or "\n" in token:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _launches(words: list[str]) -> bool:
    program = os.path.basename(words[0])
    if program in LAUNCHERS:
        return not (len(words) > 1 and set(words[1:]) <= ASKS_ONLY)
    if program.startswith("python"):
        rest = words[1:]
        for i, w in enumerate(rest):           # python [options] -m mpisync.launch | file
            if w == "-mmpisync.launch" or (w == "mpisync.launch" and i and rest[i - 1] == "-m") \
                    or w.replace(os.sep, "/").endswith("mpisync/launch.py"):
                return not set(rest[i + 1:]) <= ASKS_ONLY
    return False


def starts_ranks(args, shell: bool = False) -> bool:
    """Whether a command line (``Popen``'s args; a string: a shell's) launches an MPI job
    or a Slurm cluster. Asking a launcher its version or help starts none."""
    if isinstance(args, (str, bytes, os.PathLike)):
        line = os.fsdecode(args)
        commands = _commands_of_shell(line) if shell or " " in line else [[line]]
    else:
        commands = _commands([os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a)
                              for a in args])
    return any(_launches(c) for c in commands)


def launch_verdict(test_path, args, shell: bool = False,
                   in_process_only: bool = IN_PROCESS_ONLY) -> str | None:
    """What becomes of a test at ``test_path`` (None: outside any test) that runs ``args``:
    ``"fail"`` where the command starts ranks and the test is under ``tests/unit/``,
    ``"skip"`` where it starts ranks in the in-process tier, None where it runs."""
    if not starts_ranks(args, shell):
        return None
    if test_path is not None and UNIT in Path(test_path).resolve().parents:
        return "fail"
    return "skip" if in_process_only else None


_running: list = [None]         # the file of the test that runs now
_popen_init = subprocess.Popen.__init__


def _checked_popen(self, args, *rest, **kwargs):
    verdict = launch_verdict(_running[0], args, kwargs.get("shell", False))
    if verdict == "fail":
        pytest.fail(f"{os.path.relpath(_running[0], TESTS)} starts MPI ranks ({args!r}): a test "
                    "under tests/unit/ starts none; it belongs in tests/mpi/", pytrace=False)
    if verdict == "skip":
        pytest.skip("starts MPI ranks: `make test` runs it")
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _checked_popen


@pytest.hookimpl(hookwrapper=True)        # (setup.py asks for pytest>=7)
def pytest_runtest_protocol(item, nextitem):
    """Notes the running test's file (its fixtures' set-up and teardown included)."""
    _running[0] = item.path
    yield
    _running[0] = None


@pytest.fixture(autouse=True)
def _default_dtype_kept():
    """A test that leaves torch's default dtype changed fails, naming itself, and the
    dtype is put back: the tests after it in the same process would otherwise build
    float64 models beside float32 data and fail far from the cause."""
    import torch
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"the test left torch's default dtype {after} (it was {before}): "
                    f"restore it (try/finally) where it is changed", pytrace=False)


#: The files that take longest, slowest first (the rest follow in their usual order): each
#: of the two pytest processes takes the next file when it is done with one, so the short
#: files come last and the two end together. Seconds: one run of the MPICH part, 2 cores.
LONGEST_FIRST = (
    "test_checkpoint_jobs.py",          # 103
    "test_errors_reach_every_rank.py",  # 84
    "test_exactness.py",                # 73
    "test_restarts.py",                 # 60 (forked attempts)
    "test_equivalence.py",              # 57
    "test_soak.py",                     # 52
    "test_slurm.py",                    # (runs alone after the rest)
    "test_example.py",                  # 47
    "test_tables_jobs.py",              # 46
    "test_allreduce_jobs.py",           # 44
    "test_horovod.py",                  # (Open MPI's part)
    "test_preemption.py",               # 38
    "test_rowopt.py",                   # 30
    "test_forkserver.py",               # 28
    "test_recsys_bench_jobs.py",        # 27
    "test_bulk.py",                     # 25
    "test_helpers_jobs.py",             # 24
    "test_survive.py",                  # (Open MPI's part)
    "test_buckets.py", "test_bad_input_jobs.py", "test_async.py", "test_backup_jobs.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = os.path.basename(str(item.path))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)        # stable: each file keeps the order of its own tests


def pytest_configure(config):
    """Compile mpisync's modules and the jobs' programs once, before any rank starts (in the
    first pytest process only): every rank imports them, and where Python writes no bytecode
    itself (``PYTHONDONTWRITEBYTECODE``, a read-only checkout's neighbours) each rank of each
    job would compile them again, a tenth of the suite's CPU."""
    if hasattr(config, "workerinput"):          # a pytest-xdist worker: the first did it
        return
    import compileall
    for folder in (TESTS.parent / "mpisync", TESTS / "scripts", TESTS):
        compileall.compile_dir(str(folder), quiet=2, maxlevels=0 if folder == TESTS else 10)
