"""The distribution helpers in one process: the reductions' rules on a communicator of
one rank, metrics read locally, the sampler's shares, the checks of functions given to
``opt.update``.

The one job of 3 workers and 2 ps ranks (tests/scripts/helpers.py) that runs every
multi-rank check is tests/mpi/test_helpers_jobs.py's.
"""
from __future__ import annotations

import collections
import functools
import re
import sys

import numpy as np
import pytest
import torch
from mpi_helpers import SCRIPTS

import mpisync
from mpisync.data import WorkerSampler
from mpisync.errors import ConfigError
from mpisync.protocol import updates
from mpisync.runtime import collectives

sys.path.insert(0, str(SCRIPTS))
import helpers as script


# -- the sampler -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 7, 12, 13])
@pytest.mark.parametrize("workers", [1, 3, 4])
def test_sampler_shares_in_one_process(n, workers):
    for shuffle in (True, False):
        shares = [WorkerSampler(range(n), workers, w, shuffle=shuffle, seed=1)
                  for w in range(workers)]
        got = [list(s) for s in shares]
        assert sorted(i for g in got for i in g) == list(range(n))
        assert [len(g) for g in got] == [len(s) for s in shares]
        assert max(map(len, got)) - min(map(len, got)) <= 1
        dropped = [list(WorkerSampler(range(n), workers, w, shuffle=shuffle, drop_last=True))
                   for w in range(workers)]
        assert {len(d) for d in dropped} == {n // workers}
        assert len({i for d in dropped for i in d}) == n // workers * workers
    if n >= 7:
        s = WorkerSampler(range(n), workers, 0, seed=1)
        first = list(s)
        s.set_epoch(1)
        assert list(s) != first and isinstance(s, torch.utils.data.DistributedSampler)


# -- reductions' rules, on one rank ----------------------------------------------------------
@pytest.fixture(scope="module")
def self_comm():
    from mpi4py import MPI
    return MPI.COMM_SELF


@pytest.mark.parametrize("dtype, op, expected", [
    (torch.int32, "mean", torch.float32), (torch.bool, "mean", torch.float32),
    (torch.uint8, "sum", torch.uint8), (torch.bool, "sum", torch.bool),
    (torch.float16, "mean", torch.float16), (torch.bfloat16, "max", torch.bfloat16),
    (torch.float64, "min", torch.float64), (torch.complex64, "sum", torch.complex64),
])
def test_result_dtypes(self_comm, dtype, op, expected):
    got = collectives.reduce(self_comm, torch.ones(2, 3, dtype=dtype), op)
    assert got.dtype == expected and got.shape == (2, 3)
    assert torch.equal(got, torch.ones(2, 3, dtype=expected))


def test_python_and_numpy_types_and_containers_come_back_as_given(self_comm):
    point = collections.namedtuple("point", "x y")
    value = collections.OrderedDict(b=point(1, 2.5), a=[True, np.int16(3), np.ones(2)],
                                    c=(torch.tensor(4),), d=collections.defaultdict(list, e=[1]))
    got = collectives.reduce(self_comm, value, "mean")
    assert type(got) is collections.OrderedDict and list(got) == ["b", "a", "c", "d"]
    assert type(got["d"]) is collections.defaultdict and got["d"].default_factory is list
    assert type(got["b"]) is point and got["b"] == (1.0, 2.5) and type(got["b"].x) is float
    assert got["a"][0] == 1.0 and type(got["a"][1]) is np.float32
    assert isinstance(got["a"][2], np.ndarray) and got["c"][0].dtype == torch.float32
    assert collectives.reduce(self_comm, 7, "max") == 7
    assert collectives.reduce(self_comm, 2**100, "sum") == 2**100      # exact, as Python
    assert type(collectives.reduce(self_comm, True, "sum")) is bool
    assert collectives.batch_reduce(self_comm, (1, 2.0)) == [1, 2.0]


def test_a_reduction_never_writes_into_the_callers_tensor(self_comm):
    t = torch.arange(4.0)
    got = collectives.reduce(self_comm, t, "sum")
    got.add_(1)
    assert torch.equal(t, torch.arange(4.0))


def test_broadcast_keeps_any_picklable_leaf(self_comm):
    value = {"t": torch.arange(5, dtype=torch.int16), "s": "text", "n": None, "h":
             torch.ones(3, dtype=torch.bfloat16)}
    assert collectives.broadcast(self_comm, value, 0) is value


# -- what opt.update accepts -----------------------------------------------------------------
def test_functions_that_reach_the_ps_ranks_and_those_that_cannot():
    assert updates.check_fn(script.needs_one_dim)
    assert updates.check_fn(functools.partial(script.max_norm, limit=1.0))
    assert updates.check_fn(script.Clip(0.5))
    assert updates.check_fn(torch.Tensor.relu_)

    def local(t):
        return t
    for fn, message in ((lambda t: t, "lambda"), (local, "inside a function"),
                        (functools.partial(local), r"fn partial\(test_.*local\) is defined"),
                        (functools.partial(script.max_norm, limit=lambda: 1), "cannot be sent"),
                        (3, "callable")):
        with pytest.raises(ConfigError, match=message):
            updates.check_fn(fn)


def test_a_stale_question_of_the_coordinator_is_not_taken_for_an_answer():
    """ps 0 asks parked workers whether they are still in a collective; a worker that left
    it already reads the question later, while it waits for an answer: it skips it."""
    from types import SimpleNamespace

    from mpisync.protocol.wire import Tag
    from mpisync.worker.channels import DenseChannel

    queue = [("still?", 3, 1), ("still?", 4, 2), {"global_step": 5}]
    poller = SimpleNamespace(wait_message=lambda source, tag, what: queue.pop(0))
    channel = SimpleNamespace(poller=poller, tags={Tag.INFO: 0})
    assert DenseChannel.answer(channel, 0, "statistics") == {"global_step": 5}
    queue[:] = [("state", {}, [], {}, 2)]            # a ps rank's state: a tuple, an answer
    assert DenseChannel.answer(channel, 0, "state") == ("state", {}, [], {}, 2)


def test_a_function_may_change_in_place_or_return_the_new_value():
    t = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    updates.apply_fn(functools.partial(script.max_norm, limit=1.0), t, "w")
    assert torch.allclose(t.norm(dim=1), torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match=r"fn returned \[3\] for 'w' of shape \[2, 2\]"):
        updates.apply_fn(lambda x: torch.zeros(3), t, "w")


def test_metric_locally_with_weights_and_thresholds():
    m = mpisync.Mean()
    m.update(torch.tensor([1.0, 3.0]), weight=torch.tensor([3.0, 1.0]))
    m.update(2.0, weight=2)
    assert m.compute(local=True) == pytest.approx((3 + 3 + 4) / 6)
    with pytest.raises(ValueError, match=r"weight of shape \[2, 1\] does not broadcast to a "
                                         r"value of shape \[2\]"):
        m.update(torch.tensor([1.0, 3.0]), weight=torch.ones(2, 1))   # would add records
    assert m.compute(local=True) == pytest.approx((3 + 3 + 4) / 6)
    acc = mpisync.Accuracy(threshold=0.0)
    acc.update(torch.tensor([-1.0, 2.0, 0.5]), torch.tensor([0.0, 1.0, 0.0]))
    assert acc.compute(local=True) == pytest.approx(2 / 3)
    binary = mpisync.Accuracy()              # (N, 1): one probability each, not one class
    binary.update(torch.tensor([[0.9], [0.2], [0.7], [0.4]]), torch.tensor([1, 0, 0, 0]))
    assert binary.compute(local=True) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="aggregation"):
        mpisync.Metric("median")


def test_a_sampler_refuses_an_iterable_dataset_naming_the_way():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10
    for dataset, what in ((Stream(), "an IterableDataset"), (iter(range(3)), "without len()")):
        with pytest.raises(TypeError, match=re.escape(f"{what}; an iterable dataset shards")):
            WorkerSampler(dataset, 2, 0)


def test_a_function_that_fails_on_a_ps_names_itself_the_tensor_and_the_step():
    fails = updates.Updates()
    data = updates.check_fn(script.needs_one_dim)
    fails.set([(data, "all", ["w"])], {"w": (torch.zeros(2, 2), None)})
    with pytest.raises(RuntimeError, match=(r"the function needs_one_dim given to opt.update\(\) "
                                            r"failed on 'w' after global step 7: ValueError: "
                                            r"wanted a vector")):
        fails.run(step=7)
