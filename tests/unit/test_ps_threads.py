"""The ps's row kernels over threads are bitwise the one-thread kernels (one process).

Each kernel that writes output rows runs on 1 thread, then on 2, 3 and 4 with every call
split (``min_work=1``), on seeded random inputs: empty, one row, fewer rows than threads,
repeated ids, and enough to give every thread rows; the outputs must be ``torch.equal``.
Then ``MPISYNC_PS_THREADS``: its default as a function of the machine, and its check.
"""
from __future__ import annotations

import pytest
import torch

from mpisync import environ
from mpisync.errors import ConfigError
from mpisync.native import kernels, plankernels, rowthreads
from mpisync.runtime.nodes import host_load
from mpisync.tables.rowopt import RowScratch, apply_rows, merge_rows
from mpisync.tables.rowwise import RowWiseAdagrad

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler here")

DTYPES = (torch.float32, torch.float64)
SIZES = (0, 1, 3, 257)         # no rows, one, fewer than the threads, many
THREADS = (2, 3, 4)


@pytest.fixture(autouse=True)
def _one_thread_after():
    yield
    rowthreads.close()


def on_threads(make):
    """``make()``'s tensors with 1 thread, then with each of ``THREADS``, every call split."""
    rowthreads.close()
    results = [make()]
    for count in THREADS:
        rowthreads.start(count, min_work=1)
        try:
            results.append(make())
        finally:
            rowthreads.close()
    return results


def assert_same(results) -> None:
    first = results[0]
    for count, other in zip(THREADS, results[1:]):
        for a, b in zip(first, other):
            assert torch.equal(a, b), f"{count} threads differ from one"


def draw(n: int, num_rows: int, dim: int, dtype, seed: int):
    """``n`` distinct ids below ``num_rows``, shuffled (what the updates take), and rows."""
    assert n <= num_rows
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_rows, generator=g)[:n]
    rows = torch.randn(n, dim, generator=g, dtype=dtype)
    return ids, rows


# -- the split ------------------------------------------------------------------------------
def test_ranges_cover_the_rows_in_order_and_small_work_stays_whole():
    assert rowthreads.split(100, 10 ** 9) == [(0, 100)]            # no pool: one range
    rowthreads.start(3, min_work=10)
    assert rowthreads.threads() == 3
    assert rowthreads.split(100, 10 ** 9) == [(0, 33), (33, 66), (66, 100)]
    assert rowthreads.split(100, 25) == [(0, 50), (50, 100)]       # pays for two
    assert rowthreads.split(100, 9) == [(0, 100)]
    assert rowthreads.split(2, 10 ** 9) == [(0, 1), (1, 2)]       # fewer rows than threads
    assert rowthreads.split(0, 0) == [(0, 0)]
    rowthreads.close()
    assert rowthreads.threads() == 1 and rowthreads.split(100, 10 ** 9) == [(0, 100)]
    with pytest.raises(ValueError, match="at least 1"):
        rowthreads.start(0)


@pytest.mark.parametrize("pieces", [1, 4, 7])
def test_each_row_runs_once_whichever_thread_takes_its_piece(pieces):
    rowthreads.start(3, min_work=1)
    seen, ranges = [], rowthreads.split(50, 50)
    rowthreads.run(lambda lo, hi: seen.append((lo, hi)), ranges, pieces=pieces)
    rows = sorted(r for lo, hi in seen for r in range(lo, hi))
    assert rows == list(range(50))
    assert all(hi > lo for lo, hi in seen) and len(seen) == len(ranges) * pieces


def test_an_error_in_a_range_reaches_the_caller():
    rowthreads.start(3, min_work=1)

    def task(lo: int, hi: int) -> None:
        if lo:
            raise RuntimeError(f"range {lo}")

    with pytest.raises(RuntimeError, match="range"):
        rowthreads.run(task, rowthreads.split(9, 9))


# -- the kernels ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weighted", [False, True])
def test_bag_rows(dtype, n, weighted):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 40, (n,), generator=g)                  # repeats
    bag = torch.randint(0, 7, (n,), generator=g)
    grads = torch.randn(7, 5, generator=g, dtype=dtype)
    weights = torch.rand(n, generator=g, dtype=dtype) if weighted else None
    slot = kernels.slots_for({}, 40)
    assert_same(on_threads(lambda: kernels.bag_rows(ids, bag, weights, grads, slot)))
    assert bool((slot == -1).all())


def pieces_of(n: int, dtype, seed: int, num_rows: int = 50, dim: int = 6) -> list:
    """Rows pieces (ids repeated across them), then pooled ones (weighted, and not with
    -0.0 rows), as a step takes them."""
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for k in range(3):
        ids = torch.randint(0, num_rows, (n,), generator=g).unique()
        pieces.append((ids, None, None, torch.randn(len(ids), dim, generator=g, dtype=dtype)))
    bag = torch.randint(0, 4, (n,), generator=g)
    pieces.append((torch.randint(0, num_rows, (n,), generator=g), bag,
                   torch.randn(n, generator=g, dtype=dtype),
                   torch.randn(4, dim, generator=g, dtype=dtype)))
    pieces.append((torch.randint(0, num_rows, (n,), generator=g), bag, None,
                   torch.randn(4, dim, generator=g, dtype=dtype).mul_(-0.0)))   # -0.0 rows
    return pieces


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_planned_rows_of_rows_and_bags(dtype, n):
    pieces = pieces_of(n, dtype, 100 + n)
    marks = plankernels.PlanMarks(50)

    def make():
        p = plankernels.plan(pieces, marks, RowScratch(), (6,))
        return p.ids.clone(), p.summed()

    results = on_threads(make)                  # one marks array, a generation a plan
    assert_same(results)
    assert marks.gen == 1 + len(THREADS)
    signs = torch.signbit(results[0][1])
    assert all(torch.equal(signs, torch.signbit(r[1])) for r in results[1:])


UPDATES = {
    "sgd": lambda p: torch.optim.SGD([p], lr=0.1, maximize=True),
    "adagrad": lambda p: torch.optim.Adagrad([p], lr=0.1, lr_decay=0.01,
                                             initial_accumulator_value=0.1),
    "rowwise": lambda p: RowWiseAdagrad([p], lr=0.1),
    "rowwise-decay": lambda p: RowWiseAdagrad([p], lr=0.1, weight_decay=0.1, maximize=True),
    "sparse-adam": lambda p: torch.optim.SparseAdam([p], lr=0.01),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("div", [0, 3, 4])
@pytest.mark.parametrize("kind", sorted(UPDATES))
def test_planned_updates_are_the_summed_rows_updates_on_any_threads(dtype, n, div, kind):
    """The ps's step: ``apply_rows`` from a plan of the pieces (one pass where the
    optimizer has a planned kernel) against ``apply_rows`` from the plan's summed rows,
    then on 2, 3 and 4 threads: bitwise."""
    pieces = pieces_of(n, dtype, 300 + n)
    table = torch.randn(50, 6, generator=torch.Generator().manual_seed(2), dtype=dtype)

    def make(summed: bool = False):
        param = torch.nn.Parameter(table.clone())
        opt = UPDATES[kind](param)
        for _ in range(2):
            scratch = RowScratch()
            p = plankernels.plan(pieces, scratch.plan_marks(50), scratch, (6,))
            apply_rows(opt, opt.param_groups[0], param, p.ids,
                       p.summed().clone() if summed else p, scratch, div)
        state = [v for v in opt.state[param].values() if torch.is_tensor(v)]
        return [param.detach(), *state]

    results = on_threads(make)
    assert_same(results)
    for a, b in zip(results[0], make(summed=True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ordered", [False, True])
def test_bag_sums_and_gather(dtype, n, weighted, ordered):
    """Bags in any order, or in order as a lookup sends them (each thread then finds its
    bags' positions by bisection): the same sums on any threads, as torch's index_add_."""
    g = torch.Generator().manual_seed(200 + n)
    table = torch.randn(30, 4, generator=g, dtype=dtype)
    ids = torch.randint(0, 30, (n,), generator=g)                  # repeats
    bag = torch.randint(0, 5, (n,), generator=g)
    if ordered:
        bag = bag.sort().values
    weights = torch.rand(n, generator=g, dtype=dtype) if weighted else None

    def make():
        sums = torch.zeros(5, 4, dtype=dtype)
        kernels.bag_sums(ids, bag, weights, table, sums)
        rows = torch.empty(n, 4, dtype=dtype)
        kernels.gather(ids, table, rows)
        return sums, rows

    results = on_threads(make)
    assert_same(results)
    assert torch.equal(results[0][1], table[ids])
    each = table[ids] * (weights[:, None] if weighted else 1)
    assert torch.allclose(results[0][0], torch.zeros(5, 4, dtype=dtype).index_add_(0, bag, each))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("how", ["mean", "sum"])
def test_merge_rows(dtype, n, how):
    g = torch.Generator().manual_seed(300 + n)
    pieces = []
    for _ in range(3):
        ids = torch.randint(0, 60, (n,), generator=g).unique()     # sorted, shared ids
        pieces.append((ids, torch.randn(len(ids), 3, generator=g, dtype=dtype)))
    if n == 0:
        pieces[1] = (torch.tensor([5]), torch.randn(1, 3, generator=g, dtype=dtype))

    def make():
        ids, rows = merge_rows(pieces, 60, 3, how, RowScratch())
        return ids.clone(), rows.clone()

    assert_same(on_threads(make))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("div", [0, 3, 4])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise"])
def test_row_updates(dtype, n, div, kind):
    ids, rows = draw(n, 600, 7, dtype, 400 + n)
    table = torch.randn(600, 7, generator=torch.Generator().manual_seed(1), dtype=dtype)

    def make():
        param = torch.nn.Parameter(table.clone())
        opt = {"sgd": lambda: torch.optim.SGD([param], lr=0.1),
               "adagrad": lambda: torch.optim.Adagrad([param], lr=0.1),
               "rowwise": lambda: RowWiseAdagrad([param], lr=0.1)}[kind]()
        for _ in range(2):
            apply_rows(opt, opt.param_groups[0], param, ids, rows, RowScratch(), div)
        state = [v for v in opt.state[param].values() if torch.is_tensor(v)]
        return [param.detach(), *state]

    assert_same(on_threads(make))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_rowwise_over_every_row(dtype, n):
    g = torch.Generator().manual_seed(500 + n)
    grad = torch.randn(n, 19, generator=g, dtype=dtype)           # a width past LANES
    table = torch.randn(n, 19, generator=g, dtype=dtype)

    def make():
        total, param = torch.full((n,), 0.5, dtype=dtype), table.clone()
        kernels.rowwise_rows(None, grad, -1.0, 0.1, 1e-8, total, param, 2)
        return total, param

    assert_same(on_threads(make))


def test_the_kernels_alone():
    """The update kernels themselves (not through ``apply_rows``), with the largest case."""
    ids, grad = draw(1000, 3000, 33, torch.float32, 7)
    base = torch.rand(3000, 33, generator=torch.Generator().manual_seed(2))

    def make():
        state, param, out = base.clone(), base.clone(), torch.empty(1000, 33)
        std = kernels.adagrad_sum_rows(ids, grad, 1.0, state, out, 3)
        kernels.adagrad_apply_rows(ids, grad, std.sqrt(), 1.0, 1e-10, -0.1, param, 3)
        kernels.axpy_rows(ids, grad, -1.0, -0.2, param)
        return state, out, param

    assert_same(on_threads(make))
    # a pool with the usual threshold splits the large calls and leaves the small whole
    rowthreads.start(2)
    assert len(rowthreads.split(1000, 1000 * 33)) == 1
    assert len(rowthreads.split(4000, 4000 * 33)) == 2


# -- MPISYNC_PS_THREADS ---------------------------------------------------------------------
@pytest.mark.parametrize("machines, affinities, ps, rank, machine_cores, expected", [
    # one 2-core machine, 2 workers and 1 ps: the ps's 2 (the workers wait for its rows)
    (["a", "a", "a"], [[0, 1]] * 3, [2], 2, 2, 2),
    # one 16-core machine, 2 workers and 2 ps ranks: 8 each
    (["a"] * 4, [list(range(16))] * 4, [2, 3], 3, 16, 8),
    # workers on their nodes, two ps ranks alone on a 32-core node: 16 each
    (["w1", "w2", "p", "p"], [[0, 1]] * 2 + [list(range(32))] * 2, [2, 3], 2, 32, 16),
    # one ps rank alone on a node bound to 8 of its 64 cores: the 8
    (["w", "p"], [[0], list(range(8))], [1], 1, 64, 8),
    # more ps ranks than cores: still one
    (["a"] * 5, [[0, 1]] * 5, [2, 3, 4], 4, 2, 1),
    # cores the ranks may use beyond the machine's count (a wrong mask): the machine's
    (["p"], [list(range(16))], [0], 0, 4, 4),
])
def test_the_default_divides_the_machines_cores_among_its_ps_ranks(machines, affinities, ps,
                                                                  rank, machine_cores,
                                                                  expected):
    _, cores = host_load(rank, machines, affinities)
    here = sum(machines[r] == machines[rank] for r in ps)
    assert rowthreads.default_threads(cores, here, machine_cores) == expected


def test_the_variable_is_read_from_the_registry_and_refused_when_malformed():
    assert environ.VARIABLES[rowthreads.THREADS_ENV].kind == "count"
    assert rowthreads.threads_for(8, 2, {}) == rowthreads.default_threads(8, 2)
    assert rowthreads.threads_for(8, 2, {"MPISYNC_PS_THREADS": " 3 "}) == 3
    assert rowthreads.threads_for(8, 2, {"MPISYNC_PS_THREADS": ""}) == \
        rowthreads.default_threads(8, 2)
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ConfigError, match="MPISYNC_PS_THREADS"):
            rowthreads.threads_for(8, 2, {"MPISYNC_PS_THREADS": bad})
        assert "MPISYNC_PS_THREADS" in environ.problem({"MPISYNC_PS_THREADS": bad})
    assert environ.problem({"MPISYNC_PS_THREADS": "2"}) is None
