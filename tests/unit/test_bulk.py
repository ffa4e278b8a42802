"""One process: the bulk reads of version counters and gradients (mpisync/native/bulk.py) give
what torch's own accessors give, compiled or in Python, whatever the user did to the
tensors; and a machine without a C++ compiler falls back with a warning."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi_helpers import assert_init_refuses_switch

from mpisync.native import bulk
from mpisync.worker.tracking import TrackedParameter, WriteTracker

needs_compiled = pytest.mark.skipif(not bulk.available(),
                                    reason="no C++ compiler or torch headers here")


@pytest.fixture(params=["compiled", "python"])
def way(request, monkeypatch):
    """Each test twice: with the compiled reads and with the Python ones."""
    if request.param == "compiled" and not bulk.available():
        pytest.skip("no C++ compiler or torch headers here")
    if request.param == "python":
        monkeypatch.setattr(bulk, "_lib", None)
    return request.param


def params_of(n: int = 5) -> list[torch.nn.Parameter]:
    base = torch.arange(4.0 * n)
    return [torch.nn.Parameter(base[4 * i:4 * i + 4].clone()) for i in range(n)]


def test_versions_are_torchs_after_every_kind_of_write(way):
    ps = params_of()
    ps[4].__class__ = TrackedParameter          # its .data shares the counter
    reader = bulk.Versions([p.detach() for p in ps])
    assert reader.read()[0].tolist() == [p._version for p in ps]
    first, moved = reader.read()
    first = first.copy()
    assert moved == 0
    with torch.no_grad():
        ps[0].add_(1)
        ps[0].mul_(2)
        ps[1].detach().clamp_(0, 1)
    ps[2].data.zero_()                       # torch's own .data: no count (as torch)
    ps[4].data.zero_()
    torch._C.TensorBase.data.__set__(ps[3], torch.ones(4))   # p.data = x keeps the counter
    now, moved = reader.read()
    assert now.tolist() == [p._version for p in ps]
    assert (now != first).tolist() == [True, True, False, False, True] and moved == 3
    assert reader.read()[1] == 0
    before, _ = reader.read()
    before[2] = -1                          # the caller's mark counts as a difference
    assert reader.read()[1] == 1


def test_versions_follow_a_replaced_tensor(way):
    ps = params_of(3)
    reader = bulk.Versions([p.detach() for p in ps])
    other = torch.zeros(2)
    with torch.no_grad():
        for _ in range(7):
            other.add_(1)
    reader.replace(1, other)
    assert reader.read()[0].tolist() == [0, 7, 0]


def test_a_tensor_without_a_counter_raises_as_torch(way):
    with torch.inference_mode():
        t = torch.zeros(3)
    with pytest.raises(RuntimeError, match="Inference tensors do not track version counter"):
        bulk.Versions([torch.zeros(1), t]).read()


def with_views(ps):
    views = [torch.zeros_like(p) for p in ps]
    for p, v in zip(ps, views):
        p.grad = v
    return views


@pytest.mark.parametrize("change", ["none", "grad-none", "grad-other", "grad-data",
                                    "grad-same-values", "accumulate"])
def test_grads_in_place_is_torchs_answer(way, change):
    ps = params_of()
    views = with_views(ps)
    check = bulk.Grads(ps, views, plain=True)
    expected = True
    if change == "grad-none":
        ps[2].grad = None
        expected = False
    elif change == "grad-other":
        ps[4].grad = torch.zeros(4)
        expected = False
    elif change == "grad-data":
        ps[0].grad.data = torch.zeros(4)     # the view itself holds other memory
        expected = False
    elif change == "grad-same-values":
        ps[3].grad = views[3].clone()
        expected = False
    elif change == "accumulate":             # backward adds into the views: in place
        sum((p * p).sum() for p in ps).backward()
    assert check.in_place() is expected
    assert all(map(lambda p, v: p.grad is v, ps, views)) == (change in ("none", "accumulate",
                                                                         "grad-data"))


@pytest.mark.parametrize("change", ["t_", "data-t", "data-view"])
def test_a_gradient_seen_through_other_strides_or_shape_is_not_in_place(way, change):
    ps = [torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(4))]
    views = with_views(ps)
    check = bulk.Grads(ps, views, plain=True)
    assert check.in_place()
    if change == "t_":
        ps[0].grad.t_()                      # the same tensor and memory, other strides
    elif change == "data-t":
        ps[0].grad.data = ps[0].grad.data.t()
    else:
        ps[0].grad.data = ps[0].grad.data.view(9)
    assert ps[0].grad is views[0] and ps[0].grad.data_ptr() == views[0].data_ptr()
    assert not check.in_place()
    if change == "t_":
        ps[0].grad.t_()
        assert check.in_place()


def test_grads_of_a_class_that_overrides_torch_function_are_read_through_it(way):
    class Shown(torch.Tensor):          # a subclass whose .grad is read through torch's look-up
        pass

    ps = [torch.Tensor._make_subclass(Shown, torch.zeros(3), True) for _ in range(2)]
    views = with_views(ps)
    assert bulk.Grads(ps, views, plain=False).in_place()
    ps[1].grad = torch.ones(3)
    assert not bulk.Grads(ps, views, plain=False).in_place()


def test_a_read_parameter_cannot_be_swapped_from_under_the_reads():
    ps = params_of(2)
    check = bulk.Grads(ps, with_views(ps), plain=True)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(ps[0], torch.nn.Parameter(torch.zeros(4)))
    assert check.in_place()


def test_write_tracker_names_the_written_parameters(way):
    ps = params_of(4)
    tracker = WriteTracker([f"p{i}" for i in range(4)], ps, [p.detach() for p in ps], "w0")
    assert tracker.written() == []
    with torch.no_grad():
        ps[3].add_(1)
    ps[1].data.mul_(2)                        # a TrackedParameter now: counted
    assert tracker.written() == [1, 3]
    assert tracker.written() == []
    tracker.mark([2])
    assert tracker.written() == [2]
    assert tracker.written() == []
    tracker.release()


BUILD_IN_A_FRESH_PROCESS = (
    "import torch\nfrom mpisync.native import bulk\n"
    "print(bulk.available())\n"
    "p = torch.nn.Parameter(torch.zeros(2)); v = torch.zeros(2); p.grad = v\n"
    "print(bulk.Grads([p], [v], True).in_place(), bulk.Versions([p.detach()]).read()[0].tolist())\n")


def test_without_a_cxx_compiler_the_python_reads_step_in(tmp_path):
    """No C++ compiler (``CXX`` names none) or one that fails: not built, a warning says
    why, the reads run in Python; a built library is reused from the cache;
    ``MPISYNC_BULK=0`` builds nothing and says nothing."""
    env = dict(os.environ, MPISYNC_CACHE=str(tmp_path / "cache"), CXX=str(tmp_path / "no-cxx"))

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS],
                             env={**env, **extra}, capture_output=True, text=True, timeout=300,
                             check=False)
        assert out.returncode == 0, out.stderr
        return out

    out = run()
    assert out.stdout.split("\n")[:2] == ["False", "True [0]"], out.stdout
    assert "bulk reads (_bulk.cpp) could not be built" in out.stderr, out.stderr
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'error: out of licences' >&2\nexit 3\n")
    broken.chmod(0o755)
    out = run(CXX=str(broken))
    assert out.stdout.split("\n")[:2] == ["False", "True [0]"], out.stdout
    assert "exited with status 3: error: out of licences" in out.stderr, out.stderr
    assert not list((tmp_path / "cache").glob("*"))      # no half-built file left
    out = run(MPISYNC_BULK="0")
    assert out.stdout.split("\n")[:2] == ["False", "True [0]"] and "bulk" not in out.stderr
    if bulk.available():
        env["CXX"] = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        # the library this process loaded, from its own cache (where it was built from the
        # same source and flags): seeded into the fresh cache, it is found there, not built
        # again; where it came from no cache (built privately), the runs below build it once
        built = Path(bulk._library()._name)
        if built.parent.is_dir() and built.exists():
            (tmp_path / "cache").mkdir(exist_ok=True)
            shutil.copy2(built, tmp_path / "cache" / built.name)
        for _ in range(2):                   # loaded from the cache (built at most once)
            out = run()
            assert out.stdout.split("\n")[:2] == ["True", "True [0]"], out.stdout
        assert len(list((tmp_path / "cache").glob("bulk-*.so"))) == 1


# -- backward's own gradients copied into the buffers: Grads.adopt, Grads.clear -----------------
def adopter(n: int = 4, numel: int = 4):
    """``n`` parameters whose gradient buffer is one flat tensor, and a Grads over them."""
    flat = torch.zeros(n * numel)
    ps = [torch.nn.Parameter(torch.full((numel,), float(i))) for i in range(n)]
    views = [flat[i * numel:(i + 1) * numel] for i in range(n)]
    has = np.zeros(n, np.uint8)
    guard = (flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size())
    return ps, views, has, bulk.Grads(ps, views, True, has=has, guards=[guard]), flat


def test_adopt_copies_backwards_gradients_into_their_buffers():
    ps, views, has, grads, flat = adopter()
    if not grads.compiled or not bulk.available():
        pytest.skip("no compiled reads here")
    has[:] = [0, 1, 0, 1]
    ps[0].grad = views[0]                                # in place already
    views[0].fill_(7.0)
    sum((p * (i + 1)).sum() for i, p in enumerate(ps[1:3], 1)).backward()   # fresh: 1, 2
    versions = [v._version for v in views]
    assert ps[3].grad is None
    flat[12:] = 5.0                                      # p3's buffer: stale values
    assert grads.adopt()
    assert all(p.grad is v for p, v in zip(ps[:3], views)) and ps[3].grad is None
    assert flat.tolist() == [7.0] * 4 + [2.0] * 4 + [3.0] * 4 + [0.0] * 4
    assert has.tolist() == [1, 1, 1, 0]
    assert [v._version for v in views] != versions       # copies and the zeroing are writes
    assert grads.in_place() is False                     # (p3 has none)
    grads.clear()
    assert all(p.grad is None for p in ps)


@pytest.mark.parametrize("given", ["sparse", "double", "shape", "strided", "requires-grad",
                                   "another-buffer", "moved-view", "restrided-view",
                                   "dispatch-subclass", "conj-view"])
def test_adopt_leaves_what_it_does_not_take_untouched(given):
    ps, views, has, grads, flat = adopter()
    if not grads.compiled or not bulk.available():
        pytest.skip("no compiled reads here")
    ps[0].grad = torch.ones(4)                           # one it would take: not taken either
    if given == "sparse":
        ps[2].grad = torch.ones(4).to_sparse()
    elif given == "double":
        ps[2].data = ps[2].data.double()
        ps[2].grad = torch.ones(4, dtype=torch.float64)
    elif given == "shape":
        ps[2].data = torch.zeros(2, 2)
        ps[2].grad = torch.ones(2, 2)
    elif given == "strided":
        ps[2].grad = torch.ones(8)[::2]
    elif given == "requires-grad":
        ps[2].grad = torch.ones(4, requires_grad=True)
    elif given == "another-buffer":
        ps[2].grad = views[1]
    elif given == "moved-view":
        ps[2].grad = views[2]
        ps[2].grad.data = torch.ones(4)
    elif given == "restrided-view":             # its own memory, read through other strides
        ps = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(4)]
        views = [flat[4 * i:4 * i + 4].view(2, 2) for i in range(4)]
        grads = bulk.Grads(ps, views, True, has=has, guards=[(flat.data_ptr(),
                                                              flat.data_ptr() + 64)])
        ps[0].grad = torch.ones(2, 2)
        ps[2].grad = views[2]
        ps[2].grad.t_()
    elif given == "dispatch-subclass":          # its values are not its memory
        from torch.testing._internal.two_tensor import TwoTensor
        ps[2].grad = TwoTensor(torch.ones(4), torch.ones(4))
    elif given == "conj-view":
        ps = [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64)) for _ in range(3)]
        cflat = torch.zeros(6, dtype=torch.complex64)
        views = [cflat[2 * i:2 * i + 2] for i in range(3)]
        grads = bulk.Grads(ps, views, True, has=has,
                           guards=[(cflat.data_ptr(), cflat.data_ptr() + 48)])
        ps[0].grad = torch.ones(2, dtype=torch.complex64)
        ps[2].grad = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
        flat = cflat
    before = flat.clone()
    held = [p.grad for p in ps]
    assert not grads.adopt()
    assert torch.equal(flat, before) and has.tolist() == [0] * 4
    assert all(p.grad is g for p, g in zip(ps, held))


def test_adopt_takes_a_plain_subclass_by_its_memory():
    class Mine(torch.Tensor):
        pass

    ps, views, has, grads, flat = adopter(2)
    if not grads.compiled or not bulk.available():
        pytest.skip("no compiled reads here")
    ps[0].grad = torch.full((4,), 3.0).as_subclass(Mine)
    assert grads.adopt() and ps[0].grad is views[0] and ps[1].grad is None
    assert flat.tolist() == [3.0] * 4 + [0.0] * 4 and has.tolist() == [1, 0]


def test_clear_is_set_to_none():
    ps, views, _, grads, _ = adopter()
    for p, v in zip(ps, views):
        p.grad = v
    ps[1].grad = torch.ones(4)
    ps[2].grad = None
    assert grads.clear() == bulk.available()
    if bulk.available():
        assert all(p.grad is None for p in ps)


def test_init_refuses_a_malformed_switch_on_every_rank():
    """``mpisync.init()`` reads ``MPISYNC_BULK`` on every rank, so that a bad value ends
    every rank alike at once, not the workers alone when they build their channels."""
    assert_init_refuses_switch("MPISYNC_BULK")
