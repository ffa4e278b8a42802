"""What tests/unit/test_allreduce.py and tests/mpi/test_allreduce_jobs.py compare with."""
from __future__ import annotations

import torch


def max_diff(a, b) -> float:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if a is None or b is None:
        assert a is None and b is None, (a, b)
        return 0.0
    return (torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
            ).abs().max().item() if a != [] else 0.0
