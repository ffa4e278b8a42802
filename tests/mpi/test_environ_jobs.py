"""A malformed ``MPISYNC_*`` variable on one rank, or on all, ends every rank alike at
``mpisync.init()`` (two MPI jobs of 2 workers and 1 ps rank).

One job refuses every variable in turn, on one rank and then on every rank, catching each
refusal, then a number of ps ranks one rank alone asks for (tests/scripts/environ_check.py);
the other leaves one uncaught.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mpi_helpers import failing, run_mpi

from mpisync import environ

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from environ_check import BAD  # the values the job sets

RANKS = (0, 1, 2)
#: Each refusal, on every rank, within this many seconds (the stall timeout is 120 s).
REFUSED_WITHIN = 10.0


@pytest.fixture(scope="module")
def refusals():
    """``{(variable, placement): {rank: record}}`` of the job that refuses each in turn."""
    run = run_mpi("environ_check.py", 2, 1, timeout=180)
    cases: dict[tuple[str, str | None], dict[int, dict]] = {}
    for r in run.results:
        cases.setdefault((r["case"], r.get("placement")), {})[r["rank"]] = r
    return cases, run


@pytest.mark.parametrize("placement", ["one", "all"])
@pytest.mark.parametrize("name", list(BAD))
def test_a_malformed_variable_is_refused_on_every_rank_naming_it(refusals, name, placement):
    cases, run = refusals
    records = cases.get((name, placement), {})
    assert sorted(records) == list(RANKS), (name, placement, run.describe())
    (bad,) = {tuple(r["bad"]) for r in records.values()}
    assert len(bad) == (1 if placement == "one" else len(RANKS))
    accepts = re.escape(environ.VARIABLES[name].accepts())
    for record in records.values():
        # every rank names the first rank that holds the value: rank 0 where all do
        assert re.fullmatch(rf"ConfigError: rank {bad[0]}: {name}="
                            rf"{re.escape(repr(BAD[name]))} is not {accepts}; set it to "
                            rf"{accepts} or unset it", record["error"] or ""), record
        assert record["named"] and record["seconds"] < REFUSED_WITHIN, record


def test_the_one_rank_that_holds_it_differs_from_variable_to_variable(refusals):
    cases, _ = refusals
    assert {cases[(name, "one")][0]["bad"][0] for name in BAD} == set(RANKS)


@pytest.mark.parametrize("case", ["differ-env", "differ-arg"])
def test_a_number_of_ps_ranks_one_rank_alone_asks_for_is_refused_on_every_rank(refusals,
                                                                             case):
    """Well formed, but another number than the others ask for (``MPISYNC_NUM_PS``, or
    ``init(num_ps=)``): that rank would take another role and wait; every rank raises."""
    cases, run = refusals
    records = cases.get((case, None), {})
    assert sorted(records) == list(RANKS), (case, run.describe())
    for rank, record in records.items():
        assert record["error"] == (
            f"ConfigError: rank {rank}: every rank must ask for the same number of ps ranks: "
            f"rank {record['odd']} asks for 2 where rank 0 asks for 1 (init(num_ps=...), "
            f"else MPISYNC_NUM_PS, differs between ranks)"), record


def test_init_succeeds_after_every_refusal(refusals):
    cases, run = refusals
    after = cases.get(("after", None), {})
    assert sorted(after) == list(RANKS), run.describe()
    assert [after[r]["role"] for r in RANKS] == ["worker", "worker", "ps"]


def test_an_uncaught_malformed_variable_on_one_rank_ends_every_rank_naming_it():
    """The last rank alone holds a malformed ``MPISYNC_TIMEOUT`` before mpisync's modules
    are imported (they read it at import): it imports with the default, and every rank
    ends at ``init()`` naming it, within the subprocess's timeout, well before the stall
    timeout (120 s) the other ranks run with."""
    run = failing("environ_check.py", 2, 1, ["--uncaught", "MPISYNC_TIMEOUT"], timeout=60)
    for rank in RANKS:
        assert re.search(rf"\[mpisync\] rank {rank}: ConfigError: rank 2: "
                         r"MPISYNC_TIMEOUT='30s' is not a number of seconds > 0",
                         run.output), (rank, run.describe())
    assert "init() took" not in run.output and "StallError" not in run.output, run.describe()
