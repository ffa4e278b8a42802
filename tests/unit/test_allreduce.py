"""dense="allreduce"'s cases of tests/scripts/allreduce.py, in one process: plain torch
on the combined batch, which tests/mpi/test_allreduce_jobs.py compares the workers with.
"""
from __future__ import annotations

import sys

import pytest
from mpi_helpers import SCRIPTS
from shared_allreduce import max_diff

sys.path.insert(0, str(SCRIPTS))
from allreduce import BY_NAME, Net, reference

# also run under Open MPI (make test-openmpi)
pytestmark = pytest.mark.openmpi


def test_the_cases_are_not_vacuous():
    """Clipping, accumulation and the branch change what torch computes."""
    plain, clipped = reference(BY_NAME["adam"]), reference(BY_NAME["clip-after-backward"])
    assert max_diff(plain["params"], clipped["params"]) > 1e-3
    table = reference(BY_NAME["table-adam"])
    initial = Net("table", plain=True).emb.weight.tolist()
    assert max_diff(table["table"], initial) > 1e-3          # the table trains
    branch = reference(BY_NAME["branch-on-one-worker"])
    assert branch["params"]["extra"] != [0.25, 0.25, 0.25]
    no_branch = reference(BY_NAME["table-branch-one-worker"])
    assert no_branch["params"]["extra"] == [0.25, 0.25, 0.25]     # no worker uses it there
