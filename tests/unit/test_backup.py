"""Backup workers in one process: the refusal of too few tokens, a function of the spec
(tests/mpi/test_backup_jobs.py proves that every rank of a job refuses it)."""
from __future__ import annotations

import pytest
import torch

from mpisync.protocol.spec import Model, Options, build_spec

# also run under Open MPI (make test-openmpi)
pytestmark = pytest.mark.openmpi


def test_too_few_tokens_message_names_the_counts_and_the_fix():
    """The refusal is a function of the spec: its whole message, in one process."""
    net = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError) as err:
        build_spec(torch.optim.SGD(net.parameters(), lr=0.1),
                   Model(tuple(net.named_parameters()), ()),
                   Options(replicas_to_aggregate=4, num_tokens=1), opt_id=0, num_workers=2,
                   num_ps=1)
    assert str(err.value) == ("num_tokens=1 is too few: each step needs 4 gradients from 2 "
                              "workers, so num_tokens must be >= 2")
