"""The wrapped optimizer's step on a ps rank: over fused regions, bucket by bucket (no MPI).

A ps rank holds its parameters side by side in one buffer per dtype. For an elementwise
optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta, Adamax, NAdam, RAdam, ASGD,
Rprop) one update over a run of neighbouring parameters is, element for element, the
update torch computes parameter by parameter: the same operations on the same values in
the same order, so the result is bitwise the same (``tests/unit/test_fused.py`` checks every
one with its options). So this module steps the optimizer over *runs*: maximal ranges of
neighbouring parameters of one param group and one bucket that all have a gradient this
step and identical optimizer histories (the same ``step`` count and scalar state, the same
state keys). Their per-parameter state lives in fused arenas too (``state[p]["exp_avg"]``
is a view into one tensor per key and region), so a run's state is one view as well;
scalar state (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) is one 0-dim
view per parameter into one tensor per key, written back for a whole run at once.

The optimizer's ``state`` and ``param_groups`` keep torch's per-parameter schema for
everything else (``state_dict()``, ``load_state_dict()``, the tables' rows): a run's step
swaps in, for the duration of one ``optimizer.step()``, param groups that hold the runs'
flat parameters (with each group's hyper-parameters) and a state holding theirs.

For plain SGD, Adam, AdamW, Adagrad and RMSprop the ps goes one further: ``compiled_step``
hands a bucket's runs to the compiled reduce (``kernels.dense_sgd``, ``dense_adam``,
``dense_adagrad``, ``dense_rmsprop``), which steps them in the same pass over memory that
averages the workers' gradients (Adam, Adagrad and RMSprop: and one more after torch's
square root), bitwise torch's step (checked once per machine and kind of group,
``kernels.sgd_exact``, ``adam_exact``, ``adagrad_exact``, ``rmsprop_exact``, and in
``tests/unit/test_fused.py``).

Every other case steps ``"whole"``: one ``optimizer.step()`` over every parameter once
every bucket is reduced, exactly as torch's own loop. That is optimizers that look at a
whole tensor or at several at once (Adafactor, Muon, LBFGS), subclasses and unknown
classes, complex parameters, and elementwise optimizers with ``fused=True`` (torch's
fused CPU kernels round a tensor's tail differently from its body, and fused SGD decides
whether momentum starts from the whole list of tensors in one call), ``differentiable``
or ``capturable``.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from functools import partial

import numpy as np
import torch

from ..native import kernels, torchstep

__all__ = ["ELEMENTWISE", "Applier", "only_params"]

#: Optimizers whose update of each element depends on that element's values alone (its
#: parameter, gradient and state) and on per-parameter scalars: stepping a run of
#: parameters as one is bitwise stepping each. Exact classes: a subclass may change that.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam",
    "ASGD", "Rprop") if hasattr(torch.optim, n))

_GROUP_FLAGS_OFF = ("fused", "differentiable", "capturable")


@contextlib.contextmanager
def only_params(optimizer: torch.optim.Optimizer, params_per_group: list[list[torch.Tensor]],
                state=None):
    """Within the block, ``optimizer``'s groups hold only ``params_per_group`` (each with its
    group's hyper-parameters), and with ``state`` its state is that mapping instead."""
    groups, saved_state = optimizer.param_groups, optimizer.state
    optimizer.param_groups = [{**g, "params": ps} for g, ps in zip(groups, params_per_group)
                              if ps]
    if state is not None:
        optimizer.state = state
    try:
        yield
    finally:
        optimizer.param_groups = groups
        optimizer.state = saved_state


#: Optimizers that count steps and whose step the compiled reduce takes: the state each
#: run's kernel updates (or the function of its group that names it), its settings at a
#: step, its check against torch, the kernel.
_COUNTED = {
    torch.optim.Adam: (("exp_avg", "exp_avg_sq"), kernels.adam_settings, kernels.adam_exact,
                       kernels.dense_adam),
    torch.optim.AdamW: (("exp_avg", "exp_avg_sq"), kernels.adam_settings, kernels.adam_exact,
                        kernels.dense_adam),
    torch.optim.Adagrad: (("sum",), kernels.adagrad_settings, kernels.adagrad_exact,
                          kernels.dense_adagrad),
    torch.optim.RMSprop: (kernels.rmsprop_keys, kernels.rmsprop_settings, kernels.rmsprop_exact,
                          kernels.dense_rmsprop)}


def _sgd_step(out: torch.Tensor, runs: list[tuple], grads: list[torch.Tensor]) -> bool:
    """SGD's compiled step of a bucket: the means are not kept (nothing reads a stepped
    bucket's gradients; not writing them spares a quarter of the pass's memory traffic),
    except where one is not finite, for the error that names the parameters."""
    if kernels.dense_sgd(out, grads, runs, store=False):
        return True
    kernels.dense_mean(out, grads, True)
    return False


def _overlap(tensors: list[torch.Tensor]) -> bool:
    """Whether two of ``tensors`` may share memory (the byte spans they reach overlap)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum(
        (n - 1) * s for n, s in zip(t.shape, t.stride())))) for t in tensors
        if t.numel() and t.layout == torch.strided)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


class _Run:
    """Neighbouring parameters ``[first, stop)`` stepped as one flat parameter."""

    __slots__ = ("first", "group", "param", "stop", "views")

    def __init__(self, first: int, stop: int, group: int, param: torch.Tensor):
        self.first, self.stop, self.group, self.param = first, stop, group, param
        self.views: dict[str, torch.Tensor] = {}     # its arena views, by state key


class Applier:
    """Steps one ps rank's dense parameters with the wrapped optimizer, bucket by bucket.

    Args:
        optimizer: the rebuilt optimizer (its groups may also hold table parameters).
        params: the dense parameters, in layout order (views into the parameter buffer).
        grads: their gradients' views into the reduced-gradient buffer, in the same order.
        places: per parameter ``(region, first element, end element)`` in ``regions``.
        regions: the parameter buffer's regions, flat, one per dtype.
        grad_regions: the gradient buffer's regions, alike (None for integer regions).
        buckets: per bucket, the range of parameter indices it holds.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor],
                 grads: list[torch.Tensor], places: list[tuple[int, int, int]],
                 regions: list[torch.Tensor], grad_regions: list[torch.Tensor | None],
                 buckets: list[range]):
        self.optimizer = optimizer
        self.params, self.grads = params, grads
        self.regions, self.grad_regions = regions, grad_regions
        n = len(params)
        self.region = np.array([r for r, _, _ in places], np.int64)
        self.lo = np.array([a for _, a, _ in places], np.int64)
        self.hi = np.array([b for _, _, b in places], np.int64)
        self.bucket = np.zeros(n, np.int64)
        self.buckets = buckets
        for k, members in enumerate(buckets):
            self.bucket[members.start:members.stop] = k
        index = {id(p): i for i, p in enumerate(params)}
        self.group = np.full(n, -1, np.int64)
        if optimizer is not None:
            for g, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    if id(p) in index:
                        self.group[index[id(p)]] = g
        self.cls = np.zeros(n, np.int64)      # equal classes: identical optimizer histories
        self.next_cls = 1
        self.arenas: dict[tuple, torch.Tensor] = {}      # (key, region, dtype) -> flat
        self.scalars: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.runs: list[list[_Run]] = [[] for _ in buckets]
        self.run_key = None
        self.planned = None      # the gradients' mask the runs are planned for (``_plan``)
        self.run_state: dict[torch.Tensor, dict] = defaultdict(dict)
        self.present = np.zeros(n, bool)
        self.mode = "whole"
        self.flags = None
        self.hold = False      # the caller steps whole (a check of the whole step, opt.update)
        self.scratch: dict[torch.dtype, torch.Tensor] = {}
        self.sync()

    # -- state -------------------------------------------------------------------------
    def sync(self) -> None:
        """The optimizer's state was made or replaced (built, loaded): take it over.

        Moves every parameter's state into the arenas, sorts the parameters into classes
        of identical histories, and picks the mode.
        """
        self.run_key = self.planned = None
        self.run_state = defaultdict(dict)
        self.flags = self._flags()
        self.mode = self._mode()
        if self.mode != "fused":
            return
        signatures: dict[tuple, int] = {}
        state = self.optimizer.state
        if _overlap(self.params + [v for p in self.params for v in state.get(p, {}).values()
                                   if torch.is_tensor(v) and v.dim()]):
            self.mode = "whole"     # state shared by parameters (loaded so): torch steps it
            return
        for i, p in enumerate(self.params):
            st = state.get(p)
            if st and not self._adopt(i, st):
                self.mode = "whole"             # a state this module does not know
                return
            sig = self._signature(st) if st else ()
            self.cls[i] = signatures.setdefault(sig, len(signatures) + self.next_cls)
        self.next_cls += len(signatures) + 1

    def _flags(self) -> tuple:
        if self.optimizer is None:
            return ()
        return tuple(bool(g.get(f)) for g in self.optimizer.param_groups for f in _GROUP_FLAGS_OFF)

    def _mode(self) -> str:
        opt = self.optimizer
        if self.hold or opt is None or type(opt) not in ELEMENTWISE or not self.params:
            return "whole"
        if any(self.flags) or any(p.is_complex() for p in self.params):
            return "whole"
        return "fused"

    @staticmethod
    def _signature(st: dict) -> tuple:
        sig = []
        for key in sorted(st):
            v = st[key]
            if v.dim() == 0:
                sig.append((key, str(v.dtype), v.item()))
            else:
                sig.append((key, str(v.dtype)))
        return tuple(sig)

    def _adopt(self, i: int, st: dict) -> bool:
        """Move parameter ``i``'s state into the arenas; False if a value does not fit (or
        is one torch's in-place step refuses: elements sharing memory, an expanded tensor
        from a loaded state, which a copy into the arena would quietly make whole)."""
        p = self.params[i]
        r, a, b = int(self.region[i]), int(self.lo[i]), int(self.hi[i])
        for key, v in list(st.items()):
            if not torch.is_tensor(v) or v.device != p.device or v.layout != torch.strided or \
                    any(s == 0 and n > 1 for s, n in zip(v.stride(), v.shape)):
                return False
            if v.dim() == 0:
                arena = self._scalar_arena(key, v.dtype)
                arena[i] = v
                st[key] = arena[i]
            elif v.shape == p.shape:
                view = self._arena(key, r, v.dtype)[a:b]
                if view.data_ptr() != v.data_ptr():
                    view.copy_(v.reshape(-1))
                st[key] = view.view(p.shape)
            else:
                return False
        return True

    def _arena(self, key: str, r: int, dtype: torch.dtype) -> torch.Tensor:
        arena = self.arenas.get((key, r, dtype))
        if arena is None:
            arena = self.arenas[(key, r, dtype)] = torch.zeros(self.regions[r].numel(),
                                                               dtype=dtype)
        return arena

    def _scalar_arena(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        arena = self.scalars.get((key, dtype))
        if arena is None:
            arena = self.scalars[(key, dtype)] = torch.zeros(len(self.params), dtype=dtype)
        return arena

    # -- a step ------------------------------------------------------------------------
    def begin(self, present: np.ndarray) -> None:
        """A step starts: ``present[i]`` says whether parameter ``i`` has a gradient."""
        self.present = present.astype(bool)
        if self.optimizer is not None and self._flags() != self.flags:
            self.sync()                    # a group's fused/differentiable/capturable changed
        if self.mode == "fused":
            self._plan()
            return
        for p, g, has in zip(self.params, self.grads, self.present):
            p.grad = g if has else None

    def apply(self, k: int) -> None:
        """Bucket ``k``'s reduced gradients are in: step its parameters (``"fused"``)."""
        if self.mode == "fused" and self.runs[k]:
            self._step_runs(self.runs[k])

    def compiled_step(self, k: int, out: torch.Tensor):
        """Where the compiled reduce may step bucket ``k``'s parameters in its pass over
        ``out`` (the bucket's reduced gradients): a function of the workers' gradients (two
        or more, a power of two: their mean) that reduces them, steps the bucket and
        returns whether every mean is finite (SGD's leaves ``out`` as scratch unless one
        is not: nothing reads a stepped bucket's means). That is a plain
        torch.optim.SGD (``kernels.dense_sgd``), Adam or AdamW (``kernels.dense_adam``),
        Adagrad (``kernels.dense_adagrad``) or RMSprop (``kernels.dense_rmsprop``) without
        step hooks, whose kernel (``kernels.sgd_exact``, ``adam_exact``, ``adagrad_exact``,
        ``rmsprop_exact``) found bitwise torch's here, runs that cover the whole bucket,
        each group's hyper-parameters plain numbers its kernel takes
        (``kernels.sgd_settings``, ...) and the state torch makes on the first step made.
        None otherwise: the reduce, then ``apply(k)``."""
        opt, runs = self.optimizer, self.runs[k]
        if self.mode != "fused" or not runs or torchstep.hooked(opt) or \
                sum(r.param.numel() for r in runs) != out.numel():
            return None
        if type(opt) is torch.optim.SGD:
            taken = self._sgd_runs(runs, out)
            return None if taken is None else partial(_sgd_step, out, taken)
        counted = _COUNTED.get(type(opt))
        return None if counted is None else self._counted_step(runs, out, *counted)

    def _offset(self, run: _Run, out: torch.Tensor) -> int | None:
        """Where ``run``'s gradient lies in ``out`` (in elements), if it does, in its dtype."""
        grad = run.param.grad
        offset = (grad.data_ptr() - out.data_ptr()) // out.element_size()
        if grad.dtype != out.dtype or not 0 <= offset <= out.numel() - grad.numel():
            return None
        return offset

    def _sgd_runs(self, runs: list[_Run], out: torch.Tensor) -> list[tuple] | None:
        """``runs`` as ``kernels.dense_sgd`` takes them, or None (see ``compiled_step``)."""
        opt, dtype = self.optimizer, out.dtype
        taken = []
        for run in runs:
            group = opt.param_groups[run.group]
            offset = self._offset(run, out)
            settings = kernels.sgd_settings(group, dtype)
            if settings is None or offset is None or not kernels.sgd_exact(dtype, group):
                return None
            buf = None
            if group["momentum"] != 0:
                buf = self.run_state[run.param].get("momentum_buffer")
                if buf is None or not buf.is_contiguous() or buf.dtype != dtype:
                    return None
            taken.append((offset, run.param, buf, settings))
        return taken

    def _counted_step(self, runs: list[_Run], out: torch.Tensor, keys: tuple[str, ...],
                      settings_of, exact, kernel):
        """Bucket ``runs``' step of an optimizer that counts steps (Adam, AdamW, Adagrad,
        RMSprop) in the reduce's pass, or None (see ``compiled_step``): each run's ``step``
        count goes up by one, as torch's does, the settings follow from it
        (``settings_of``), ``kernel`` steps the state ``keys`` (or ``keys(group)``) and the
        parameters, and the new counts reach the runs' members."""
        opt, dtype = self.optimizer, out.dtype
        taken, counts = [], []
        for run in runs:
            group = opt.param_groups[run.group]
            names = keys(group) if callable(keys) else keys
            offset, found = self._offset(run, out), self._counted_state(run, group, dtype, names)
            if offset is None or found is None:
                return None
            count, state = found
            settings = settings_of(group, dtype, (count + 1).item())
            if settings is None or not exact(dtype, group):
                return None
            taken.append((offset, run.param, *state, settings))
            counts.append(count)
        longest = max(run.param.numel() for run in runs)

        def step(grads: list[torch.Tensor]) -> bool:
            for count in counts:
                count += 1                # torch's step_t += 1
            finite = kernel(out, grads, taken, self._scratch(dtype, longest))
            for run in runs:
                self._write_back(run)
            return finite
        return step

    def _counted_state(self, run: _Run, group: dict, dtype: torch.dtype,
                       keys: tuple[str, ...]) -> tuple | None:
        """``run``'s step count and state ``keys`` where the compiled passes may step them:
        a 0-dim CPU count (with ``foreach``, float32 or float64: torch's multi-tensor step
        refuses other counts) and contiguous tensors of ``dtype``; None otherwise."""
        st = self.run_state[run.param]
        count, state = st.get("step"), [st.get(key) for key in keys]
        if not torch.is_tensor(count) or count.dim() or count.device.type != "cpu" or \
                (group.get("foreach") and count.dtype not in (torch.float32, torch.float64)):
            return None
        if any(t is None or t.dtype != dtype or not t.is_contiguous() or
               t.numel() != run.param.numel() for t in state):
            return None
        return count, state

    def _scratch(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` elements (the compiled steps' roots)."""
        buf = self.scratch.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self.scratch[dtype] = torch.empty(n, dtype=dtype)
        return buf

    def end(self) -> None:
        """Every bucket is in: ``"whole"`` steps now; ``"fused"`` notes the new histories."""
        if self.mode == "fused" and self.present.any() and not self.present.all():
            stepped = self.present      # (all stepped: the classes stay as they were)
            uniq, inverse = np.unique(self.cls[stepped], return_inverse=True)
            self.cls[stepped] = self.next_cls + inverse
            self.next_cls += len(uniq)

    @property
    def steps_whole(self) -> bool:
        """The caller runs ``optimizer.step()`` over every parameter itself, once."""
        return self.mode == "whole"

    def _plan(self) -> None:
        """This step's runs: neighbours of one region, group, bucket and class, each with a
        gradient. The runs (and their flat parameters and state) of the last step are kept
        when they are the same, at once when the same parameters have gradients as when
        they were planned (``end()`` keeps apart the classes it kept apart)."""
        mask = self.present.tobytes()
        if mask == self.planned:
            return
        self.planned = mask
        idx = np.flatnonzero(self.present)
        if not len(idx):
            self.runs = [[] for _ in self.buckets]
            self.run_key = None
            return
        prev, cur = idx[:-1], idx[1:]
        new = np.ones(len(idx), bool)
        new[1:] = ((cur != prev + 1) | (self.region[cur] != self.region[prev])
                   | (self.group[cur] != self.group[prev])
                   | (self.bucket[cur] != self.bucket[prev])
                   | (self.cls[cur] != self.cls[prev]) | (self.lo[cur] != self.hi[prev]))
        at = np.flatnonzero(new)
        firsts = idx[at]
        stops = np.append(idx[at[1:] - 1], idx[-1]) + 1
        key = (firsts.tobytes(), stops.tobytes())
        if key == self.run_key:
            return
        self.run_key = key
        self.run_state = defaultdict(dict)
        self.runs = [[] for _ in self.buckets]
        for first, stop in zip(firsts.tolist(), stops.tolist()):
            self.runs[int(self.bucket[first])].append(self._run(first, stop))

    def _run(self, first: int, stop: int) -> _Run:
        r = int(self.region[first])
        a, b = int(self.lo[first]), int(self.hi[stop - 1])
        flat = torch.nn.Parameter(self.regions[r][a:b], requires_grad=True)
        flat.grad = self.grad_regions[r][a:b]
        run = _Run(first, stop, int(self.group[first]), flat)
        member = self.optimizer.state.get(self.params[first], {})
        st = self.run_state[flat]
        for key, v in member.items():
            if v.dim() == 0:
                st[key] = v.clone()           # the run's scalar: written back after a step
            else:
                st[key] = run.views[key] = self.arenas[(key, r, v.dtype)][a:b]
        return run

    def _step_runs(self, runs: list[_Run]) -> None:
        per_group = [[] for _ in self.optimizer.param_groups]
        for run in runs:
            per_group[run.group].append(run.param)
        with only_params(self.optimizer, per_group, self.run_state):
            torchstep.step(self.optimizer)
        for run in runs:
            self._write_back(run)

    def _write_back(self, run: _Run) -> None:
        """The run's scalars into its members' state; state it made for the first time
        into the arenas, its members' state views onto them."""
        st = self.run_state[run.param]
        state = self.optimizer.state
        r = int(self.region[run.first])
        a = int(self.lo[run.first])
        for key, v in st.items():
            if v.dim() == 0:
                arena = self.scalars.get((key, v.dtype))
                if arena is None or key not in state[self.params[run.first]]:
                    arena = self._scalar_arena(key, v.dtype)
                    for i in range(run.first, run.stop):
                        state[self.params[i]][key] = arena[i]
                arena[run.first:run.stop].fill_(v)
            elif run.views.get(key) is not v:
                arena = self._arena(key, r, v.dtype)
                view = arena[a:a + v.numel()]
                view.copy_(v)                 # made by this step (first step, new key)
                st[key] = run.views[key] = view
                for i in range(run.first, run.stop):
                    p = self.params[i]
                    state[p][key] = arena[int(self.lo[i]):int(self.hi[i])].view(p.shape)
