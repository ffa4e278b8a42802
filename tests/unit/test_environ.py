"""Every ``MPISYNC_*`` variable is declared once, in ``mpisync.environ.VARIABLES`` (one process)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mpisync import environ
from mpisync.runtime.nodes import HOSTMAP_ENV, decode_host_map

PACKAGE = Path(__file__).resolve().parents[2] / "mpisync"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from environ_check import BAD, GOOD  # the values the multi-rank job sets

#: What ``mpisync.init()`` reads a host map with (``environ`` cannot import it).
PARSERS = {HOSTMAP_ENV: decode_host_map}
KINDS = {*environ.NUMBER_KINDS, *environ.TEXT_KINDS, "count", "steps", "switch", "choice",
         "host map"}
NAME = re.compile(r"\bMPISYNC_[A-Z0-9_]*[A-Z0-9]\b")


def names_in_sources(skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Each ``MPISYNC_*`` name in the package's sources, with the files that spell it."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".c", ".cpp") or path.name in skip:
            continue
        for name in set(NAME.findall(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_variable_in_the_sources_is_declared():
    undeclared = {n: f for n, f in names_in_sources().items() if n not in environ.VARIABLES}
    assert not undeclared, f"declare these in mpisync/environ.py VARIABLES: {undeclared}"


def test_every_declared_variable_is_read_somewhere():
    used = names_in_sources(skip=("environ.py",))
    unused = sorted(set(environ.VARIABLES) - set(used))
    assert not unused, f"declared in mpisync/environ.py but read nowhere: {unused}"


def test_each_entry_is_complete():
    for name, var in environ.VARIABLES.items():
        assert var.name == name and var.kind and var.meaning.endswith("."), var
        assert var.shown_default(), var
        assert var.kind in KINDS and var.accepts(), var
        assert bool(var.choices) == (var.kind == "choice"), var


def test_readers_take_their_defaults_from_the_registry():
    from mpisync.runtime import progress
    assert progress.timeouts({}) == tuple(float(environ.default(n)) for n in (
        "MPISYNC_TIMEOUT", "MPISYNC_SETUP_TIMEOUT", "MPISYNC_STALL_WARNING",
        "MPISYNC_POLL_MAX_SLEEP"))
    assert environ.count("MPISYNC_NUM_PS", environ={}) == environ.default("MPISYNC_NUM_PS")
    assert environ.switch("MPISYNC_BULK", environ={}) is environ.default("MPISYNC_BULK")
    assert environ.text("MPISYNC_STATS", {}) is None
    assert environ.text("MPISYNC_STATS", {"MPISYNC_STATS": "s.jsonl"}) == "s.jsonl"


# -- the check mpisync.init() runs on every rank --------------------------------------------
def test_every_variable_has_good_values_and_every_one_but_free_text_a_bad_one():
    assert set(GOOD) == set(environ.VARIABLES)
    free = {n for n, v in environ.VARIABLES.items() if v.kind in environ.TEXT_KINDS}
    assert set(BAD) == set(environ.VARIABLES) - free
    assert free == {"MPISYNC_NODE", "MPISYNC_CACHE", "MPISYNC_STATS", "MPISYNC_TIMELINE",
                    "MPISYNC_FAILURE_DIR"}


@pytest.mark.parametrize("name", list(environ.VARIABLES))
def test_the_check_takes_good_values_and_names_a_bad_one(name):
    for value in GOOD[name]:
        assert environ.problem({name: value}, PARSERS) is None, (name, value)
        environ.check(name, {name: value}, PARSERS.get(name))
    if name not in BAD:
        return
    value, accepts = BAD[name], environ.VARIABLES[name].accepts()
    expected = (rf"rank \S+: {name}={re.escape(repr(value))} is not {re.escape(accepts)}; "
                rf"set it to {re.escape(accepts)} or unset it")
    # the first malformed one in the registry's order, among good ones
    others = {n: v[0] for n, v in GOOD.items() if n != name}
    assert re.fullmatch(expected, environ.problem({**others, name: value}, PARSERS) or "")
    with pytest.raises(environ.ConfigError, match=expected):
        environ.check(name, {name: value}, PARSERS.get(name))


def test_the_first_malformed_variable_in_registry_order_is_named():
    found = environ.problem({"MPISYNC_BULK": "on", "MPISYNC_NUM_PS": "two"})
    assert found is not None and "MPISYNC_NUM_PS='two'" in found
    assert environ.problem({}) is None and environ.problem({"OTHER": "x"}) is None
    # without the host map's parser a host map is text
    assert environ.problem({HOSTMAP_ENV: BAD[HOSTMAP_ENV]}) is None


@pytest.mark.parametrize("name", list(BAD))
def test_init_refuses_each_malformed_variable_first(monkeypatch, name):
    """In one process (an MPI singleton): refused in ``check_environment``, before any
    other check, with the message of the check itself."""
    from mpi4py import MPI

    import mpisync
    from mpisync import ps_ranks

    monkeypatch.setenv(name, BAD[name])
    message = environ.problem(parsers=PARSERS)
    assert message is not None and message.startswith(f"rank 0: {name}=")
    with pytest.raises(mpisync.ConfigError) as raised:
        mpisync.init(comm=MPI.COMM_SELF, abort_on_error=False)
    assert str(raised.value) == message and raised.value.collective
    assert any(entry.name == "check_environment" for entry in raised.traceback)
    assert ps_ranks._current is None


def test_a_value_read_at_import_is_refused_alone_and_left_to_init_in_a_job(monkeypatch):
    def read():
        return environ.number("MPISYNC_TIMEOUT", environ={"MPISYNC_TIMEOUT": "30s"})

    def fallback():
        return environ.number("MPISYNC_TIMEOUT", environ={})

    with pytest.raises(environ.ConfigError, match="MPISYNC_TIMEOUT='30s'"):
        environ.read_at_import(read, fallback)       # a process alone: at once
    monkeypatch.setattr(environ, "_world_size", lambda: 3)
    assert environ.read_at_import(read, fallback) == 1800.0   # a rank of a job: init() will


MEANT = ("{} is set, but mpisync reads no such variable: did you mean {}? (it is unset, "
         "so its default holds)")


def test_a_name_spelled_almost_as_a_variable_is_named_with_the_variable():
    """``MPISYNC_TIMOUT`` (one letter off) or ``MPISYNC_NUMPS`` are said, with the name
    meant; a program's own ``MPISYNC_*`` names and the variables themselves are not."""
    said = environ.misspelled({"MPISYNC_TIMOUT": "30", "MPISYNC_NUMPS": "2",
                               "MPISYNC_TIMEOUT_S": "1", "MPISYNC_STATS": "s.jsonl",
                               "MPISYNC_VENV": "/v", "MPISYNC_TEST_LAUNCH_LOG": "l",
                               "MPISYNC_STALL_WARNIGN": "5", "MPISYNC_STALL_WARNING": "9"})
    beside = "MPISYNC_STALL_WARNIGN is set beside {0}: mpisync reads only {0}"
    assert said == [MEANT.format("MPISYNC_NUMPS", "MPISYNC_NUM_PS"),
                    beside.format("MPISYNC_STALL_WARNING"),
                    MEANT.format("MPISYNC_TIMEOUT_S", "MPISYNC_TIMEOUT"),
                    MEANT.format("MPISYNC_TIMOUT", "MPISYNC_TIMEOUT")]
    assert environ.misspelled({name: "1" for name in environ.VARIABLES}) == []


def test_init_warns_of_a_misspelled_variable_on_rank_0(monkeypatch):
    """In one process (an MPI singleton, rank 0 of its job): ``init`` says it once, after
    the environment's check and before the job's size is refused."""
    from mpi4py import MPI

    import mpisync

    monkeypatch.setenv("MPISYNC_TIMOUT", "30")
    with pytest.warns(RuntimeWarning) as seen, pytest.raises(mpisync.WorldTooSmallError):
        mpisync.init(comm=MPI.COMM_SELF, abort_on_error=False)
    texts = [str(w.message) for w in seen if "MPISYNC_TIMOUT" in str(w.message)]
    assert texts == ["rank 0: " + MEANT.format("MPISYNC_TIMOUT", "MPISYNC_TIMEOUT")], texts
