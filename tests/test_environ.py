"""Every ``MPISYNC_*`` variable is declared once, in ``mpisync.environ.VARIABLES`` (one process)."""
from __future__ import annotations

import re
from pathlib import Path

from mpisync import environ

PACKAGE = Path(__file__).resolve().parent.parent / "mpisync"
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


def test_readers_take_their_defaults_from_the_registry():
    from mpisync.runtime import progress
    assert progress.timeouts({}) == tuple(float(environ.default(n)) for n in (
        "MPISYNC_TIMEOUT", "MPISYNC_SETUP_TIMEOUT", "MPISYNC_STALL_WARNING",
        "MPISYNC_POLL_MAX_SLEEP"))
    assert environ.count("MPISYNC_NUM_PS", environ={}) == environ.default("MPISYNC_NUM_PS")
    assert environ.switch("MPISYNC_BULK", environ={}) is environ.default("MPISYNC_BULK")
    assert environ.text("MPISYNC_STATS", {}) is None
    assert environ.text("MPISYNC_STATS", {"MPISYNC_STATS": "s.jsonl"}) == "s.jsonl"
