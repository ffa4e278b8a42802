"""The dense kernels: the ps's reduce of a dense step, and torch optimizers' steps in it.

``dense_mean`` is the dense step's reduce on the ps (``ps/parameters.py``): the taken gradients'
sum and, for a power-of-two count, mean in one pass, which also tells whether they are
finite (the ``nonfinite="raise"`` check), bitwise torch's add and multiply. ``dense_sgd``,
``dense_adam``, ``dense_adagrad`` and ``dense_rmsprop`` step torch.optim's SGD, Adam
(AdamW), Adagrad and RMSprop in the same pass (``ps/fused.py``); ``*_exact`` checks, once
per machine, dtype and kind of param group, that a kernel steps bitwise as torch does. The
library is loaded by ``rowslib``; where ``available()`` is False the callers use torch.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import torch

from . import torchstep
from .rowslib import address as _ptr
from .rowslib import function as _fn

__all__ = [
    "adagrad_exact",
    "adagrad_settings",
    "adam_exact",
    "adam_settings",
    "dense_adagrad",
    "dense_adam",
    "dense_mean",
    "dense_rmsprop",
    "dense_sgd",
    "rmsprop_exact",
    "rmsprop_keys",
    "rmsprop_settings",
    "sgd_exact",
    "sgd_settings",
]


def _ptrs(grads: list[torch.Tensor], at: int):
    """The gradients' addresses, each ``at`` bytes in, as a C array of pointers."""
    return (ctypes.c_void_p * len(grads))(*[g.data_ptr() + at for g in grads])


def _small_weight(w: float, dtype: torch.dtype) -> bool:
    """torch's ``lerp`` test on its weight ``w`` as the kernel holds it (in ``dtype``):
    ``|w| < 0.5``, the branch that adds to the start rather than to the end."""
    held = ctypes.c_float(w).value if dtype == torch.float32 else float(w)
    return abs(held) < 0.5


def dense_mean(out: torch.Tensor, grads: list[torch.Tensor], scale: bool) -> bool:
    """``out`` = the sum of ``grads`` in order (contiguous, of ``out``'s dtype and size),
    times ``1 / len(grads)`` where ``scale`` (a power of two only: bitwise the mean);
    in one pass for two gradients. Returns whether every element of ``out`` is finite."""
    ptrs = _ptrs(grads, 0)
    return bool(_fn("dense_mean", out.dtype)(out.numel(), ptrs, len(grads), int(scale),
                                             1.0 / len(grads), out.data_ptr()))


def dense_sgd(out: torch.Tensor, grads: list[torch.Tensor], runs, store: bool = True) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.SGD's step of the parameters with it. ``runs``: ``(offset,
    param, momentum buffer or None, settings)`` covering ``out``, each ``param`` (and
    buffer) contiguous, of ``out``'s dtype, for ``out[offset:offset + param.numel()]``;
    settings as ``sgd_settings`` gives them for that dtype. Without ``store`` the means
    are not written (``out`` is scratch then, its values undefined). Returns whether every
    mean is finite (the parameters are stepped either way)."""
    fn = _fn("dense_sgd", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, buf, settings in runs:
        at = offset * size
        ptrs = _ptrs(grads, at)
        finite &= bool(fn(param.numel(), ptrs, len(grads), 1.0 / len(grads),
                          out.data_ptr() + at, int(store), param.data_ptr(), _ptr(buf),
                          *settings))
    return finite


def sgd_settings(group: dict, dtype: torch.dtype = torch.float32) -> tuple | None:
    """A torch.optim.SGD param group's settings as ``dense_sgd`` takes them for parameters
    of ``dtype``: (-lr, whether weight decay, weight decay, momentum, 1 - dampening). None
    where the kernel does not do what the group asks (``nesterov``, ``maximize``,
    ``fused``, ``differentiable``, ``capturable``), where a hyper-parameter is not a plain
    number (a tensor learning rate), where torch would convert one differently (an int
    beyond 2**53, which ctypes rounds twice) or refuse it (a learning rate, weight decay or
    ``1 - dampening`` beyond the dtype's range: torch raises, the ps keeps to torch)."""
    values = [group.get(k) for k in ("lr", "momentum", "dampening", "weight_decay")]
    if any(type(v) not in (float, int) for v in values) or any(group.get(k) for k in (
            "nesterov", "maximize", "fused", "differentiable", "capturable")):
        return None
    lr, mom, damp, wd = values
    alphas = (-lr, wd, 1 - damp)           # what torch converts with a range check
    top = torch.finfo(dtype).max
    if any(type(v) is int and abs(v) > 2 ** 53 for v in (*alphas, mom)) or \
            any(math.isfinite(v) and abs(v) > top for v in alphas):
        return None
    return -lr, int(wd != 0), wd, mom, 1 - damp


#: the compiled steps' checks against torch: (kernel, dtype, kind of group) -> bitwise
_EXACT: dict[tuple, bool] = {}


def _checked(kind: tuple, probe: Callable[[], bool]) -> bool:
    """``probe()``, once per ``kind`` (its kernel, dtype and kind of group)."""
    known = _EXACT.get(kind)
    if known is None:
        known = _EXACT[kind] = probe()
    return known


def sgd_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_sgd`` steps bitwise as torch.optim.SGD does on this machine, for a
    group with these options (False where ``sgd_settings`` refuses it; checked once per
    dtype and kind of group, on a probe of odd length: the vectorized body and the tail
    alike). Torch rounds ``add_(x, alpha=a)`` as one fused multiply-add; a build that does
    not would fail here, and the ps keeps to torch's step."""
    if sgd_settings(group, dtype) is None:
        return False
    kind = ("sgd", dtype, group["momentum"] != 0, group["dampening"] != 0,
            group["weight_decay"] != 0, group.get("foreach"))
    return _checked(kind, lambda: _sgd_probe(*kind[1:]))


def _sgd_probe(dtype: torch.dtype, momentum: bool, dampening: bool, decay: bool,
               foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(7)
    n = 4099
    # every product about the size of what it is added to, so that rounding it apart from
    # the sum (two roundings instead of one) changes hundreds of elements
    opts = {"lr": 0.7, "momentum": 0.9 if momentum else 0.0,
            "dampening": 0.3 if dampening else 0.0, "weight_decay": 0.3 if decay else 0.0,
            "foreach": foreach}
    start = torch.randn(n, generator=gen, dtype=dtype)
    first = torch.randn(n, generator=gen, dtype=dtype)
    grads = [torch.randn(n, generator=gen, dtype=dtype) for _ in range(2)]
    param = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([param], **opts)
    param.grad = first
    torchstep.step(opt)                     # the momentum buffer made
    buf = opt.state[param].get("momentum_buffer")
    mine_p = param.detach().clone()
    mine_buf = None if buf is None else buf.clone()
    param.grad = (grads[0] + grads[1]) * 0.5
    torchstep.step(opt)
    out = torch.empty(n, dtype=dtype)
    dense_sgd(out, grads, [(0, mine_p, mine_buf, sgd_settings(opt.param_groups[0], dtype))])
    return torch.equal(out, param.grad) and torch.equal(mine_p, param.detach()) and (
        buf is None or torch.equal(mine_buf, opt.state[param]["momentum_buffer"]))


def dense_adam(out: torch.Tensor, grads: list[torch.Tensor], runs, scratch: torch.Tensor) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.Adam's (or AdamW's) step of the moments with it; then
    torch's square root of the second moments into ``scratch`` (as long as the longest
    run, of ``out``'s dtype) and a second pass that steps the parameters. ``runs``:
    ``(offset, param, exp_avg, exp_avg_sq, settings)`` covering ``out``, each tensor
    contiguous, of ``out``'s dtype, for ``out[offset:offset + param.numel()]``; settings
    as ``adam_settings`` gives them for the step. The ``step`` counts are the caller's.
    Returns whether every element of ``out`` is finite (the parameters are stepped either
    way)."""
    moments, update = _fn("adam_moments", out.dtype), _fn("adam_update", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, exp_avg, exp_avg_sq, settings in runs:
        at, n = offset * size, param.numel()
        ptrs = _ptrs(grads, at)
        finite &= bool(moments(n, ptrs, len(grads), 1.0 / len(grads), out.data_ptr() + at,
                               param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                               *settings[:8]))
        root = scratch[:n]
        torch.sqrt(exp_avg_sq.view(-1), out=root)
        update(n, param.data_ptr(), exp_avg.data_ptr(), root.data_ptr(), *settings[8:])
    return finite


_ADAM_OFF = ("amsgrad", "maximize", "fused", "differentiable", "capturable")


def adam_settings(group: dict, dtype: torch.dtype, step: float) -> tuple | None:
    """A torch.optim.Adam or AdamW param group's settings as ``dense_adam`` takes them for
    parameters of ``dtype`` at ``step`` (the count after this step's increment), computed
    as torch computes them (the bias corrections in Python's floats): (whether weight
    decay, weight decay, whether decoupled, 1 - lr * weight decay, whether ``|1 - beta1|``
    < 0.5 in ``dtype``, 1 - beta1, beta2, 1 - beta2, sqrt of the second bias correction,
    eps, -step size). None where the kernel does not do what the group asks (``amsgrad``,
    ``maximize``, ``fused``, ``differentiable``, ``capturable``), where a hyper-parameter
    is not a plain number (a tensor learning rate or beta), where torch would convert one
    differently (an int beyond 2**53) or refuse it (a value beyond the dtype's range, a
    bias correction of zero), or where Python's arithmetic leaves the reals. The first
    eight are ``adam_moments``'s, the last three ``adam_update``'s."""
    betas = group.get("betas")
    if type(betas) not in (tuple, list) or len(betas) != 2 or any(group.get(k) for k in _ADAM_OFF):
        return None
    lr, eps, wd = group.get("lr"), group.get("eps"), group.get("weight_decay")
    beta1, beta2 = betas
    if any(type(v) not in (float, int) for v in (lr, eps, wd, beta1, beta2)):
        return None
    decoupled = bool(group.get("decoupled_weight_decay", False))
    try:                                      # torch's own arithmetic, in its order
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        keep = 1 - lr * wd
    except (ZeroDivisionError, OverflowError):
        return None
    w1 = 1 - beta1
    values = (wd, keep, w1, beta2, 1 - beta2, bias_correction2_sqrt, eps, -step_size)
    top = torch.finfo(dtype).max
    if any(type(v) not in (float, int) for v in values) or \
            any(type(v) is int and abs(v) > 2 ** 53 for v in values) or \
            any(math.isfinite(v) and abs(v) > top for v in values):
        return None
    small = _small_weight(w1, dtype)
    return (int(wd != 0 and not decoupled), wd, int(wd != 0 and decoupled), keep, int(small),
            *values[2:])


def adam_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_adam`` steps bitwise as torch.optim.Adam (AdamW) does on this
    machine for a group with these options (False where ``adam_settings`` refuses it at
    step 1; checked once per dtype and kind of group on a probe of odd length, the
    vectorized body and the tail alike, with hyper-parameters that make every rounding
    show: each product about the size of what it is added to)."""
    if adam_settings(group, dtype, 1.0) is None:
        return False
    decoupled = bool(group.get("decoupled_weight_decay", False))
    small = _small_weight(1 - group["betas"][0], dtype)
    kind = ("adam", dtype, decoupled, group["weight_decay"] != 0, small, group.get("foreach"))
    return _checked(kind, lambda: _adam_probe(*kind[1:]))


def _adam_probe(dtype: torch.dtype, decoupled: bool, decay: bool, small: bool,
                foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(11)
    n = 4099
    opts = {"lr": 0.7, "betas": (0.6 if small else 0.2, 0.3), "eps": 0.3,
            "weight_decay": 0.3 if decay else 0.0, "foreach": foreach,
            "decoupled_weight_decay": decoupled}
    param = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = torch.optim.Adam([param], **opts)
    for _ in range(2):                      # the moments made, the bias corrections not 0
        param.grad = torch.randn(n, generator=gen, dtype=dtype)
        torchstep.step(opt)
    return _probe_step(opt, param, ("exp_avg", "exp_avg_sq"), adam_settings, dense_adam, gen)


def dense_adagrad(out: torch.Tensor, grads: list[torch.Tensor], runs, scratch: torch.Tensor
                  ) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.Adagrad's update of the squared sums with it; then torch's
    square root of the sums into ``scratch`` (as long as the longest run, of ``out``'s
    dtype) and a second pass that steps the parameters. ``runs``: ``(offset, param, sum,
    settings)`` covering ``out`` (each tensor contiguous, of ``out``'s dtype, for
    ``out[offset:offset + param.numel()]``), settings as ``adagrad_settings`` gives them.
    The ``step`` counts are the caller's. Returns whether every element of ``out`` is
    finite (the parameters are stepped either way)."""
    sums, update = _fn("adagrad_sums", out.dtype), _fn("adagrad_update", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, state_sum, (decay, wd, eps, neg_clr) in runs:
        at, n = offset * size, param.numel()
        ptrs = _ptrs(grads, at)
        finite &= bool(sums(n, ptrs, len(grads), 1.0 / len(grads), out.data_ptr() + at,
                            param.data_ptr(), state_sum.data_ptr(), decay, wd))
        root = scratch[:n]
        torch.sqrt(state_sum.view(-1), out=root)
        update(n, param.data_ptr(), out.data_ptr() + at, root.data_ptr(), decay, wd, eps,
               neg_clr)
    return finite


def adagrad_settings(group: dict, dtype: torch.dtype, step: float) -> tuple | None:
    """A torch.optim.Adagrad param group's settings as ``dense_adagrad`` takes them for
    parameters of ``dtype`` at ``step`` (the count after this step's increment), computed
    as torch computes them: (whether weight decay, weight decay, eps, -lr / (1 + (step - 1)
    * lr_decay)). None where the kernel does not do what the group asks (``maximize``,
    ``fused``, ``differentiable``), where a hyper-parameter is not a plain number, where
    torch would convert one differently (an int beyond 2**53) or refuse it (beyond the
    dtype's range, a learning rate divided by zero)."""
    if any(group.get(k) for k in ("maximize", "fused", "differentiable")):
        return None
    lr, decay, wd, eps = (group.get(k) for k in ("lr", "lr_decay", "weight_decay", "eps"))
    if any(type(v) not in (float, int) for v in (lr, decay, wd, eps)):
        return None
    try:                                      # torch's own arithmetic, in its order
        clr = lr / (1 + (step - 1) * decay)
    except (ZeroDivisionError, OverflowError):
        return None
    values = (wd, eps, -clr)
    top = torch.finfo(dtype).max
    if any(type(v) is int and abs(v) > 2 ** 53 for v in values) or \
            any(math.isfinite(v) and abs(v) > top for v in values):
        return None
    return int(wd != 0), *values


def adagrad_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_adagrad`` steps bitwise as torch.optim.Adagrad does on this machine
    for a group with these options (False where ``adagrad_settings`` refuses it at step 1;
    checked once per dtype and kind of group, as ``adam_exact``)."""
    if adagrad_settings(group, dtype, 1.0) is None:
        return False
    kind = ("adagrad", dtype, group["weight_decay"] != 0, group.get("foreach"))
    return _checked(kind, lambda: _adagrad_probe(*kind[1:]))


def _adagrad_probe(dtype: torch.dtype, decay: bool, foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(13)
    n = 4099
    param = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = torch.optim.Adagrad([param], lr=0.7, lr_decay=0.1, eps=0.3,
                              weight_decay=0.3 if decay else 0.0,
                              initial_accumulator_value=0.5, foreach=foreach)
    param.grad = torch.randn(n, generator=gen, dtype=dtype)
    torchstep.step(opt)
    return _probe_step(opt, param, ("sum",), adagrad_settings, dense_adagrad, gen)


def dense_rmsprop(out: torch.Tensor, grads: list[torch.Tensor], runs, scratch: torch.Tensor
                  ) -> bool:
    """``dense_mean`` of two or more ``grads`` (a power-of-two count) into ``out`` and, in
    the same pass, torch.optim.RMSprop's update of the square averages (and, centered, of
    the gradient averages and the centered values, into ``scratch``) with it; then torch's
    square root into ``scratch`` (as long as the longest run, of ``out``'s dtype) and a
    second pass that steps the momentum buffers and the parameters. ``runs``: ``(offset,
    param, square_avg, grad_avg if centered, momentum_buffer if momentum, settings)`` (the
    state ``rmsprop_keys`` names, in its order) covering ``out``, each tensor contiguous,
    of ``out``'s dtype, for ``out[offset:offset + param.numel()]``; settings as
    ``rmsprop_settings`` gives them. The ``step`` counts are the caller's. Returns whether
    every element of ``out`` is finite (the parameters are stepped either way)."""
    squares, update = _fn("rmsprop_sums", out.dtype), _fn("rmsprop_update", out.dtype)
    size = out.element_size()
    finite = True
    for offset, param, square_avg, *more, settings in runs:
        centered, momentum, decay, wd, alpha, s, small, eps, mom, neg_lr = settings
        grad_avg = more[0] if centered else None
        buf = more[-1] if momentum else None
        at, n = offset * size, param.numel()
        root = scratch[:n]
        finite &= bool(squares(n, _ptrs(grads, at), len(grads), 1.0 / len(grads),
                               out.data_ptr() + at, param.data_ptr(), square_avg.data_ptr(),
                               _ptr(grad_avg), root.data_ptr(), decay, wd, alpha, s, small))
        torch.sqrt(root if centered else square_avg.view(-1), out=root)
        update(n, param.data_ptr(), out.data_ptr() + at, root.data_ptr(), _ptr(buf), decay,
               wd, eps, mom, neg_lr)
    return finite


def rmsprop_keys(group: dict) -> tuple[str, ...]:
    """The state torch.optim.RMSprop steps for a param group, in ``dense_rmsprop``'s
    order: ``square_avg``, ``grad_avg`` where centered, ``momentum_buffer`` where the
    momentum is above zero (torch's step tests the group so)."""
    mom = group.get("momentum")
    return ("square_avg", *(("grad_avg",) if group.get("centered") else ()),
            *(("momentum_buffer",) if type(mom) in (float, int) and mom > 0 else ()))


def rmsprop_settings(group: dict, dtype: torch.dtype, step: float = 1.0) -> tuple | None:
    """A torch.optim.RMSprop param group's settings as ``dense_rmsprop`` takes them for
    parameters of ``dtype`` (RMSprop's update does not read its ``step``): (whether
    centered, whether momentum, whether weight decay, weight decay, alpha, 1 - alpha,
    whether ``|1 - alpha|`` < 0.5 in ``dtype`` (``lerp``'s branch), eps, momentum, -lr).
    None where the kernel does not do what the group asks (``maximize``, ``fused``,
    ``differentiable``, ``capturable``), where a hyper-parameter is not a plain number (a
    tensor learning rate, a NumPy float), where torch would convert one differently (an
    int beyond 2**53, which ctypes rounds twice) or refuse it (beyond the dtype's
    range)."""
    if any(group.get(k) for k in ("maximize", "fused", "differentiable", "capturable")):
        return None
    lr, alpha, eps, wd, mom = (group.get(k) for k in ("lr", "alpha", "eps", "weight_decay",
                                                      "momentum"))
    if any(type(v) not in (float, int) for v in (lr, alpha, eps, wd, mom)):
        return None
    s = 1 - alpha                              # torch's own arithmetic
    values = (wd, alpha, s, eps, mom, -lr)
    top = torch.finfo(dtype).max
    if any(type(v) is int and abs(v) > 2 ** 53 for v in values) or \
            any(math.isfinite(v) and abs(v) > top for v in values):
        return None
    centered = bool(group.get("centered"))
    return (centered, mom > 0, int(wd != 0), wd, alpha, s,
            int(centered and _small_weight(s, dtype)), eps, mom, -lr)


def rmsprop_exact(dtype: torch.dtype, group: dict) -> bool:
    """Whether ``dense_rmsprop`` steps bitwise as torch.optim.RMSprop does on this machine
    for a group with these options (False where ``rmsprop_settings`` refuses it; checked
    once per dtype and kind of group, as ``adam_exact``: centered or not, with ``lerp``'s
    branch, momentum or not, weight decay or not, ``foreach``)."""
    settings = rmsprop_settings(group, dtype)
    if settings is None:
        return False
    centered, momentum, decay, small = settings[0], settings[1], settings[2], settings[6]
    kind = ("rmsprop", dtype, centered, small, momentum, decay, group.get("foreach"))
    return _checked(kind, lambda: _rmsprop_probe(*kind[1:]))


def _rmsprop_probe(dtype: torch.dtype, centered: bool, small: bool, momentum: bool,
                   decay: bool, foreach: bool | None) -> bool:
    gen = torch.Generator().manual_seed(17)
    n = 4099
    param = torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype))
    opt = torch.optim.RMSprop([param], lr=0.7, alpha=0.6 if small or not centered else 0.2,
                              eps=0.3, weight_decay=0.3 if decay else 0.0,
                              momentum=0.9 if momentum else 0.0, centered=centered,
                              foreach=foreach)
    for _ in range(2):                      # the state made, the momentum buffer not zero
        param.grad = torch.randn(n, generator=gen, dtype=dtype)
        torchstep.step(opt)
    return _probe_step(opt, param, rmsprop_keys(opt.param_groups[0]), rmsprop_settings,
                       dense_rmsprop, gen)


def _probe_step(opt: torch.optim.Optimizer, param: torch.nn.Parameter, keys: tuple[str, ...],
                settings_of, kernel, gen: torch.Generator) -> bool:
    """One more step of ``opt`` (over ``param`` alone, its state made) with the mean of two
    random gradients, against ``kernel`` from the same state: whether the reduced
    gradients, the parameter and the state ``keys`` come out bitwise the same."""
    n, dtype, state = param.numel(), param.dtype, opt.state[param]
    mine = [t.detach().clone() for t in (param, *(state[k] for k in keys))]
    step = float(state["step"]) + 1
    grads = [torch.randn(n, generator=gen, dtype=dtype) for _ in range(2)]
    param.grad = (grads[0] + grads[1]) * 0.5
    torchstep.step(opt)
    settings = settings_of(opt.param_groups[0], dtype, step)
    if settings is None:
        return False
    out = torch.empty(n, dtype=dtype)
    kernel(out, grads, [(0, *mine, settings)], torch.empty(n, dtype=dtype))
    return torch.equal(out, param.grad) and all(
        torch.equal(a, b) for a, b in zip(mine, (param.detach(), *(state[k] for k in keys))))
