"""Shared by the test programs: seeded data, the model, result printing, the skeleton."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

FEATURES, CLASSES = 10, 3


def dataset(n: int, seed: int = 1234, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded classification problem: a random linear teacher plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g, dtype=dtype)
    teacher = torch.randn(FEATURES, CLASSES, generator=g, dtype=dtype)
    y = (x @ teacher + 0.3 * torch.randn(n, CLASSES, generator=g, dtype=dtype)).argmax(1)
    return x, y


def model(hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, CLASSES))


def make_optimizer(name: str, params, lr: float | None = None) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr or 0.01)
    raise ValueError(name)


def attempt(fn, *args) -> str | None:
    """Run ``fn(*args)``; the error it raised (``"Type: message"``), or None."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        return f"{type(exc).__name__}: {exc}"
    return None


def emit(**record) -> None:
    """One record of JSON for the test: a line in this process's file under RESULT_DIR."""
    line = json.dumps(record)
    out = os.environ.get("RESULT_DIR")
    if out:
        with open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")
    print("RESULT " + line, flush=True)


def run(worker: Callable, num_ps: int | None = None) -> None:
    """The skeleton of every test program: ps ranks serve and report, workers train.

    ``worker(cluster)`` trains on a worker and returns a record (or None); each ps rank
    serves every optimizer the workers create and reports each one's statistics.
    """
    import mpisync
    from mpisync.runtime import heap

    cluster = mpisync.init(num_ps=num_ps)
    if cluster.is_ps:
        served = cluster.serve()
        for stats in served if isinstance(served, list) else [served]:
            emit(role="ps", ps=cluster.ps_index, global_step=stats["global_step"],
                 stats=stats if cluster.ps_index == 0 else None,
                 dynamo="torch._dynamo" in sys.modules, heap=heap.in_force())
        return
    record = worker(cluster)
    if record is not None:
        emit(role="worker", worker=cluster.worker_index, **record)
