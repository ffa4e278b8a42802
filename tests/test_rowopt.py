"""The ps's row path in one process: merged rows and row updates against plain torch, bitwise.

``merge_rows`` against a row-by-row sum in worker order (and ``reduce_rows``, the COO
coalesce it replaces); ``apply_rows`` against torch's own step on the coalesced sparse
gradient (SGD, Adagrad, SparseAdam: several steps, a changing learning rate);
``RowWiseAdagrad`` against a loop written from its formula, dense against sparse, and
its row path against its own step. The compiled kernels (``mpisync.kernels``) and the
torch code they stand in for are each checked where they differ (``kernels`` on and off).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import mpisync
from mpisync import kernels, pooled
from mpisync.accumulate import reduce_rows
from mpisync.rowopt import RowScratch, apply_rows, handles_rows, merge_rows


@pytest.fixture(params=["kernels", "torch"])
def row_code(request, monkeypatch):
    """Each test twice: with the compiled row kernels, and with the torch code alone."""
    if request.param == "kernels":
        if not kernels.available(torch.zeros(1)):
            pytest.skip("no C compiler here: the row kernels are not built")
    else:
        monkeypatch.setattr(kernels, "_lib", None)
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
@pytest.mark.parametrize("dim, dtype", [(3, torch.float32), (64, torch.float32),
                                        (5, torch.float64)])
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


@pytest.mark.parametrize("dim, dtype", [(4, torch.float32), (64, torch.float32),
                                        (67, torch.float32), (5, torch.float64)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_row_update_is_bitwise_torchs_sparse_step(name, dim, dtype, row_code):
    """Several steps with a StepLR schedule; every row block size and vector tail."""
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
        ref.grad = torch.sparse_coo_tensor(ids[None], values, (rows, dim),
                                           check_invariants=True).coalesce()
        ref_opt.step()
        assert handles_rows(opt, opt.param_groups[0], mine)
        apply_rows(opt, opt.param_groups[0], mine, ids, values, scratch)
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
def test_rowwise_adagrad_dense_sparse_and_row_path_agree_bitwise(kw):
    """The same rows: a sparse gradient, a dense one zero elsewhere, and the ps's row path."""
    g = torch.Generator().manual_seed(2)
    rows, dim = 5000, 64
    w0 = torch.randn(rows, dim, generator=g)
    dense, sparse, ps = (torch.nn.Parameter(w0.clone()) for _ in range(3))
    opts = [mpisync.RowWiseAdagrad([q], lr=0.1, **kw) for q in (dense, sparse, ps)]
    scratch = RowScratch()
    for _ in range(3):
        ids = torch.randperm(rows, generator=g)[:3000].sort().values
        values = torch.randn(len(ids), dim, generator=g)
        dense.grad = torch.zeros(rows, dim).index_copy_(0, ids, values)
        sparse.grad = torch.sparse_coo_tensor(ids[None], values, (rows, dim),
                                              check_invariants=True)
        for o in opts[:2]:
            o.step()
        assert handles_rows(opts[2], opts[2].param_groups[0], ps)
        apply_rows(opts[2], opts[2].param_groups[0], ps, ids, values, scratch)
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
    from mpisync.state import check_state
    w, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5))
    opt = mpisync.RowWiseAdagrad([w, b], lr=0.1)
    w.grad, b.grad = torch.randn(5, 3), torch.randn(5)
    opt.step()
    sd = opt.state_dict()
    shapes = {"w": (5, 3), "b": (5,)}
    assert check_state(sd, opt.param_groups, ["w", "b"], shapes) is None
    sd["state"][1]["sum"] = torch.zeros(3)
    assert "has shape [3]" in check_state(sd, opt.param_groups, ["w", "b"], shapes)


def test_without_a_compiler_the_torch_code_steps_in(tmp_path):
    """No C compiler (``CC`` names none): the kernels are not built, nothing fails, and
    the row path still runs on torch; a built library is reused from the cache."""
    code = ("import torch\nfrom mpisync import kernels\n"
            "from mpisync.rowopt import RowScratch, merge_rows\n"
            "print(kernels.available(torch.zeros(1)))\n"
            "p = [(torch.tensor([0, 2]), torch.ones(2, 3)), (torch.tensor([2]), torch.ones(1, 3))]\n"
            "ids, rows = merge_rows(p, 4, 2, 'mean', RowScratch())\n"
            "print(ids.tolist(), rows.sum().item())\n")
    env = dict(os.environ, MPISYNC_CACHE=str(tmp_path / "cache"), CC=str(tmp_path / "no-cc"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["False", "[0, 2] 4.5"], run.stdout
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))
    if shutil.which("cc") or shutil.which("gcc"):
        env.pop("CC")
        for _ in range(2):                      # built once, then loaded from the cache
            run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
            assert run.returncode == 0, run.stderr
            assert run.stdout.split("\n")[:2] == ["True", "[0, 2] 4.5"], run.stdout
        assert len(list((tmp_path / "cache").glob("rows-*.so"))) == 1
