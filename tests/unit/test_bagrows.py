"""An EmbeddingBag's rows path on a worker (``mpisync.tables.bagrows``): its forward is
torch's ``F.embedding_bag`` and its gradient of the rows torch's within float rounding,
over the inputs users write (one process)."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from mpisync.protocol.bags import bags_of
from mpisync.tables import bagrows

CASES = [
    # (mode, 2-D input, weights, padding id, include_last_offset, empty bags)
    ("sum", False, False, None, False, False),
    ("sum", True, False, None, False, False),
    ("sum", False, True, None, False, True),
    ("mean", False, False, 3, False, True),
    ("mean", True, False, 3, False, False),
    ("sum", False, True, 3, True, True),
    ("mean", False, False, None, True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode, two_d, weighted, padding, last, empty", CASES)
def test_the_rows_gradient_is_torchs(mode, two_d, weighted, padding, last, empty, dtype):
    g = torch.Generator().manual_seed(len(CASES) + int(two_d) + int(weighted))
    table = torch.randn(40, 5, generator=g, dtype=dtype)
    if two_d:
        input, offsets = torch.randint(0, 40, (30, 4), generator=g), None
    else:
        input = torch.randint(0, 40, (90,), generator=g)
        offsets = torch.randint(0, 90, (25,), generator=g).sort().values
        offsets[0] = 0
        if empty:
            offsets[5:8] = offsets[5]          # bags of no ids
        if last:
            offsets = torch.cat([offsets, torch.tensor([90])])
    input[::7] = 3                             # repeats, and the padding id where given
    psw = torch.rand(input.shape, generator=g, dtype=dtype) if weighted else None
    unique, inverse = torch.unique(input, sorted=True, return_inverse=True)
    pad = None if padding is None else int(torch.searchsorted(unique, padding))
    flat = bags_of(input, offsets, psw, mode=mode, include_last_offset=last,
                   padding_idx=padding, dtype=dtype, label="test", name="t")
    grad_out = None
    results = []
    for ours in (True, False):
        rows = table[unique].clone().requires_grad_()
        if ours:
            out = bagrows.pool(rows, inverse.view(input.shape), unique, flat, offsets, mode,
                               psw, pad, last)
            assert type(out.grad_fn).__name__ == "_PoolBackward"     # its own backward
        else:
            out = F.embedding_bag(inverse.view(input.shape), rows, offsets, mode=mode,
                                  per_sample_weights=psw, padding_idx=pad,
                                  include_last_offset=last)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=g, dtype=dtype)
        out.backward(grad_out)
        results.append((out.detach(), rows.grad))
    (out, grad), (want_out, want_grad) = results
    assert torch.equal(out, want_out)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6 if dtype == torch.float32 else 1e-12,
                               atol=1e-6 if dtype == torch.float32 else 1e-12)


def test_max_and_weights_that_need_a_gradient_keep_torchs_backward():
    table = torch.randn(10, 3)
    input = torch.tensor([[1, 2], [2, 2]])
    unique, inverse = torch.unique(input, sorted=True, return_inverse=True)
    rows = table[unique].clone().requires_grad_()
    out = bagrows.pool(rows, inverse.view(input.shape), unique, None, None, "max", None, None,
                       False)
    assert out.grad_fn is not None and "EmbeddingBag" in type(out.grad_fn).__name__
    psw = torch.rand(2, 2, requires_grad=True)
    flat = bags_of(input, None, psw, mode="sum", include_last_offset=False, padding_idx=None,
                   dtype=torch.float32, label="test", name="t")
    out = bagrows.pool(rows, inverse.view(input.shape), unique, flat, None, "sum", psw, None,
                       False)
    out.sum().backward()
    assert psw.grad is not None and rows.grad is not None
