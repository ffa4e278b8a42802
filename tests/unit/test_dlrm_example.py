"""examples/dlrm.py's pieces in one process: the pairwise dots' one-``bmm`` backward
against autograd's, and the teacher's share of first-order signal."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from shared_recsys import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import dlrm


def autograd_dots(stacked: torch.Tensor) -> torch.Tensor:
    """The pairs as torch's autograd differentiates them (TorchRec's InteractionArch)."""
    rows, cols = torch.triu_indices(stacked.shape[1], stacked.shape[1], offset=1)
    return torch.bmm(stacked, stacked.transpose(1, 2))[:, rows, cols]


def model_dots(stacked: torch.Tensor) -> torch.Tensor:
    model = dlrm.DLRM(torch.nn.Identity(), dlrm.feature_names(stacked.shape[1] - 1),
                      stacked.shape[2])
    return model.dots(stacked)


class AutogradDLRM(dlrm.DLRM):
    def dots(self, stacked: torch.Tensor) -> torch.Tensor:
        return autograd_dots(stacked)


@pytest.mark.parametrize("size,vectors,dim", [(1, 2, 1), (5, 3, 4), (64, 27, 16)])
def test_pair_dots_and_their_gradient_equal_autograds(size, vectors, dim):
    gen = torch.Generator().manual_seed(size * vectors + dim)
    base = torch.randn(size, vectors, dim, generator=gen)
    out_grad = torch.randn(size, vectors * (vectors - 1) // 2, generator=gen)
    got_in, want_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    got, want = model_dots(got_in), autograd_dots(want_in)
    assert torch.equal(got, want)
    got.backward(out_grad)
    want.backward(out_grad)
    torch.testing.assert_close(got_in.grad, want_in.grad, rtol=1e-5, atol=1e-5)


def test_pair_dots_under_autocast_give_autograds_gradient():
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(6, 5, 8, generator=gen)
    grads = []
    for dots in (model_dots, autograd_dots):
        stacked = base.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = dots(stacked)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        assert stacked.grad.dtype == torch.float32
        grads.append(stacked.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-2)


def test_pair_dots_pass_gradcheck_in_float64():
    stacked = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(model_dots, (stacked,))


def test_a_dlrm_step_with_pair_dots_equals_one_with_autograds_dots():
    # the whole model, one backward: every parameter's gradient as with autograd's dots
    teacher = dlrm.Teacher(0, 3, 20)
    batch = teacher.draw(np.random.default_rng(1), 64)
    clicks = torch.from_numpy(batch.clicks)
    grads = []
    for kind in (dlrm.DLRM, AutogradDLRM):
        torch.manual_seed(0)
        tables = {f"t{i}": torch.nn.EmbeddingBag(20, 8, mode="sum") for i in range(3)}
        model = kind(dlrm.LocalTables(tables), list(tables), 8)
        dense, sparse = dlrm.inputs(batch, model.features)
        torch.nn.BCEWithLogitsLoss()(model(dense, sparse), clicks).backward()
        grads.append([p.grad for p in model.parameters()])
    assert len(grads[0]) == 3 + 4 + 6                  # tables, bottom MLP, top MLP
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_teachers_first_order_terms_carry_most_of_its_logits_variance():
    teacher = dlrm.Teacher(0, 26, 100, 1)
    dense, ids, offsets, lengths = teacher._features(np.random.default_rng(5), 20_000)
    total = teacher._raw(dense, ids, offsets, lengths)
    first_order, dlrm.FIRST_ORDER = dlrm.FIRST_ORDER, 0.0
    try:
        pairs = teacher._raw(dense, ids, offsets, lengths)
    finally:
        dlrm.FIRST_ORDER = first_order
    assert 0.01 < pairs.var() / total.var() < 0.06


def test_local_and_distributed_models_start_the_same(monkeypatch):
    # --local: the same MLPs, the plain tables' rows, and for a hashed id the row its
    # mpisync.HashEmbeddingBag gives it when admitted
    monkeypatch.setattr(sys, "argv", ["dlrm.py", "--tables", "4", "--rows", "50", "--hashed", "2"])
    args = dlrm.parse_args()
    local, _ = dlrm.build(args, "torch")
    remote, _ = dlrm.build(args, "mpisync")
    for (name, a), (_, b) in zip(local.bottom.named_parameters(),
                                 remote.bottom.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(local.top.parameters(), remote.top.parameters(), strict=True):
        assert torch.equal(a, b)
    for name in ("t0", "t1"):
        assert torch.equal(local.tables.tables[name].weight,
                           remote.tables.tables[name].table.weight)
    ids = torch.tensor([2 ** 40 + 3, -7, 2 ** 40 + 3, 11])
    pooled = local.tables.tables["t3"](ids, torch.tensor([0, 2]))
    admitted = remote.tables.tables["t3"].initial_rows(torch.tensor([2 ** 40 + 3, -7, 11]))
    assert torch.equal(pooled, torch.stack([admitted[0] + admitted[1],
                                            admitted[0] + admitted[2]]))
