"""The ps's row path in one process: merged rows and row updates against plain torch, bitwise.

``merge_rows`` against a row-by-row sum in worker order (and ``reduce_rows``, the COO
coalesce it replaces); ``apply_rows`` against torch's own step on the coalesced sparse
gradient (SGD, Adagrad, SparseAdam: several steps, a changing learning rate);
``RowWiseAdagrad`` against a loop written from its formula, dense against sparse, and
its row path against its own step. The compiled kernels (``mpisync.native.kernels``) and the
torch code they stand in for are each checked where they differ (``kernels`` on and off).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import mpisync
from mpisync.accumulate import reduce_rows
from mpisync.native import kernels, plankernels, rowslib
from mpisync.protocol import pooled
from mpisync.tables.rowopt import RowScratch, apply_rows, handles_rows, merge_rows


@pytest.fixture(params=["kernels", "torch"])
def row_code(request, monkeypatch):
    """Each test twice: with the compiled row kernels, and with the torch code alone."""
    if request.param == "kernels":
        if not kernels.available(torch.zeros(1)):
            pytest.skip("no C compiler here: the row kernels are not built")
    else:
        monkeypatch.setattr(rowslib, "_lib", None)
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that -0.0 and 0.0 (and NaNs) compare as the bits they are."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    return a == b


# -- merging ----------------------------------------------------------------------------------
def random_pieces(g: torch.Generator, rows: int, k: int, dim: int, dtype=torch.float32):
    pieces = []
    for _ in range(k):
        m = int(torch.randint(1, rows + 1, (), generator=g))
        ids = torch.randperm(rows, generator=g)[:m].sort().values
        v = torch.randn(m, dim, generator=g, dtype=dtype)
        v[v.abs() < 0.1] = -0.0                  # a copied -0.0 stays -0.0
        pieces.append((ids, v))
    return pieces


def worker_order(pieces, rows: int, count: int, how: str):
    """Row by row: the first piece's row, the later ones added in order, then divided."""
    ids, out = [], []
    for i in range(rows):
        got = [v[(p == i).nonzero()[0, 0]] for p, v in pieces if bool((p == i).any())]
        if not got:
            continue
        acc = got[0].clone()
        for x in got[1:]:
            acc = acc + x
        if how == "mean" and count > 1:
            acc = acc / count
        elif how == "per_row" and count > 1:
            acc = acc / float(len(got))
        ids.append(i)
        out.append(acc)
    return torch.tensor(ids, dtype=torch.int64), torch.stack(out)


@pytest.mark.parametrize("how", ["mean", "sum", "per_row"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_merged_rows_are_summed_in_worker_order(how, k, row_code):
    g = torch.Generator().manual_seed(k)
    scratch = RowScratch()
    for trial in range(6):
        rows, dim = 30 + trial, 1 + trial
        pieces = random_pieces(g, rows, k, dim)
        count = k + trial % 2                   # a taken gradient may have no rows here
        want_ids, want = worker_order(pieces, rows, count, how)
        for s in (None, scratch):
            ids, got = merge_rows(pieces, rows, count, how, s)
            assert same(ids, want_ids) and same(got, want), (how, k, trial)
        if k <= 2:          # the coalesce's order is the pieces' order for two of them
            ref = reduce_rows(pieces, (rows, dim), count, how)
            assert same(got, ref.values()) and same(ids, ref.indices()[0])


def test_merged_rows_equal_the_coalesce_at_recommender_scale(row_code):
    g = torch.Generator().manual_seed(0)
    pieces = random_pieces(g, 60_000, 2, 8)
    ref = reduce_rows(pieces, (60_000, 8), 2, "mean")
    ids, got = merge_rows(pieces, 60_000, 2, "mean", RowScratch())
    assert same(ids, ref.indices()[0]) and same(got, ref.values())


def test_merge_refuses_unsorted_ids_and_rows_outside_the_shard(row_code):
    v = torch.ones(3, 2)
    assert merge_rows([(torch.tensor([0, 2, 1]), v)], 5, 1) is None
    assert merge_rows([(torch.tensor([0, 1, 1]), v)], 5, 1) is None
    with pytest.raises(IndexError, match=r"row 5 outside \[0, 5\)"):
        merge_rows([(torch.tensor([0, 1, 5]), v)], 5, 1)
    with pytest.raises(IndexError, match=r"row -1 outside \[0, 5\)"):
        merge_rows([(torch.tensor([-1, 1, 2]), v)], 5, 1)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim, dtype", [(3, torch.float32), (16, torch.float32),
                                        (32, torch.float32), (64, torch.float32),
                                        (128, torch.float32), (5, torch.float64)])
def test_bag_gradients_become_rows_as_torch_sums_them(weighted, dim, dtype):
    """A pooled push's bags to rows: the kernel against the gather, product and
    ``index_add_`` of the torch code (ids repeated within and across bags), bitwise."""
    if not kernels.available(torch.zeros(1)):
        pytest.skip("no C compiler here: the row kernels are not built")
    g = torch.Generator().manual_seed(dim)
    rows, bags, n = 500, 64, 1500
    ids = torch.randint(0, rows, (n,), generator=g)
    bag = torch.randint(0, bags, (n,), generator=g).sort().values
    weights = torch.randn(n, generator=g, dtype=dtype) if weighted else None
    grads = torch.randn(bags, dim, generator=g, dtype=dtype)
    each = grads[bag] * (weights.view(-1, 1) if weighted else 1)
    want_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    want = torch.zeros(len(want_ids), dim, dtype=dtype).index_add_(0, inverse, each)
    scratch = RowScratch()
    for _ in range(2):                      # the slots are left clean for the next push
        got_ids, got = kernels.bag_rows(ids, bag, weights, grads, scratch.slots(rows))
        assert same(got_ids, want_ids) and same(got, want)
    assert bool((scratch.slots(rows) == -1).all())
    part = pooled.Part(ids, bag, weights, bags)
    buf = pooled.pack_parts(pooled.POOLED, [part], [grads])
    param = torch.zeros(rows, dim, dtype=dtype)
    for scratches in (None, [scratch]):     # the push's parser, torch and kernel
        (got_ids, got), = pooled.row_grads(buf, 0, [param], [0], scratches)
        assert same(got_ids, want_ids) and same(got, want)


# -- applying torch's optimizers to rows -----------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.37),
    "sgd-maximize-tensor-lr": lambda p: torch.optim.SGD(p, lr=torch.tensor(0.37), maximize=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.01,
                                             initial_accumulator_value=0.2),
    "adagrad-maximize-eps-tensor-lr": lambda p: torch.optim.Adagrad(
        p, lr=torch.tensor(0.3), eps=1e-3, maximize=True),
    "sparse-adam": lambda p: torch.optim.SparseAdam(p, lr=0.03, betas=(0.8, 0.95), eps=1e-6),
    "sparse-adam-maximize": lambda p: torch.optim.SparseAdam(p, lr=0.03, maximize=True),
}


def planned(ids: torch.Tensor, values: torch.Tensor, num_rows: int, scratch: RowScratch,
            g: torch.Generator):
    """``(ids, values)`` as the ps's step gives them to ``apply_rows``: a ``Plan`` of two
    pieces, the rows in a shuffled order and each split in two halves added in turn."""
    order = torch.randperm(len(ids), generator=g)
    part = torch.rand(values.shape, generator=g, dtype=values.dtype)
    first = values * part                      # first + (values - first) rounds to values?
    second = values - first                    # not always: the plan must add them in order
    pieces = [(ids[order], None, None, first[order]), (ids[order], None, None, second[order])]
    p = plankernels.plan(pieces, scratch.plan_marks(num_rows), scratch, values.shape[1:])
    return pieces, p


def summed_in_order(pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows pieces of the same ids in the same order, added piece by piece."""
    ids, total = pieces[0][0], pieces[0][3].clone()
    for _, _, _, rows in pieces[1:]:
        total += rows
    return ids, total


@pytest.mark.parametrize("dim, dtype", [(4, torch.float32), (16, torch.float32),
                                        (32, torch.float32), (64, torch.float32),
                                        (67, torch.float32), (128, torch.float32),
                                        (5, torch.float64)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("given", ["rows", "plan"])
def test_row_update_is_bitwise_torchs_sparse_step(name, dim, dtype, row_code, given):
    """Several steps with a StepLR schedule; every row block size and vector tail; the
    gradient as rows, or (with the kernels) as the ps's plan of its pieces, updated from
    in one pass where the optimizer has a planned kernel."""
    if given == "plan" and row_code != "kernels":
        pytest.skip("a plan is made by the row kernels")
    g = torch.Generator().manual_seed(dim)
    rows = 2200                      # more than a block of rows
    w0 = torch.randn(rows, dim, generator=g, dtype=dtype)
    mine, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt, ref_opt = OPTIMIZERS[name]([mine]), OPTIMIZERS[name]([ref])
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in (opt, ref_opt)]
    scratch = RowScratch()
    for _ in range(4):
        ids = torch.randperm(rows, generator=g)[:2100].sort().values
        values = torch.randn(len(ids), dim, generator=g, dtype=dtype)
        if given == "plan":
            pieces, values = planned(ids, values, rows, scratch, g)
            ids, summed = summed_in_order(pieces)
            assert same(values.summed(), summed)
        ref.grad = torch.sparse_coo_tensor(ids[None], summed if given == "plan" else values,
                                           (rows, dim), check_invariants=True).coalesce()
        ref_opt.step()
        assert handles_rows(opt, opt.param_groups[0], mine)
        apply_rows(opt, opt.param_groups[0], mine, values.ids if given == "plan" else ids,
                   values, scratch)
        opt.step()                   # as on the ps: the optimizer's own step, then the rows
        for s in scheds:
            s.step()
    assert same(mine, ref), (mine - ref).abs().max()
    assert opt.state[mine].keys() == ref_opt.state[ref].keys()
    for key, value in ref_opt.state[ref].items():
        assert same(opt.state[mine][key], value), key
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]


class AdagradWithOwnStep(torch.optim.Adagrad):
    pass


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
    lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1),
    lambda p: torch.optim.Adagrad(p, lr=0.1, differentiable=True),
    lambda p: torch.optim.Adam(p, lr=0.1),
    lambda p: AdagradWithOwnStep(p, lr=0.1),
])
def test_other_optimizers_are_left_to_their_own_step(make):
    p = torch.nn.Parameter(torch.zeros(4, 2))
    opt = make([p])
    assert not handles_rows(opt, opt.param_groups[0], p)


# -- RowWiseAdagrad ---------------------------------------------------------------------------
def rowwise_reference(w0, grads, lr, eps, init, decay, maximize):
    """The formula, row by row in float64: sum[i] += mean(g[i]**2); p[i] -= lr g[i] / (...)."""
    p = w0.double().clone()
    total = [float(init)] * (p.shape[0] if p.dim() > 1 else p.numel())
    for grad in grads:
        for i in range(p.shape[0]):
            g = grad[i].double()
            g = -g if maximize else g
            g = g + decay * p[i] if decay else g
            total[i] += float((g * g).mean())
            p[i] = p[i] - lr * g / (total[i] ** 0.5 + eps)
    return p, torch.tensor(total, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(6, 5), (5, 2, 3), (7,)])
@pytest.mark.parametrize("kw", [{}, {"maximize": True, "initial_accumulator_value": 0.3},
                                {"weight_decay": 0.1, "eps": 1e-3}])
def test_rowwise_adagrad_follows_its_formula(shape, kw):
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(*shape, generator=g)
    grads = [torch.randn(*shape, generator=g) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = mpisync.RowWiseAdagrad([p], lr=0.2, **kw)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    want_p, want_sum = rowwise_reference(w0, grads, 0.2, kw.get("eps", 1e-10),
                                         kw.get("initial_accumulator_value", 0.0),
                                         kw.get("weight_decay", 0.0), kw.get("maximize", False))
    state = opt.state[p]
    assert state["sum"].shape == (shape[0],) and float(state["step"]) == 3
    torch.testing.assert_close(state["sum"].double(), want_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.detach().double(), want_p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw", [{}, {"maximize": True, "initial_accumulator_value": 0.5}])
@pytest.mark.parametrize("given", ["rows", "plan"])
def test_rowwise_adagrad_dense_sparse_and_row_path_agree_bitwise(kw, given):
    """The same rows: a sparse gradient, a dense one zero elsewhere, and the ps's row path
    (the rows, or the ps's plan of their pieces)."""
    if given == "plan" and not kernels.available(torch.zeros(1)):
        pytest.skip("no C compiler here: the row kernels are not built")
    g = torch.Generator().manual_seed(2)
    rows, dim = 5000, 64
    w0 = torch.randn(rows, dim, generator=g)
    dense, sparse, ps = (torch.nn.Parameter(w0.clone()) for _ in range(3))
    opts = [mpisync.RowWiseAdagrad([q], lr=0.1, **kw) for q in (dense, sparse, ps)]
    scratch = RowScratch()
    for _ in range(3):
        ids = torch.randperm(rows, generator=g)[:3000].sort().values
        values = torch.randn(len(ids), dim, generator=g)
        given_ids, given_rows = ids, values
        if given == "plan":
            pieces, given_rows = planned(ids, values, rows, scratch, g)
            ids, values = summed_in_order(pieces)
            given_ids = given_rows.ids
        dense.grad = torch.zeros(rows, dim).index_copy_(0, ids, values)
        sparse.grad = torch.sparse_coo_tensor(ids[None], values, (rows, dim),
                                              check_invariants=True)
        for o in opts[:2]:
            o.step()
        assert handles_rows(opts[2], opts[2].param_groups[0], ps)
        apply_rows(opts[2], opts[2].param_groups[0], ps, given_ids, given_rows, scratch)
    for q, o in ((sparse, opts[1]), (ps, opts[2])):
        assert same(q, dense)
        for key in ("sum", "step"):
            assert same(o.state[q][key], opts[0].state[dense][key]), key


def test_rowwise_adagrad_decays_only_the_rows_of_a_sparse_gradient():
    p = torch.nn.Parameter(torch.ones(4, 2))
    opt = mpisync.RowWiseAdagrad([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.zeros(1, 2), (4, 2),
                                     check_invariants=True)
    opt.step()
    assert torch.equal(p[[0, 2, 3]], torch.ones(3, 2)) and bool((p[1] < 1).all())


@pytest.mark.parametrize("kw, cause", [({"lr": -1.0}, "lr must be at least 0, got -1.0"),
                                       ({"eps": -1e-3}, "eps must be at least 0"),
                                       ({"weight_decay": -0.1}, "weight_decay must be at least 0"),
                                       ({"lr": torch.ones(2)}, "one element, got 2")])
def test_rowwise_adagrad_refuses_bad_hyper_parameters(kw, cause):
    with pytest.raises(ValueError, match=cause):
        mpisync.RowWiseAdagrad([torch.nn.Parameter(torch.zeros(2, 2))], **kw)


def test_rowwise_adagrad_state_dict_loads_into_a_new_one():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = mpisync.RowWiseAdagrad([p], lr=0.1)
    p.grad = torch.randn(4, 3)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    other = mpisync.RowWiseAdagrad([q], lr=0.5)
    other.load_state_dict(opt.state_dict())
    assert same(other.state[q]["sum"], opt.state[p]["sum"])
    assert other.param_groups[0]["lr"] == 0.1


def test_rowwise_adagrad_state_passes_the_state_check_of_a_restore():
    """A row-wise ``sum`` of shape (rows,) is the state of a 2-D parameter, not a mismatch."""
    from mpisync.protocol.state import check_state
    w, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5))
    opt = mpisync.RowWiseAdagrad([w, b], lr=0.1)
    w.grad, b.grad = torch.randn(5, 3), torch.randn(5)
    opt.step()
    sd = opt.state_dict()
    shapes = {"w": (5, 3), "b": (5,)}
    assert check_state(sd, opt.param_groups, ["w", "b"], shapes) is None
    sd["state"][1]["sum"] = torch.zeros(3)
    assert "has shape [3]" in check_state(sd, opt.param_groups, ["w", "b"], shapes)


# whether the kernels load, then a merge of two pieces, in a process of its own
MERGE_IN_A_FRESH_PROCESS = (
    "import torch\nfrom mpisync.native import kernels\n"
    "from mpisync.tables.rowopt import RowScratch, merge_rows\n"
    "print(kernels.available(torch.zeros(1)))\n"
    "p = [(torch.tensor([0, 2]), torch.ones(2, 3)), (torch.tensor([2]), torch.ones(1, 3))]\n"
    "ids, rows = merge_rows(p, 4, 2, 'mean', RowScratch())\n"
    "print(ids.tolist(), rows.sum().item())\n")


def test_without_a_compiler_the_torch_code_steps_in(tmp_path):
    """No C compiler (``CC`` names none) or one that fails: the kernels are not built, a
    warning says why, nothing fails, and the row path still runs on torch; a built library
    is reused from the cache."""
    code = MERGE_IN_A_FRESH_PROCESS
    env = dict(os.environ, MPISYNC_CACHE=str(tmp_path / "cache"), CC=str(tmp_path / "no-cc"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["False", "[0, 2] 4.5"], run.stdout
    assert "row kernels (_rows.c) could not be built" in run.stderr, run.stderr
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))
    broken = tmp_path / "broken-cc"             # a compiler that fails: said, then torch
    broken.write_text("#!/bin/sh\necho 'error: out of licences' >&2\nexit 3\n")
    broken.chmod(0o755)
    run = subprocess.run([sys.executable, "-c", code], env=dict(env, CC=str(broken)),
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["False", "[0, 2] 4.5"], run.stdout
    assert "exited with status 3: error: out of licences" in run.stderr, run.stderr
    assert not list((tmp_path / "cache").glob("*"))      # no half-built file left
    if shutil.which("cc") or shutil.which("gcc"):
        env.pop("CC")
        for _ in range(2):                      # built once, then loaded from the cache
            run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
            assert run.returncode == 0, run.stderr
            assert run.stdout.split("\n")[:2] == ["True", "[0, 2] 4.5"], run.stdout
        assert len(list((tmp_path / "cache").glob("rows-*.so"))) == 1


# -- the step's sums in one pass: plankernels.plan ----------------------------------------------
needs_kernels = pytest.mark.skipif(not kernels.available(torch.zeros(1)),
                                   reason="no C compiler here: the row kernels are not built")


def in_order(pieces):
    """Row by row in Python: each id's first contribution copied, the later ones added one
    after another; the ids in first-seen order."""
    acc: dict[int, torch.Tensor] = {}
    for ids, bag, weights, rows in pieces:
        for i, r in enumerate(ids.tolist()):
            x = rows[i] if bag is None else rows[int(bag[i])]
            x = x if weights is None else x * weights[i]
            acc[r] = x.clone() if r not in acc else acc[r] + x
    return torch.tensor(list(acc), dtype=torch.int64), torch.stack(list(acc.values()))


@needs_kernels
@pytest.mark.parametrize("row_shape", [(1,), (5,), (64,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_step_sums_every_piece_in_order_in_one_pass(row_shape, dtype):
    """Rows pieces and pooled pieces (weighted or not, ids repeated within and across
    them), non-contiguous inputs among them: bitwise the sum in order, the slots clean."""
    g = torch.Generator().manual_seed(len(row_shape) + row_shape[0])
    rows, bags = 60, 9
    sorted_ids = torch.randperm(rows, generator=g)[:25].sort().values
    wide = torch.randn(25, 2, *row_shape, generator=g, dtype=dtype)
    pieces = [(sorted_ids, None, None, wide[:, 0])]           # a strided view of rows
    for weighted in (True, False):
        n = 80
        ids = torch.randint(0, rows, (2 * n,), generator=g)[::2]        # strided ids
        bag = torch.randint(0, bags, (n,), generator=g)
        weights = torch.rand(2 * n, generator=g, dtype=dtype)[1::2] if weighted else None
        pieces.append((ids, bag, weights, torch.randn(bags, *row_shape, generator=g,
                                                      dtype=dtype)))
    want_ids, want = in_order(pieces)
    scratch = RowScratch()
    marks = scratch.plan_marks(rows)
    for _ in range(2):                  # the marks of the first plan mark none in the next
        p = plankernels.plan(pieces, marks, scratch, row_shape)
        assert same(p.ids, want_ids) and same(p.summed(), want)
    marks.gen = (1 << 31) - 1                            # the generations wrap around
    for _ in range(2):
        p = plankernels.plan(pieces, marks, scratch, row_shape)
        assert same(p.ids, want_ids) and same(p.summed(), want)
    assert marks.gen == 2
    # rows pieces alone: the merge's sums (each id's rows in the pieces' order), bitwise
    two = random_pieces(g, rows, 2, math.prod(row_shape), dtype)
    p = plankernels.plan([(i, None, None, r) for i, r in two], marks, scratch,
                         (math.prod(row_shape),))
    order = p.ids.argsort()
    ids, merged = merge_rows(two, rows, 2, "sum", RowScratch())
    assert same(p.ids[order], ids) and same(p.summed()[order], merged)


@pytest.mark.parametrize("how", ["mean", "sum"])
def test_a_step_of_pooled_pushes_is_within_rounding_of_the_rows_merged(how, row_code):
    """What the ps steps with: the pooled pieces summed in one pass, or turned into rows
    per push and merged (the torch code), within rounding of each other."""
    g = torch.Generator().manual_seed(3)
    rows, bags, dim = 40, 6, 4
    param = torch.zeros(rows, dim)
    parts = []
    for _ in range(2):
        n = 30
        parts.append((pooled.Part(torch.randint(0, rows, (n,), generator=g),
                                  torch.randint(0, bags, (n,), generator=g).sort().values,
                                  torch.rand(n, generator=g), bags),
                      torch.randn(bags, dim, generator=g)))
    merged = merge_rows([pooled.rows_of(p, gr, rows) for p, gr in parts], rows, 2, how)
    dense = torch.zeros(rows, dim).index_add_(0, *merged)
    if row_code == "kernels":
        scratch = RowScratch()
        plan = plankernels.plan([(p.ids, p.bag, p.weights, gr) for p, gr in parts],
                                scratch.plan_marks(rows), scratch, (dim,))
        got = torch.zeros(rows, dim).index_add_(0, plan.ids, plan.summed() / (2 if how == "mean"
                                                                              else 1))
        torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-6)
    assert param.abs().sum() == 0


# -- lookups answered straight into the reply --------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("row_shape, dtype", [((4,), torch.float32), ((16,), torch.float32),
                                              ((32,), torch.float32), ((64,), torch.float32),
                                              ((128,), torch.float32), ((2, 3), torch.float64)])
def test_a_lookup_is_answered_the_same_with_and_without_the_kernels(row_shape, dtype,
                                                                     monkeypatch):
    """Two shards of one table pooled (their sums added row after row into one block,
    weighted and not), a rows part of another table: the same reply bytes either way."""
    g = torch.Generator().manual_seed(7)
    shards = [torch.randn(30, *row_shape, generator=g, dtype=dtype) for _ in range(3)]
    n = 50
    parts = [pooled.Part(torch.randint(0, 30, (n,), generator=g),
                         torch.randint(0, 8, (n,), generator=g).sort().values,
                         torch.rand(n, generator=g, dtype=dtype), 8),
             pooled.Part(torch.randint(0, 30, (n,), generator=g),
                         torch.randint(0, 8, (n,), generator=g), None, 8),
             pooled.Part(torch.randperm(30, generator=g)[:12].sort().values)]
    msg = pooled.pack_parts(pooled.EXCHANGE, parts, [])
    compiled = pooled.answer(msg, shards, [0, 0, 1])
    monkeypatch.setattr(rowslib, "_lib", None)
    assert np.array_equal(compiled, pooled.answer(msg, shards, [0, 0, 1]))
    block = torch.from_numpy(compiled[:8 * shards[0][0].numel() * dtype.itemsize].copy()
                             ).view(dtype).view(8, *row_shape)
    want = torch.zeros(8, *row_shape, dtype=dtype)
    for p, shard in zip(parts[:2], shards):
        each = shard[p.ids] * (1 if p.weights is None else
                               p.weights.view(-1, *[1] * len(row_shape)))
        want.index_add_(0, p.bag, each)
    assert same(block, want)


# -- row-wise Adagrad: the kernel and its torch code ------------------------------------------
@needs_kernels
@pytest.mark.parametrize("shape", [(40, 64), (20, 16), (20, 32), (20, 128), (30, 5),
                                   (25, 2, 3), (17,), ()])
@pytest.mark.parametrize("kw", [{}, {"maximize": True, "initial_accumulator_value": 0.3},
                                {"weight_decay": 0.1, "eps": 1e-3}, {"lr": "tensor"}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rowwise_adagrad_kernel_is_bitwise_its_torch_code(shape, kw, dtype, monkeypatch):
    """Dense and sparse steps and the ps's rows (sums divided by 2 and by 3 in the update),
    given as rows or as the ps's plan of them: the compiled kernels and the torch code give
    the same bits, state included, at every row width the kernels write out in full."""
    kw = {**kw, "lr": torch.tensor(0.05)} if kw.get("lr") == "tensor" else {"lr": 0.05, **kw}
    g = torch.Generator().manual_seed(len(shape))
    w0 = torch.randn(shape, generator=g, dtype=dtype)
    grads = [torch.randn(shape, generator=g, dtype=dtype) for _ in range(3)]
    picks = [torch.randperm(shape[0], generator=g)[:max(1, shape[0] // 2)] if shape else None
             for _ in range(3)]

    def train(given: str):
        p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
        opt, ps = mpisync.RowWiseAdagrad([p], **kw), mpisync.RowWiseAdagrad([q], **kw)
        for grad, ids, div in zip(grads, picks, (0, 2, 3)):
            p.grad = grad.clone()
            opt.step()
            if ids is not None:
                rows, scratch = grad[ids] * max(div, 1), RowScratch()
                if given == "plan":             # the ps's plan of the rows, one pass
                    rows = plankernels.plan([(ids, None, None, rows)],
                                            scratch.plan_marks(shape[0]), scratch, shape[1:])
                apply_rows(ps, ps.param_groups[0], q, ids, rows, scratch, div)
        return p, opt.state[p], q, ps.state[q]

    compiled = [train("rows"), train("plan")]
    monkeypatch.setattr(rowslib, "_lib", None)
    plain = train("rows")
    for run in compiled:
        for a, b in zip(run, plain):
            if torch.is_tensor(a):
                assert same(a, b)
            else:
                assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


# -- what the kernels do not take: the torch code steps in -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_half_precision_tables_step_as_torch_does(name, dtype):
    g = torch.Generator().manual_seed(4)
    w0 = torch.randn(300, 8, generator=g).to(dtype)
    mine, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt, ref_opt = OPTIMIZERS[name]([mine]), OPTIMIZERS[name]([ref])
    for _ in range(3):
        ids = torch.randperm(300, generator=g)[:120].sort().values
        values = torch.randn(120, 8, generator=g).to(dtype)
        ref.grad = torch.sparse_coo_tensor(ids[None], values, (300, 8)).coalesce()
        ref_opt.step()
        apply_rows(opt, opt.param_groups[0], mine, ids, values, RowScratch())
    assert same(mine, ref)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "sparse-adam"])
def test_strided_rows_and_ids_step_as_torch_does(name, row_code):
    """Gradient rows and ids that are views with strides: the kernels take copies, the
    torch code takes them as they are; the result is torch's. (A table itself is always
    contiguous on the ps; torch's own sparse steps refuse a strided one.)"""
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(400, 8, generator=g)
    mine, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt, ref_opt = OPTIMIZERS[name]([mine]), OPTIMIZERS[name]([ref])
    for _ in range(3):
        ids = torch.randperm(400, generator=g)[:300].sort().values[::2]
        values = torch.randn(150, 16, generator=g)[:, ::2]
        assert not ids.is_contiguous() and not values.is_contiguous()
        ref.grad = torch.sparse_coo_tensor(ids[None], values, (400, 8)).coalesce()
        ref_opt.step()
        apply_rows(opt, opt.param_groups[0], mine, ids, values, RowScratch())
    assert same(mine, ref)


@needs_kernels
def test_a_strided_rowwise_table_is_stepped_by_the_torch_code_bitwise_the_kernels():
    g = torch.Generator().manual_seed(6)
    w0 = torch.randn(200, 12, generator=g)
    strided = torch.nn.Parameter(w0.t().contiguous().t())
    plain = torch.nn.Parameter(w0.clone())
    opts = [mpisync.RowWiseAdagrad([p], lr=0.1) for p in (strided, plain)]
    for _ in range(3):
        ids = torch.randperm(200, generator=g)[:90]
        rows = torch.randn(90, 12, generator=g)
        for p, o in zip((strided, plain), opts):
            apply_rows(o, o.param_groups[0], p, ids, rows, RowScratch(), 2)
    assert torch.equal(strided, plain)
    assert same(opts[0].state[strided]["sum"], opts[1].state[plain]["sum"])


# -- the workers' split of ids by shard ------------------------------------------------------
@needs_kernels
def test_ids_split_by_shard_as_map_ids_and_a_stable_sort_do():
    from mpisync.protocol import partition
    g = torch.Generator().manual_seed(8)
    for rows in (1, 2, 3, 7, 10, 100, 1001):
        for n in range(1, min(rows, 9) + 1):
            for strategy in ("mod", "div"):
                ids = torch.randint(0, rows, (300,), generator=g)
                shard, local = partition.map_ids(ids, rows, n, strategy)
                order = torch.argsort(shard, stable=True)
                got = kernels.split_ids(ids, strategy, rows, n)
                assert torch.equal(got[0], order) and torch.equal(got[2], local[order])
                assert got[1] == torch.bincount(shard, minlength=n).tolist()
    assert kernels.split_ids(torch.tensor([0, 5]), "mod", 5, 2) is None     # outside
    assert kernels.split_ids(torch.tensor([-1]), "div", 5, 2) is None


def test_a_cache_that_cannot_be_written_builds_the_kernels_in_a_private_directory(tmp_path):
    """``MPISYNC_CACHE`` below a file (no directory can be made there): the library is
    built in a temporary directory of its own, used, and nothing is left behind."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = MERGE_IN_A_FRESH_PROCESS
    env = dict(os.environ, MPISYNC_CACHE=str(blocker / "cache"), TMPDIR=str(tmp_path))
    env.pop("CC", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["True", "[0, 2] 4.5"], run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
