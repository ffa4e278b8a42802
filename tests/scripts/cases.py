"""Training loops people write, each run under mpisync and in plain torch (see exact.py).

A case is a model, an optimizer, a scheduler and a loop (zero_grad mode and place,
writes to the parameters between steps). ``reference(case)`` is plain torch in one
process: one batch of all the workers' rows per step, or (``replicas``) one model copy
per worker with the gradients averaged and the buffers handled as mpisync's
``buffers=`` option says, the way DDP would run it.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from common import dataset
from torch.optim import lr_scheduler as S
from torch.optim.swa_utils import SWALR

import mpisync

WORKERS, BATCH, STEPS = 2, 6, 8
F64 = torch.float64


@dataclass
class Case:
    name: str
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    scheduler: Callable | None = None
    metrics: tuple | None = None          # ReduceLROnPlateau: sched.step(metrics[t])
    zero: str = "none"                    # zero_grad(set_to_none=True) / "zeros": False
    order: str = "first"                  # zero_grad before backward, or "last": after step
    write: Callable[[torch.nn.Module, int], None] | None = None   # after each step t
    regrad: Callable[[torch.nn.Module], None] | None = None       # between backward and step
    before: Callable[[torch.nn.Module], None] | None = None       # after wrapping
    restore: Callable | None = None       # restore(model, optimizer), after wrapping
    per_worker: Callable[[torch.nn.Module, int], None] | None = None   # before wrapping
    model: Callable[[], torch.nn.Module] | None = None
    trained: Callable[[torch.nn.Module], list] | None = None      # named_parameters given
    sync: dict = field(default_factory=dict)                      # SyncReplicasOptimizer kw
    replicas: bool = False                # reference: one model copy per worker
    steps: int = STEPS


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(F64)


def bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(F64)


def square() -> torch.nn.Module:
    """A square weight (its gradient can be transposed in place) and two biases alike."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(F64)


class WithEmpty(torch.nn.Module):
    """Parameters with no elements: one alone in its dtype, one at the end of the model's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(10, 3).to(F64)
        self.nothing = torch.nn.Parameter(torch.zeros(0, 4))              # float32, alone
        self.last = torch.nn.Parameter(torch.zeros(0, dtype=F64))

    def forward(self, x):
        return self.body(x) + self.nothing.sum() + self.last.sum()


class WithExtras(torch.nn.Module):
    """A frozen parameter, an integer one, and one used only on odd steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(10, 3).to(F64)
        self.frozen = torch.nn.Parameter(torch.ones(3, dtype=F64), requires_grad=False)
        self.counts = torch.nn.Parameter(torch.arange(4), requires_grad=False)
        self.sometimes = torch.nn.Parameter(torch.full((3,), 0.5, dtype=F64))
        self.step_no = 0

    def forward(self, x):
        out = self.body(x) * self.frozen
        if self.step_no % 2:
            out = out + self.sometimes
        return out


class ScaledSGD(torch.optim.SGD):
    """A custom optimizer that keeps a constructor argument as an attribute."""

    def __init__(self, params, lr, scale):
        super().__init__(params, lr=lr, momentum=0.5)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.scale)
        return super().step(closure)


def sgd(lr=0.1, **kw):
    # a copy per optimizer: schedulers write tensor hyper-parameters in place
    return lambda m: torch.optim.SGD(m.parameters(), **copy.deepcopy(dict(kw, lr=lr)))


def adam(lr=0.01, **kw):
    return lambda m: torch.optim.Adam(m.parameters(), **copy.deepcopy(dict(kw, lr=lr)))


def rowwise(lr=0.1, **kw):
    return lambda m: mpisync.RowWiseAdagrad(m.parameters(), **copy.deepcopy(dict(kw, lr=lr)))


def two_groups(m):
    return torch.optim.SGD([{"params": m[0].parameters(), "lr": 1},
                            {"params": m[2].parameters(), "lr": 0.05, "momentum": 0.9}],
                           lr=0.1)


def clamp_data(m, t):
    for p in m.parameters():
        p.data.clamp_(-0.2, 0.2)               # WGAN's weight clipping


def clamp_no_grad(m, t):
    with torch.no_grad():
        for p in m.parameters():
            p.clamp_(-0.2, 0.2)


def assign_data(m, t):
    if t % 3 == 1:
        m[0].weight.data = m[0].weight.data * 0.5


def load_other(m):
    other = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-0.5)
    m.load_state_dict(other.state_dict())      # torch's usual restore order: after the optimizer


def _restore_from(m, opt, make_opt) -> None:
    """The model's state, then the optimizer's, of two steps of one process."""
    ck = mlp()
    ck_opt = make_opt(ck.parameters())
    x, y = dataset(12, seed=7, dtype=F64)
    for _ in range(2):
        ck_opt.zero_grad()
        torch.nn.functional.cross_entropy(ck(x), y).backward()
        ck_opt.step()
    m.load_state_dict(ck.state_dict())
    opt.load_state_dict(ck_opt.state_dict())


def restore_both(m, opt):
    """torch's usual restore order: the model's state, then the optimizer's."""
    _restore_from(m, opt, lambda p: torch.optim.Adam(p, lr=0.01))


def restore_rowwise(m, opt):
    """A row-wise state (one sum a row of each weight) saved by one process, restored."""
    _restore_from(m, opt, lambda p: mpisync.RowWiseAdagrad(p, lr=0.05))


def regrad(m):
    """Gradients given by hand between backward and step: views of other parameters'
    gradients (mpisync's send buffer in ``zeros`` mode: read before it is written) and
    new memory under one through ``.data`` (linear, so the mean is unchanged)."""
    w0, b0, w2, b2 = m.parameters()
    w0.grad, w2.grad, b0.grad = w0.grad * 2, w0.grad[:3, :8], w2.grad[0]
    b2.grad.data = b2.grad.data * 3


def regrad_shared(m):
    """Gradients given by hand that share memory with other gradients without being views
    of them (``.data``, ``.detach()``), and one transposed in place: in ``zeros`` mode each
    is mpisync's send buffer, read before it is written and at its own strides."""
    w0, b0, w1, b1, _, _ = m.parameters()
    b0.grad, b1.grad = b1.grad.data, b0.grad.data
    w0.grad = w0.grad.detach() * 1          # (a product: new memory, for contrast)
    w1.grad.t_()


def regrad_shared_data(m):
    """As ``regrad_shared``, through ``.detach()`` and ``p.grad.data = ...t()``."""
    _, b0, w1, b1, _, _ = m.parameters()
    b0.grad, b1.grad = b1.grad.detach(), b0.grad.detach()
    w1.grad.data = w1.grad.data.t()


def bump_counts(m, t):
    with torch.no_grad():
        m.counts.add_(1)                        # integer parameters are written, never updated


def per_worker_init(m, w):
    with torch.no_grad():
        m[0].weight.add_(w)                     # the workers start differently: the chief wins


CASES = [
    # 1. hyper-parameters of every type, changed by every scheduler
    Case("lambda-int-lr", sgd(lr=1), lambda o: S.LambdaLR(o, lambda s: 0.5 ** s)),
    Case("multiplicative", sgd(momentum=0.9), lambda o: S.MultiplicativeLR(o, lambda s: 0.9),
         zero="zeros"),
    Case("step-tensor-lr", adam(lr=torch.tensor(0.05, dtype=F64)),
         lambda o: S.StepLR(o, 3, 0.5), order="last"),
    Case("multistep-int-lr", sgd(lr=1, momentum=0.5), lambda o: S.MultiStepLR(o, [2, 5], 0.1)),
    Case("constant", adam(), lambda o: S.ConstantLR(o, factor=0.5, total_iters=4),
         zero="zeros", order="last"),
    Case("linear-tensor-lr", sgd(lr=torch.tensor(0.1, dtype=torch.float32), momentum=0.9),
         lambda o: S.LinearLR(o, start_factor=0.25, total_iters=5)),
    Case("exponential", adam(), lambda o: S.ExponentialLR(o, 0.8)),
    Case("adagrad-decay", lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01,
                                                         weight_decay=0.01),
         lambda o: S.StepLR(o, 2, 0.5)),
    Case("rmsprop-centered-cyclic", lambda m: torch.optim.RMSprop(
        m.parameters(), lr=0.01, momentum=0.9, centered=True, weight_decay=0.01),
         lambda o: S.CyclicLR(o, 0.001, 0.01, step_size_up=2, cycle_momentum=True)),
    Case("sequential", sgd(momentum=0.9),
         lambda o: S.SequentialLR(o, [S.ConstantLR(o, 0.1, 2), S.ExponentialLR(o, 0.9)], [3])),
    Case("polynomial-int-lr", sgd(lr=1), lambda o: S.PolynomialLR(o, total_iters=6, power=2.0),
         order="last"),
    Case("cosine", adam(amsgrad=True), lambda o: S.CosineAnnealingLR(o, T_max=5)),
    Case("chained", sgd(momentum=0.9),
         lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, 3), S.ExponentialLR(o, 0.9)])),
    Case("plateau", adam(), lambda o: S.ReduceLROnPlateau(o, patience=0, factor=0.5),
         metrics=(1.0, 1.0, 0.5, 0.6, 0.7, 0.2, 0.3, 0.4)),
    Case("cyclic-momentum", sgd(momentum=0.9),
         lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=2, cycle_momentum=True)),
    Case("cyclic-betas", adam(),
         lambda o: S.CyclicLR(o, 0.001, 0.01, step_size_up=2, cycle_momentum=True)),
    Case("warm-restarts", sgd(momentum=0.9), lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3)),
    Case("onecycle-int-momentum", sgd(lr=1),            # SGD's default momentum=0 is an int
         lambda o: S.OneCycleLR(o, max_lr=0.5, total_steps=STEPS), zero="zeros"),
    Case("onecycle-betas", adam(),
         lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)),
    Case("onecycle-tensor-betas", adam(betas=(torch.tensor(0.9), torch.tensor(0.99))),
         lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS), order="last"),
    Case("swalr", sgd(momentum=0.5), lambda o: SWALR(o, swa_lr=0.05, anneal_epochs=3)),
    Case("two-groups-int-lr", two_groups, lambda o: S.StepLR(o, 2, 0.5)),
    Case("manual-lr-edits", sgd(lr=1, momentum=0.9)),     # the loop sets lr itself: manual_lr
    # 2. a custom optimizer that keeps a constructor argument as an attribute
    Case("custom-attribute", lambda m: ScaledSGD(m.parameters(), lr=0.1, scale=0.25)),
    # 3. parameters torch never updates: frozen, integer, sometimes without a gradient
    Case("untouched-none-first", lambda m: torch.optim.AdamW(m.parameters(), weight_decay=0.1),
         model=WithExtras),
    Case("untouched-zeros-first", lambda m: torch.optim.AdamW(m.parameters(), weight_decay=0.1),
         model=WithExtras, zero="zeros"),
    Case("untouched-none-last", lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                          weight_decay=0.1, momentum=0.9),
         model=WithExtras, order="last"),
    Case("untouched-zeros-last", lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                           weight_decay=0.1, momentum=0.9),
         model=WithExtras, zero="zeros", order="last"),
    # 4. writes to parameters between steps
    Case("load-state-after-wrapping", adam(), before=load_other),
    Case("restore-model-then-optimizer", adam(), restore=restore_both, order="last"),
    Case("clamp-through-data", sgd(momentum=0.9), write=clamp_data),
    Case("clamp-no-grad", adam(), write=clamp_no_grad, zero="zeros"),
    Case("assign-data", sgd(momentum=0.9), write=assign_data, order="last"),
    Case("write-integer-parameter", adam(), model=WithExtras, write=bump_counts),
    # 5. gradients given by hand: views of other gradients, `.grad.data = x`, both modes
    Case("regrad-zeros", sgd(momentum=0.9), zero="zeros", regrad=regrad),
    Case("regrad-none-last", adam(), order="last", regrad=regrad),
    Case("regrad-partitioned", sgd(momentum=0.9), zero="zeros", regrad=regrad,
         sync={"partitioner": {"0.weight": mpisync.fixed_size(3)}}),
    Case("regrad-shared-zeros", sgd(momentum=0.9), zero="zeros", model=square,
         regrad=regrad_shared),
    Case("regrad-shared-data-zeros", adam(), zero="zeros", model=square,
         regrad=regrad_shared_data, order="last"),
    Case("regrad-shared-none", adam(), model=square, regrad=regrad_shared_data),
    # parameters with no elements
    Case("empty-parameters", adam(), model=WithEmpty),
    # 6. module buffers, each way
    Case("buffers-broadcast", sgd(momentum=0.9), model=bn_net, replicas=True),
    Case("buffers-mean", adam(), model=bn_net, replicas=True, sync={"buffers": "mean"}),
    Case("buffers-local", sgd(momentum=0.9), model=bn_net, replicas=True,
         sync={"buffers": "local"}),
    # 14. fine-tuning: an optimizer over part of the model, named_parameters of all of it
    Case("fine-tuning", lambda m: torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9),
         per_worker=per_worker_init),
    # 7. partitioned parameters: shards on both ps ranks, the parameter whole on the workers
    Case("partitioned-adam", adam(), lambda o: S.ExponentialLR(o, 0.8),
         sync={"partitioner": mpisync.fixed_size(3)}),
    Case("partitioned-zeros-clamp", sgd(momentum=0.9), zero="zeros", write=clamp_data,
         sync={"partitioner": {"0.*": mpisync.min_max(4, 64), "2.weight": mpisync.fixed_size(2)}}),
    Case("partitioned-restore", adam(), restore=restore_both, order="last",
         sync={"partitioner": mpisync.axis_size(100)}),
    Case("partitioned-assign", sgd(momentum=0.9), write=assign_data, order="last",
         sync={"partitioner": mpisync.fixed_size(5), "placement": "round_robin"}),
    # row-wise Adagrad's state (one sum a row) on shards: stepped, gathered and restored
    Case("partitioned-rowwise", rowwise(), lambda o: S.StepLR(o, 2, 0.5),
         sync={"partitioner": mpisync.fixed_size(3)}),
    Case("partitioned-rowwise-restore", rowwise(weight_decay=0.01), restore=restore_rowwise,
         order="last", sync={"partitioner": mpisync.fixed_size(2)}),
]
BY_NAME = {c.name: c for c in CASES}


def batches(steps: int):
    x, y = dataset(WORKERS * BATCH * steps, dtype=F64)
    for t in range(steps):
        lo = t * WORKERS * BATCH
        yield x[lo:lo + WORKERS * BATCH], y[lo:lo + WORKERS * BATCH]


def build(case: Case, worker: int = 0):
    """The case's model (with each worker's own start, if it has one) and optimizer."""
    m = (case.model or mlp)()
    if case.per_worker:
        case.per_worker(m, worker)
    return m, case.optimizer(m)


def manual_lr(opt, t: int) -> None:
    """What a loop that sets the learning rate by hand does (case manual-lr-edits)."""
    for g in opt.param_groups:
        g["lr"] = 1 if t % 2 else 0.25          # an int one step, a float the next
        g["momentum"] = 0.5 + 0.1 * (t % 3)


def loop_step(case: Case, m, opt, sched, t: int, xb, yb, zero_grad: Callable) -> list:
    """One iteration of the case's loop on one batch; the groups the step applied."""
    set_to_none = case.zero == "none"
    if hasattr(m, "step_no"):
        m.step_no = t
    if case.order == "first":
        zero_grad(set_to_none)
    torch.nn.functional.cross_entropy(m(xb), yb).backward()
    if case.regrad:
        case.regrad(m)
    applied = [describe_group(g) for g in opt.param_groups]
    opt.step()
    if case.order == "last":
        zero_grad(set_to_none)
    if sched is not None:
        sched.step(case.metrics[t]) if case.metrics else sched.step()
    if case.name == "manual-lr-edits":
        manual_lr(opt, t)
    if case.write:
        case.write(m, t)
    return applied


def reference(case: Case) -> dict:
    """Plain torch in one process: the values mpisync must reproduce."""
    if case.replicas:
        return _replicas(case)
    m, opt = build(case, 0)
    sched = case.scheduler(opt) if case.scheduler else None
    if case.before:
        case.before(m)
    if case.restore:
        case.restore(m, opt)
    for t, (xb, yb) in enumerate(batches(case.steps)):
        applied = loop_step(case, m, opt, sched, t, xb, yb, opt.zero_grad)
    return dict(snapshot(m, opt), applied=applied)


def _replicas(case: Case) -> dict:
    """One model copy per worker, gradients averaged, buffers as ``buffers=`` says."""
    how = case.sync.get("buffers", "broadcast")
    models = [build(case, 0)[0] for _ in range(WORKERS)]
    main, opt = models[0], case.optimizer(models[0])
    for xb, yb in batches(case.steps):
        grads = []
        for w, m in enumerate(models):
            m.zero_grad()
            rows = slice(w * BATCH, (w + 1) * BATCH)
            torch.nn.functional.cross_entropy(m(xb[rows]), yb[rows]).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for p, *gs in zip(main.parameters(), *grads):
            p.grad = sum(gs[1:], gs[0].clone()) / WORKERS
        opt.step()
        _combine_buffers(models, how)
        for m in models[1:]:
            with torch.no_grad():
                for p, q in zip(m.parameters(), main.parameters()):
                    p.copy_(q)
    out = snapshot(main, opt)
    out["buffers_per_worker"] = [{n: b.tolist() for n, b in m.named_buffers()} for m in models]
    return out


def _combine_buffers(models, how: str) -> None:
    if how == "local":
        return
    with torch.no_grad():
        for bufs in zip(*(m.buffers() for m in models)):
            if how == "mean" and bufs[0].dtype.is_floating_point:
                value = sum(bufs[1:], bufs[0].clone()) / len(bufs)
            else:
                value = bufs[0].clone()
            for b in bufs:
                b.copy_(value)


def snapshot(m, opt) -> dict:
    """Parameters, buffers and the optimizer's state and groups, as plain lists."""
    state = opt.state_dict()
    return {
        "params": {n: p.detach().tolist() for n, p in m.named_parameters()},
        "buffers": {n: b.tolist() for n, b in m.named_buffers()},
        "state": {str(i): {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()}
                  for i, s in state["state"].items()},
        "groups": [describe_group(g) for g in state["param_groups"]],
    }


def describe_group(group: dict) -> dict:
    """A param group's hyper-parameters with their types: ``{key: [type, value]}``."""
    def one(v):
        if torch.is_tensor(v):
            return [f"tensor:{v.dtype}", v.item()]
        return [type(v).__name__, v]
    out = {}
    for k, v in group.items():
        if k == "params" or callable(v):
            continue
        out[k] = [one(x) for x in v] if isinstance(v, (tuple, list)) else one(v)
    return out
