"""The ps rank's fused-region step is bitwise torch's per-parameter step (one process).

Each case lays parameters of odd sizes side by side in one buffer per dtype (as a ps rank
holds them), in two param groups whose members interleave, cut into buckets, and steps the
optimizer with ``mpisync.ps.fused.Applier`` bucket by bucket; beside it plain torch steps
the same optimizer over separate tensors. Gradients go missing for some parameters on some
steps (torch skips those: no state, no step count), a scheduler moves the learning rate,
and halfway the state goes through ``state_dict()``/``load_state_dict()``. Parameters and
every state value must be bitwise equal at every step.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpisync.ps.fused import ELEMENTWISE, Applier

O = torch.optim
CASES = [
    (O.SGD, {"lr": 0.1}),
    (O.SGD, {"lr": 0.1, "momentum": 0.9}),
    (O.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (O.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "maximize": True, "foreach": True}),
    (O.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
    (O.Adam, {"lr": 0.01}),
    (O.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    (O.Adam, {"lr": 0.01, "foreach": True, "capturable": False, "differentiable": False}),
    (O.Adam, {"lr": 0.01, "amsgrad": True, "fused": True}),
    (O.AdamW, {"lr": 0.01, "amsgrad": True}),
    (O.AdamW, {"lr": 0.01, "foreach": True, "weight_decay": 0.05}),
    (O.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.1}),
    (O.Adagrad, {"lr": 0.1, "foreach": True, "maximize": True}),
    (O.Adagrad, {"lr": 0.1, "fused": True}),
    (O.RMSprop, {"lr": 0.01}),
    (O.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1}),
    (O.RMSprop, {"lr": 0.01, "momentum": 0.5, "foreach": True, "maximize": True}),
    (O.Adadelta, {"weight_decay": 0.1}),
    (O.Adadelta, {"foreach": True, "maximize": True}),
    (O.Adamax, {"weight_decay": 0.1}),
    (O.Adamax, {"foreach": True}),
    (O.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (O.NAdam, {"foreach": True, "momentum_decay": 0.005}),
    (O.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (O.RAdam, {"foreach": True}),
    (O.ASGD, {"weight_decay": 0.1, "t0": 2}),
    (O.ASGD, {"foreach": True}),
    (O.Rprop, {"maximize": True}),
    (O.Rprop, {"foreach": True, "etas": (0.4, 1.3)}),
]
SIZES = [7, 1, 33, 64, 5, 129, 16, 3, 257, 2, 31, 90]
STEPS = 8


def layout(dtypes):
    """Flat regions per dtype and each parameter's place, as a ps rank lays them out."""
    counts = {d: 0 for d in dtypes}
    places = []
    for n, d in zip(SIZES, dtypes):
        places.append((d, counts[d], counts[d] + n))
        counts[d] += n
    order = list(counts)
    regions = [torch.zeros(counts[d], dtype=d) for d in order]
    grad_regions = [torch.zeros(counts[d], dtype=d) for d in order]
    places = [(order.index(d), a, b) for d, a, b in places]
    return regions, grad_regions, places


def build(cls, kw, dtypes, seed=0):
    """(applier, ps optimizer, reference params, reference optimizer)."""
    g = torch.Generator().manual_seed(seed)
    regions, grad_regions, places = layout(dtypes)
    params, grads = [], []
    for r, a, b in places:
        regions[r][a:b] = torch.randn(b - a, generator=g, dtype=regions[r].dtype)
        params.append(torch.nn.Parameter(regions[r][a:b]))
        grads.append(grad_regions[r][a:b])
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    groups = lambda ps: [{"params": ps[:5] + ps[9:]},
                         {"params": ps[5:9], "lr": kw.get("lr", 1.0) * 0.5}]  # in between
    opt, ref_opt = cls(groups(params), **kw), cls(groups(ref), **kw)
    buckets = [range(3), range(3, 7), range(7, len(SIZES))]
    # buckets in layout order; parameter i of one region must be followed by i+1
    applier = Applier(opt, params, grads, places, regions, grad_regions, buckets)
    return applier, opt, params, grads, ref, ref_opt


def step_both(applier, opt, params, grads, ref, ref_opt, t, gen):
    # parameters 3 and 8 miss steps 2 and 3 (10 misses step 5): they part from the rest
    present = np.array([not ((t in (2, 3) and i in (3, 8)) or (t == 5 and i == 10))
                        for i in range(len(params))])
    for i, (p, r) in enumerate(zip(grads, ref)):
        if present[i]:
            values = torch.randn(p.numel(), generator=gen, dtype=p.dtype)
            p.copy_(values)
            r.grad = values.clone()
        else:
            p.fill_(float("nan"))              # never read: torch skips the parameter
            r.grad = None
    applier.begin(present)
    for k in range(len(applier.buckets)):
        applier.apply(k)
    if applier.steps_whole:
        opt.step()
    applier.end()
    ref_opt.step()


def assert_same(opt, params, ref, ref_opt):
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r.detach()), (p - r).abs().max()
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for i, st in theirs["state"].items():
        assert mine["state"][i].keys() == st.keys(), i
        for key, v in st.items():
            m = mine["state"][i][key]
            assert m.shape == v.shape and m.dtype == v.dtype, (i, key)
            assert torch.equal(m, v), (i, key)


@pytest.mark.parametrize("cls,kw", CASES, ids=[f"{c.__name__}-{'-'.join(map(str, k))}"
                                               for c, k in CASES])
def test_fused_region_step_is_torch_per_parameter_step(cls, kw):
    dtypes = [torch.float32] * 6 + [torch.float64] * 2 + [torch.float32] * 4
    applier, opt, params, grads, ref, ref_opt = build(cls, kw, dtypes)
    expected = "whole" if kw.get("fused") else "fused"
    assert applier.mode == expected
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 3, 0.5)
    gen = torch.Generator().manual_seed(1)
    for t in range(STEPS):
        step_both(applier, opt, params, grads, ref, ref_opt, t, gen)
        sched.step()
        ref_sched.step()
        assert_same(opt, params, ref, ref_opt)
        if t == STEPS // 2:      # both through torch's schema, as from a checkpoint
            saved = copy.deepcopy(ref_opt.state_dict())
            opt.load_state_dict(copy.deepcopy(saved))
            ref_opt.load_state_dict(saved)
            applier.sync()
    if expected == "fused":
        # some parameters skipped steps: several runs, yet at least one of many members
        runs = [run for runs in applier.runs for run in runs]
        assert any(run.stop - run.first > 1 for run in runs)


def test_every_elementwise_optimizer_is_covered():
    assert {c for c, _ in CASES} == set(ELEMENTWISE)


def test_state_lives_in_arenas_and_keeps_torchs_schema():
    """After a step, a parameter's state is a view of the run's arena; state_dict() has
    one entry per parameter with its own shape, as torch's."""
    applier, opt, params, grads, ref, ref_opt = build(O.Adam, {"lr": 0.01},
                                                      [torch.float32] * len(SIZES))
    gen = torch.Generator().manual_seed(1)
    step_both(applier, opt, params, grads, ref, ref_opt, 0, gen)
    arena = applier.arenas[("exp_avg", 0, torch.float32)]
    for p in params:
        v = opt.state[p]["exp_avg"]
        assert v.shape == p.shape
        assert arena.data_ptr() <= v.data_ptr() < arena.data_ptr() + arena.numel() * 4
    assert len(opt.state_dict()["state"]) == len(params)


def test_whole_tensor_and_unknown_optimizers_step_once_over_everything():
    class Mine(torch.optim.SGD):      # a subclass may look at several tensors at once
        pass
    for cls in (Mine, torch.optim.Adafactor):
        applier = build(cls, {"lr": 0.01}, [torch.float32] * len(SIZES))[0]
        assert applier.mode == "whole" and applier.steps_whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_dense_reduce_is_torchs_reduce_bitwise(dtype):
    """The ps's one-pass reduce (``kernels.dense_mean``) gives the accumulator's mean or sum
    bit for bit, subnormals, overflow and NaN included, and says whether it is finite."""
    from mpisync.accumulate import ShardAccumulator
    from mpisync.native import kernels
    if not kernels.available(torch.zeros(1, dtype=dtype)):
        pytest.skip("no C compiler: the ps reduces with torch")
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(3)
    edge = [[info.tiny / 3, info.max, -info.max, info.tiny * 1.5],
            [info.tiny / 5, info.max, info.max, -info.tiny]]
    for k in (1, 2, 3, 4):
        for how in ("mean", "sum"):
            if how == "mean" and k & (k - 1):
                continue               # not a power of two: the ps reduces with torch
            grads = [torch.randn(4099, generator=gen, dtype=dtype)
                     * 10.0 ** torch.randint(-30, 30, (4099,), generator=gen).to(dtype)
                     for _ in range(k)]
            for g, e in zip(grads, edge):
                g[:4] = torch.tensor(e, dtype=dtype)
            for nan in (False, True):
                if nan:
                    grads[-1][100] = float("nan")
                ref, out = torch.zeros(4099, dtype=dtype), torch.full((4099,), 7.0, dtype=dtype)
                ShardAccumulator(how).reduce([ref], [[g] for g in grads], k)
                finite = kernels.dense_mean(out, grads, how == "mean" and k > 1)
                assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), (k, how, nan)
                assert finite == bool(torch.isfinite(ref).all()) and (k == 1 or not finite)


SGD, ADAM, ADAMW, ADAGRAD, RMSPROP = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                                      torch.optim.Adagrad, torch.optim.RMSprop)
COMPILED_CASES = [
    (SGD, {"lr": 0.1}, True), (SGD, {"lr": 0.1, "momentum": 0.9}, True),
    (SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}, True),
    (SGD, {"lr": 0.1, "weight_decay": 0.01, "foreach": True}, True),
    (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, False),
    (SGD, {"lr": 0.1, "maximize": True}, False),
    (SGD, {"lr": torch.tensor(0.1)}, False),
    (ADAM, {"lr": 0.01}, True), (ADAM, {"lr": 0.01, "weight_decay": 0.1}, True),
    (ADAM, {"lr": 0.01, "betas": (0.3, 0.5), "eps": 0.1}, True),     # lerp's other branch
    (ADAM, {"lr": 0.01, "weight_decay": 0.1, "foreach": True}, True),
    (ADAM, {"lr": 1, "betas": (0.0, 0.0), "eps": 1, "weight_decay": 1}, True),   # ints
    (ADAMW, {"lr": 0.01}, True),
    (ADAMW, {"lr": 0.01, "weight_decay": 0.5, "betas": (0.2, 0.9)}, True),
    (ADAGRAD, {"lr": 0.1}, True),
    (ADAGRAD, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "eps": 0.01,
               "initial_accumulator_value": 0.5}, True),
    (ADAGRAD, {"lr": 0.1, "weight_decay": 0.1, "foreach": True}, True),
    (ADAGRAD, {"lr": 0.1, "maximize": True}, False),
    (RMSPROP, {"lr": 0.01}, True), (RMSPROP, {"lr": 0.01, "momentum": 0.9}, True),
    (RMSPROP, {"lr": 0.01, "centered": True, "alpha": 0.3}, True),      # lerp's other branch
    (RMSPROP, {"lr": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.1}, True),
    (RMSPROP, {"lr": 0.01, "weight_decay": 0.1, "eps": 0.1, "foreach": True}, True),
    (RMSPROP, {"lr": 0.01, "centered": True, "momentum": 0.9, "foreach": True}, True),
    (RMSPROP, {"lr": 0.01, "centered": True, "foreach": False}, True),
    (RMSPROP, {"lr": 1, "alpha": 0, "eps": 1, "momentum": 1, "weight_decay": 1}, True),  # ints
    (RMSPROP, {"lr": 0.01, "maximize": True}, False),
    (RMSPROP, {"lr": 0.01, "momentum": np.float64(0.9)}, False),
    (ADAM, {"lr": 0.01, "amsgrad": True}, False),
    (ADAM, {"lr": 0.01, "maximize": True}, False),
    (ADAMW, {"lr": torch.tensor(0.01)}, False)]


def _exact(cls):
    """The ps's check of ``cls``'s compiled step against torch's."""
    from mpisync.native import kernels
    return {SGD: kernels.sgd_exact, ADAGRAD: kernels.adagrad_exact,
            RMSPROP: kernels.rmsprop_exact}.get(cls, kernels.adam_exact)


def _scheduler(opt):
    """StepLR for SGD; OneCycleLR for Adam, which moves beta1 (and lr) every step, and for
    RMSprop with a float momentum, which it moves."""
    group = opt.param_groups[0]
    cycled = isinstance(opt, torch.optim.Adam) or isinstance(opt, RMSPROP) and \
        type(group["momentum"]) is float and group["momentum"] > 0
    if cycled and not torch.is_tensor(group["lr"]):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1)
    return torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)


@pytest.mark.filterwarnings("ignore:Detected call of")     # the fused steps skip opt.step()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls,kw,fuses", COMPILED_CASES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(COMPILED_CASES)])
def test_compiled_step_in_the_reduce_is_torchs_step_bitwise(dtype, cls, kw, fuses):
    """For SGD, Adam, AdamW, Adagrad and RMSprop the ps steps a bucket in the reduce's pass
    (``Applier.compiled_step``: ``kernels.dense_sgd``, ``dense_adam``, ``dense_adagrad``,
    ``dense_rmsprop``): the parameters and the optimizer's state are torch's per-parameter
    step after the mean of two workers' gradients, bit for bit, with a scheduler, two
    groups and parameters that miss steps; the settings it does not fuse step as before."""
    from mpisync.native import kernels
    if not kernels.available(torch.zeros(1, dtype=dtype)):
        pytest.skip("no C compiler: the ps reduces and steps with torch")
    applier, opt, params, _, ref, ref_opt = build(cls, kw, [dtype] * len(SIZES))
    # where torch's CPU kernels round differently (no fused multiply-add), the ps's check
    # refuses the kernel, and every step is torch's
    fuses = fuses and _exact(cls)(dtype, opt.param_groups[0])
    region = applier.grad_regions[0]
    workers = [torch.zeros_like(region) for _ in range(2)]
    sched, ref_sched = _scheduler(opt), _scheduler(ref_opt)
    gen = torch.Generator().manual_seed(5)
    fused = 0
    for t in range(STEPS):
        present = np.array([not (t in (2, 3) and i == 4) for i in range(len(params))])
        for i, r in enumerate(ref):
            a, b = int(applier.lo[i]), int(applier.hi[i])
            for w in workers:
                w[a:b] = torch.randn(b - a, generator=gen, dtype=dtype) * 10.0 ** (t % 3) \
                    if present[i] else 0.0
            r.grad = (workers[0][a:b] + workers[1][a:b]) * 0.5 if present[i] else None
        applier.begin(present)
        for k, members in enumerate(applier.buckets):
            a, b = int(applier.lo[members.start]), int(applier.hi[members.stop - 1])
            out, ins = region[a:b], [w[a:b] for w in workers]
            step = applier.compiled_step(k, out)
            if step is None:
                assert kernels.dense_mean(out, ins, True)
                applier.apply(k)
            else:
                assert step(ins)
                fused += 1
        if applier.steps_whole:
            opt.step()
        applier.end()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        assert_same(opt, params, ref, ref_opt)
    # torch makes the state on the first step; a bucket missing a parameter (steps 2 and
    # 3) is not covered by its runs, nor, for Adam, is one whose parameters' step counts
    # parted then (the run splits, and the next steps fuse again)
    assert fused >= (len(applier.buckets) * (STEPS - 3) - 2 if fuses else 0)
    assert fuses or fused == 0


@pytest.mark.parametrize("cls", [ADAM, ADAGRAD, RMSPROP], ids=["Adam", "Adagrad", "RMSprop"])
def test_compiled_step_leaves_to_torch_a_step_count_foreach_refuses(cls):
    """torch's multi-tensor Adam, Adagrad and RMSprop (``foreach=True``) refuse a ``step``
    count that is not a float32 or float64 tensor (an int one, from a state saved
    elsewhere): the ps keeps to torch's step, which raises as torch does; the single-tensor
    step takes any count."""
    from mpisync.native import kernels
    for foreach in (True, None):
        applier, opt, params, grads, ref, ref_opt = build(
            cls, {"lr": 0.01, "foreach": foreach}, [torch.float32] * len(SIZES))
        step_both(applier, opt, params, grads, ref, ref_opt, 0, torch.Generator().manual_seed(1))
        for st in opt.state.values():
            st["step"] = st["step"].to(torch.int64)
        applier.sync()
        applier.begin(np.ones(len(SIZES), bool))
        out = applier.grad_regions[0][:int(applier.hi[2])]
        step = applier.compiled_step(0, out)
        if foreach:
            assert step is None
            with pytest.raises(RuntimeError, match="float32/64"):
                applier.apply(0)
        elif kernels.available(out) and _exact(cls)(torch.float32, opt.param_groups[0]):
            assert step is not None


def test_loaded_state_torch_cannot_step_in_place_raises_as_torch():
    """A loaded Adagrad ``sum`` whose elements share memory (expanded from one value):
    torch's in-place step refuses it; the ps does not copy it whole into its arenas (nor
    step it in the reduce) but keeps to torch's step, which raises."""
    applier, opt, _, _, ref, ref_opt = build(ADAGRAD, {"lr": 0.1}, [torch.float32] * len(SIZES))
    for o in (opt, ref_opt):
        sd = o.state_dict()
        for st in sd["state"].values():
            st["sum"] = torch.full((1,), 0.5).expand_as(st["sum"])
        o.load_state_dict(sd)
    applier.sync()
    applier.begin(np.ones(len(SIZES), bool))
    assert applier.compiled_step(0, applier.grad_regions[0][:int(applier.hi[2])]) is None
    for r in ref:
        r.grad = torch.ones_like(r)
    for o in (opt, ref_opt):
        with pytest.raises(RuntimeError, match="single memory location"):
            o.step()


def test_loaded_state_shared_by_parameters_steps_as_torch():
    """A loaded Adagrad ``sum`` that is a view of another parameter's (state saved so):
    torch's step adds both parameters' squares into the memory they share; the ps keeps to
    torch's step, bitwise, instead of parting them into arenas of their own."""
    applier, opt, params, grads, ref, ref_opt = build(
        ADAGRAD, {"lr": 0.1, "lr_decay": 0.01}, [torch.float32] * len(SIZES))
    for o in (opt, ref_opt):
        sd = o.state_dict()
        sd["state"][0]["sum"] = sd["state"][2]["sum"][5:12]        # 7 of parameter 2's 33
        o.load_state_dict(sd)
    applier.sync()
    gen = torch.Generator().manual_seed(3)
    for t in range(3):
        step_both(applier, opt, params, grads, ref, ref_opt, t, gen)
        assert_same(opt, params, ref, ref_opt)
    assert opt.state[params[0]]["sum"].data_ptr() == opt.state[params[2]]["sum"][5:].data_ptr()


def test_compiled_sgd_steps_aside_for_step_hooks():
    """A hook on the optimizer's step runs: such a step goes through ``optimizer.step()``."""
    applier, opt, *_ = build(torch.optim.SGD, {"lr": 0.1}, [torch.float32] * len(SIZES))
    applier.begin(np.ones(len(SIZES), bool))
    out = applier.grad_regions[0][:int(applier.hi[2])]
    assert applier.compiled_step(0, out) is not None
    handle = opt.register_step_post_hook(lambda *a: None)
    assert applier.compiled_step(0, out) is None
    handle.remove()
    assert applier.compiled_step(0, out) is not None


def test_compiled_sgd_keeps_the_means_only_where_one_is_not_finite():
    """SGD's compiled step does not write the bucket's means (nothing reads them after the
    step; its parameters are torch's step bitwise: the test above); where one is NaN or Inf
    it writes them all, for the error that names the parameters, and says so."""
    from mpisync.native import kernels
    if not kernels.available(torch.zeros(1)):
        pytest.skip("no C compiler: the ps reduces and steps with torch")
    applier, _, params, *_ = build(torch.optim.SGD, {"lr": 0.1}, [torch.float32] * len(SIZES))
    applier.begin(np.ones(len(SIZES), bool))
    out = applier.grad_regions[0][:int(applier.hi[2])]
    gen = torch.Generator().manual_seed(3)
    ins = [torch.randn(out.numel(), generator=gen) for _ in range(2)]
    mean = (ins[0] + ins[1]) * 0.5
    out.fill_(7.0)
    before = [p.detach().clone() for p in params[:3]]
    assert applier.compiled_step(0, out)(ins)
    assert torch.equal(out, torch.full_like(out, 7.0))        # not written
    assert not any(torch.equal(p.detach(), b) for p, b in zip(params, before))   # stepped
    ins[1][5] = float("nan")
    assert not applier.compiled_step(0, out)(ins)
    assert torch.isnan(out[5]) and torch.equal(out[:5], mean[:5]) and \
        torch.equal(out[6:], mean[6:])


def test_compiled_sgd_is_torchs_step_where_torch_rounds_otherwise():
    """On torch's plain C++ kernels (``ATEN_CPU_CAPABILITY=default``, as on a processor
    without AVX2) ``add_(x, alpha=a)`` rounds twice: the ps's check must see that (its
    probe's products are the size of what they are added to) and the steps stay torch's."""
    from mpisync.native import kernels
    if os.environ.get("ATEN_CPU_CAPABILITY") or not kernels.available(torch.zeros(1)):
        pytest.skip("already on one capability, or no C compiler")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", "compiled_step_in_the_reduce"],
                         check=False, env=dict(os.environ, ATEN_CPU_CAPABILITY="default"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b62 passed", run.stdout), run.stdout[-2000:]


def test_compiled_sgd_leaves_to_torch_what_torch_converts_otherwise():
    """Hyper-parameters torch refuses for float32 (beyond its range) or rounds once where
    ctypes would round twice (ints beyond 2**53): the ps keeps to torch's step."""
    from mpisync.native import kernels
    group = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
             "nesterov": False, "maximize": False}
    assert kernels.sgd_settings(group, torch.float32) is not None
    for key, value in (("lr", 1e300), ("lr", 3.4028236e38), ("weight_decay", 1e300),
                       ("dampening", -1e39), ("lr", 2 ** 60 + 2 ** 36 + 1),
                       ("momentum", 2 ** 60 + 2 ** 36 + 1)):
        assert kernels.sgd_settings({**group, key: value}, torch.float32) is None, (key, value)
    assert kernels.sgd_settings({**group, "lr": 1e300}, torch.float64) is not None
    assert kernels.sgd_settings({**group, "lr": float("inf")}, torch.float32) is not None


def test_compiled_rmsprop_leaves_to_torch_what_it_does_not_do():
    """RMSprop's settings: refused where the kernel does not do what the group asks, where
    a hyper-parameter is not a plain number, is an int beyond 2**53 or lies beyond
    float32's range; taken otherwise, ints and infinities included."""
    from mpisync.native import kernels
    group = torch.optim.RMSprop([torch.zeros(1)], lr=0.01, momentum=0.9).param_groups[0]
    assert kernels.rmsprop_settings(group, torch.float32) is not None
    for key, value in (("maximize", True), ("capturable", True), ("differentiable", True),
                       ("lr", torch.tensor(0.01)), ("alpha", np.float64(0.9)),
                       ("momentum", np.float32(0.9)), ("eps", 1e39), ("lr", 1e300),
                       ("weight_decay", -1e300), ("alpha", 2 ** 60 + 2 ** 36 + 1),
                       ("momentum", 2 ** 60 + 2 ** 36 + 1)):
        assert kernels.rmsprop_settings({**group, key: value}, torch.float32) is None, key
    for key, value in (("lr", 1), ("alpha", 0), ("eps", float("inf")), ("momentum", -1)):
        assert kernels.rmsprop_settings({**group, key: value}, torch.float32) is not None
    assert kernels.rmsprop_settings({**group, "eps": 1e39}, torch.float64) is not None
