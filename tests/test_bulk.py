"""One process: the bulk reads of version counters and gradients (mpisync/bulk.py) give
what torch's own accessors give, compiled or in Python, whatever the user did to the
tensors; and a machine without a C++ compiler falls back with a warning."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from mpisync import bulk
from mpisync.tracking import TrackedParameter, WriteTracker

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
    "import torch\nfrom mpisync import bulk\n"
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
        env.pop("CXX")
        env["CXX"] = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        for _ in range(2):                   # built once, then loaded from the cache
            out = run()
            assert out.stdout.split("\n")[:2] == ["True", "True [0]"], out.stdout
        assert len(list((tmp_path / "cache").glob("bulk-*.so"))) == 1
