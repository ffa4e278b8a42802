"""``mpisync.runtime.agreement``: every rank agrees or every rank raises (one process, the
judges fed the lists that several ranks would gather)."""
from __future__ import annotations

import pytest
from mpi4py import MPI

from mpisync.errors import ConfigError, MismatchError
from mpisync.ps_ranks import _versions_judge
from mpisync.runtime.agreement import agree, first_problem
from mpisync.runtime.collectives import _call_judge


def test_agree_returns_every_ranks_contribution_when_the_judge_finds_nothing():
    assert agree(MPI.COMM_SELF, {"x": 1}, lambda gathered: None) == [{"x": 1}]


def test_agree_raises_what_the_judge_returns():
    with pytest.raises(OSError, match="disk full"):
        agree(MPI.COMM_SELF, "disk full", lambda errors: errors[0] and OSError(errors[0]))


def test_the_first_rank_with_a_problem_is_named_and_the_error_is_collective():
    error = first_problem([None, "bad lr", "bad momentum"], "worker 0 (rank 0): update()",
                          lambda w: f"worker {w}")
    assert isinstance(error, ConfigError) and error.collective
    assert str(error) == "worker 0 (rank 0): update(): worker 1: bad lr"
    assert first_problem([None, None]) is None
    assert str(first_problem(["rank 0: MPISYNC_BULK='on' is not 1 (on) or 0 (off)"])) == \
        "rank 0: MPISYNC_BULK='on' is not 1 (on) or 0 (off)"


def test_a_field_that_differs_from_rank_0s_is_a_mismatch_naming_it():
    fields = {"the operation": "'sum'", "the structure": "f32[3]"}
    other = {**fields, "the structure": "f32[4]"}
    error = _call_judge("reduce()", "worker", [(None, fields, 1), (None, other, 2),
                                              (None, other, 3)])
    assert isinstance(error, MismatchError) and error.field == "the structure"
    assert str(error).startswith("reduce(): workers [1, 2] differ from worker 0 in the "
                                 "structure (worker 1: f32[4]; worker 0: f32[3])")
    assert _call_judge("reduce()", "worker", [(None, fields, 1), (None, fields, 2)]) is None
    problem = _call_judge("reduce()", "worker", [(None, fields, 1), ("not a tensor", other, 2)])
    assert isinstance(problem, ConfigError) and str(problem) == "reduce(): worker 1: not a tensor"


def test_ranks_with_another_version_are_named():
    error = _versions_judge(2, [("1.0", 3), ("1.0", 3), ("0.9", 2), ("0.9", 2)])
    assert isinstance(error, ConfigError) and error.collective
    assert str(error) == ("rank 2: every rank must run the same mpisync: rank 2 runs mpisync "
                          "0.9 (wire format 2) where rank 0 runs mpisync 1.0 (wire format 3); "
                          "ranks [2, 3] differ from rank 0")
    assert _versions_judge(0, [("1.0", 3)] * 3) is None
