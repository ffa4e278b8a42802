"""Embedding tables on the ps ranks and sparse nn.Embedding weights, against plain torch.

One job (3 workers, 2 ps ranks) runs every case of tests/scripts/tables.py, one optimizer
after another; this process trains each case with a dense nn.Embedding in one process on
the combined batch (torch's SparseAdam on a sparse one) and compares the table and the
dense parameters.
"""
from __future__ import annotations

import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
from tables import BY_NAME, CASES, WORKERS, reference

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def job():
    run = run_mpi("tables.py", WORKERS, 2, [c.name for c in CASES], timeout=300)
    by_case: dict[str, dict[int, dict]] = {}
    for r in run.results:
        if r.get("role") == "worker":
            by_case.setdefault(r["case"], {})[r["worker"]] = r
    return run, by_case


def test_every_case_ran_on_every_worker(job):
    run, by_case = job
    assert sorted(by_case) == sorted(BY_NAME), run.describe()
    for name, workers in by_case.items():
        assert sorted(workers) == list(range(WORKERS)), name
        assert {w["global_step"] for w in workers.values()} == {BY_NAME[name].steps}


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_table_matches_plain_torch(job, name):
    _, by_case = job
    ref = reference(BY_NAME[name])
    for w, got in by_case[name].items():
        table = torch.tensor(got["table"])
        diff = (table - torch.tensor(ref["table"])).abs().max().item()
        assert diff <= TOLERANCE, (name, w, "table", diff)
        for a, b in zip(got["head"], ref["head"]):
            diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
            assert diff <= TOLERANCE, (name, w, "head", diff)
