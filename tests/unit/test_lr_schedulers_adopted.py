"""Tests for mpisync.worker.schedule: torch's schedulers kept at the global step (one process)."""
from __future__ import annotations

import copy
import io
import pickle
import random
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as lrs
from torch.optim.swa_utils import SWALR

from mpisync.worker.schedule import MODES, Schedules, install_hooks, remove_hooks


@pytest.fixture(autouse=True, scope="module")
def _hooks():
    """The schedulers' constructor hook, as an open SyncReplicasOptimizer holds it."""
    install_hooks()
    yield
    remove_hooks()


WORKERS = 4  # asynchronous mode: each opt.step() covers this many global steps
LOCAL_STEPS = 12
LR_KINDS = ("int", "float", "tensor")


def _lr(kind: str, scale: int):
    """The learning rate of param group ``scale - 1`` as an int, a float or a 0-dim tensor."""
    if kind == "int":
        return scale
    if kind == "float":
        return 0.1 * scale
    return torch.tensor(0.1 * scale)


def _optimizer(kind: str, lr_kind: str, mode: str | None) -> torch.optim.Optimizer:
    """SGD (with momentum) or Adam over two param groups, with a Schedules unless mode is None."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": _lr(lr_kind, scale)}
              for scale in (1, 2)]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(groups, lr=0.1)
    if mode is not None:
        opt._mpisync_schedules = Schedules(mode)
    return opt


def _chained(opt):
    return lrs.ChainedScheduler(
        [lrs.ConstantLR(opt, factor=0.5, total_iters=4), lrs.ExponentialLR(opt, gamma=0.9)],
        optimizer=opt)


def _sequential(opt):
    return lrs.SequentialLR(
        opt, [lrs.LinearLR(opt, start_factor=0.1, total_iters=4),
              lrs.ExponentialLR(opt, gamma=0.9)], milestones=[5])


def _cyclic(opt):
    return lrs.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3, step_size_down=5,
                        mode="triangular2", base_momentum=0.8, max_momentum=0.95)


def _one_cycle(opt):
    return lrs.OneCycleLR(opt, max_lr=0.5, total_steps=WORKERS * LOCAL_STEPS + 4)


# name -> (optimizer kind, factory). Every scheduler here changes lr; CyclicLR and OneCycleLR
# also momentum (SGD) or betas (Adam).
SCHEDULERS = {
    "LambdaLR": ("sgd", lambda opt: lrs.LambdaLR(opt, lambda k: 1.0 / (1 + k))),
    "MultiplicativeLR": ("sgd", lambda opt: lrs.MultiplicativeLR(opt, lambda k: 0.9)),
    "StepLR": ("sgd", lambda opt: lrs.StepLR(opt, step_size=3, gamma=0.5)),
    "MultiStepLR": ("sgd", lambda opt: lrs.MultiStepLR(opt, [2, 5, 11, 23], gamma=0.5)),
    "ConstantLR": ("sgd", lambda opt: lrs.ConstantLR(opt, factor=0.5, total_iters=5)),
    "LinearLR": ("sgd", lambda opt: lrs.LinearLR(opt, start_factor=0.25, total_iters=7)),
    "ExponentialLR": ("sgd", lambda opt: lrs.ExponentialLR(opt, gamma=0.95)),
    "SequentialLR": ("sgd", _sequential),
    "PolynomialLR": ("sgd", lambda opt: lrs.PolynomialLR(opt, total_iters=30, power=2.0)),
    "CosineAnnealingLR": ("sgd", lambda opt: lrs.CosineAnnealingLR(opt, T_max=7, eta_min=0.01)),
    "ChainedScheduler": ("sgd", _chained),
    "CyclicLR-momentum": ("sgd", _cyclic),
    "CyclicLR-betas": ("adam", _cyclic),
    "CosineAnnealingWarmRestarts": (
        "sgd", lambda opt: lrs.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=0.001)),
    "OneCycleLR-momentum": ("sgd", _one_cycle),
    "OneCycleLR-betas": ("adam", _one_cycle),
    "SWALR": ("sgd", lambda opt: SWALR(opt, swa_lr=0.05, anneal_epochs=5)),
}


def _sequence(kind: str, length: int = LOCAL_STEPS, seed: int = 0) -> list[int]:
    """The global step after each local step, for one way of training."""
    rng = random.Random(seed)
    if kind == "sync":
        increments = [1] * length
    elif kind == "backup":  # a dropped worker jumps forward by 2 to 4
        increments = [1] * length
        for index in rng.sample(range(length), 4):
            increments[index] = rng.randint(2, 4)
    elif kind == "kbatch":  # several gradients on the same parameters: +0 or +1
        increments = [0] + [rng.randint(0, 1) for _ in range(length - 2)] + [1]
    else:
        increments = [WORKERS] * length
    global_steps, global_step = [], 0
    for increment in increments:
        global_step += increment
        global_steps.append(global_step)
    return global_steps


SEQUENCES = ("sync", "backup", "kbatch", "async")


def _value(value):
    return ("tensor", value.item()) if isinstance(value, torch.Tensor) else value


def _state(opt, sched) -> list:
    """Every hyper-parameter a scheduler changes, per group, and the scheduler's last lrs."""
    groups = [[(key, _value(group[key])) for key in ("lr", "momentum", "betas") if key in group]
              for group in opt.param_groups]
    return [groups, [_value(lr) for lr in sched.get_last_lr()]]


def _expected_steps(mode: str, calls: int, global_step: int, last: int) -> int:
    """How many times a one-process scheduler must step for one user call."""
    if mode == "local" or (mode == "auto" and calls != 1):
        return 1
    return global_step - last


def _compare(name: str, lr_kind: str, mode: str, global_steps: list[int],
             call_after: set[int] | None = None) -> None:
    """Drive an adopted scheduler and a plain one; compare them after every local step.

    After each local step the global step is set from ``global_steps`` and noted; the
    scheduler is stepped after the local steps in ``call_after`` (every one by default).
    """
    kind, make = SCHEDULERS[name]
    opt = _optimizer(kind, lr_kind, mode)
    sched = make(opt)
    ref_opt = _optimizer(kind, lr_kind, None)
    ref = make(ref_opt)
    assert _state(opt, sched) == _state(ref_opt, ref)
    last, calls = 0, 0
    for index, global_step in enumerate(global_steps):
        opt.step()
        opt._mpisync_schedules.note_step(global_step)
        ref_opt.step()
        calls += 1
        if call_after is not None and index not in call_after:
            continue
        sched.step()
        for _ in range(_expected_steps(mode, calls, global_step, last)):
            ref.step()
        last, calls = global_step, 0
        assert _state(opt, sched) == _state(ref_opt, ref), (index, global_step)


@pytest.mark.parametrize("sequence", SEQUENCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_per_iteration_matches_one_process_schedule(name, mode, sequence):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lr_kind in LR_KINDS:
            _compare(name, lr_kind, mode, _sequence(sequence))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["StepLR", "SequentialLR", "ChainedScheduler", "CyclicLR-betas"])
def test_per_epoch_cadence(name, mode):
    epoch_ends = {1, 4, 5, 9, 11}  # epochs of 2, 3, 1, 4 and 2 iterations
    for sequence in SEQUENCES:
        _compare(name, "float", mode, _sequence(sequence), call_after=epoch_ends)


def _step_lr_run(mode: str, global_steps: list[int], epoch_ends: set[int] | None) -> list[float]:
    """The lr after each scheduler call of StepLR(step_size=1, gamma=0.5) from lr 1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    opt._mpisync_schedules = Schedules(mode)
    sched = lrs.StepLR(opt, step_size=1, gamma=0.5)
    lrs_seen = []
    for index, global_step in enumerate(global_steps):
        opt.step()
        opt._mpisync_schedules.note_step(global_step)
        if epoch_ends is None or index in epoch_ends:
            sched.step()
            lrs_seen.append(opt.param_groups[0]["lr"])
    return lrs_seen


def test_auto_counts_epochs_and_follows_iterations():
    global_steps = [4, 8, 12, 16, 20, 24]
    assert _step_lr_run("auto", global_steps, None) == [0.5 ** g for g in global_steps]
    assert _step_lr_run("auto", global_steps, {2, 5}) == [0.5, 0.25]
    assert _step_lr_run("global_step", global_steps, {2, 5}) == [0.5 ** 12, 0.5 ** 24]
    assert _step_lr_run("local", global_steps, None) == [0.5 ** k for k in range(1, 7)]


def test_auto_per_iteration_and_per_epoch_on_one_optimizer():
    opt = _optimizer("sgd", "float", "auto")
    per_iteration = lrs.MultiplicativeLR(opt, lambda k: 0.9)
    per_epoch = lrs.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = _optimizer("sgd", "float", None)
    ref_iteration = lrs.MultiplicativeLR(ref_opt, lambda k: 0.9)
    ref_epoch = lrs.StepLR(ref_opt, step_size=1, gamma=0.5)
    last = 0
    for index, global_step in enumerate(_sequence("backup")):
        opt.step()
        opt._mpisync_schedules.note_step(global_step)
        ref_opt.step()
        per_iteration.step()
        for _ in range(global_step - last):
            ref_iteration.step()
        last = global_step
        if index % 3 == 2:
            per_epoch.step()
            ref_epoch.step()
        assert _state(opt, per_iteration) == _state(ref_opt, ref_iteration)
    assert per_epoch.last_epoch == ref_epoch.last_epoch == 4
    assert opt._mpisync_schedules.follows_global_step


def test_two_calls_without_a_step_count_as_epochs():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    opt._mpisync_schedules = schedules = Schedules("auto")
    sched = lrs.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    schedules.note_step(3)
    sched.step()  # one opt.step() since adoption: per iteration, to global step 3
    assert opt.param_groups[0]["lr"] == 0.5 ** 3
    assert schedules.follows_global_step
    sched.step()  # no opt.step() in between: a per-epoch call, +1
    assert opt.param_groups[0]["lr"] == 0.5 ** 4
    assert not schedules.follows_global_step


def test_follows_global_step():
    for mode, expected in (("auto", True), ("global_step", True), ("local", False)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        opt._mpisync_schedules = schedules = Schedules(mode)
        assert not schedules.follows_global_step
        sched = lrs.ExponentialLR(opt, gamma=0.5)
        assert schedules.follows_global_step == (mode == "global_step")
        opt.step()
        schedules.note_step(1)
        sched.step()
        assert schedules.follows_global_step == expected


@pytest.mark.parametrize("mode", ["auto", "global_step"])
@pytest.mark.parametrize("name", ["StepLR", "SequentialLR", "ChainedScheduler",
                                  "OneCycleLR-betas", "CyclicLR-momentum"])
def test_advance_to_then_user_call_adds_the_rest(name, mode):
    kind, make = SCHEDULERS[name]
    opt = _optimizer(kind, "float", mode)
    schedules = opt._mpisync_schedules
    sched = make(opt)
    ref_opt = _optimizer(kind, "float", None)
    ref = make(ref_opt)
    position = 0

    def move_ref_to(global_step):
        nonlocal position
        for _ in range(global_step - position):
            ref.step()
        position = global_step

    for index, global_step in enumerate(_sequence("async")):
        opt.step()
        ref_opt.step()
        middle = global_step - WORKERS // 2
        schedules.advance_to(middle)
        if mode == "global_step" or index > 0:  # auto: not classified before the first call
            move_ref_to(middle)
        assert _state(opt, sched) == _state(ref_opt, ref), (index, "advance_to")
        schedules.note_step(global_step)
        sched.step()
        move_ref_to(global_step)
        assert _state(opt, sched) == _state(ref_opt, ref), (index, global_step)
    before = _state(opt, sched)
    with pytest.raises(ValueError, match="back from global step"):
        schedules.advance_to(position - 1)
    assert _state(opt, sched) == before


def test_advance_to_leaves_epoch_and_local_schedulers():
    for mode, epoch_ends in (("auto", {1, 3}), ("local", None)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        opt._mpisync_schedules = schedules = Schedules(mode)
        sched = lrs.StepLR(opt, step_size=1, gamma=0.5)
        for index, global_step in enumerate([4, 8, 12, 16]):
            opt.step()
            schedules.note_step(global_step)
            if epoch_ends is None or index in epoch_ends:
                sched.step()
        schedules.advance_to(100)
        assert sched.last_epoch == (2 if mode == "auto" else 4)


def test_state_dict_unchanged_by_adoption():
    for name, (kind, make) in SCHEDULERS.items():
        opt = _optimizer(kind, "tensor", "global_step")
        sched = make(opt)
        ref_opt = _optimizer(kind, "tensor", None)
        ref = make(ref_opt)
        assert type(sched) is not type(ref) and isinstance(sched, type(ref)), name
        assert type(sched).__name__ == type(ref).__name__, name
        assert type(sched).__qualname__ == type(ref).__qualname__, name
        assert sched.__dict__.keys() == ref.__dict__.keys(), name
        for global_step in (2, 5):
            opt.step()
            opt._mpisync_schedules.note_step(global_step)
            sched.step()
        state = sched.state_dict()
        assert state.keys() == ref.state_dict().keys(), name
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded.keys() == state.keys(), name
        assert copy.deepcopy(state).keys() == state.keys(), name
        ref.load_state_dict(loaded)
        assert ref.state_dict().keys() == state.keys(), name
        ref_opt.load_state_dict(opt.state_dict())
        assert _state(ref_opt, ref) == _state(opt, sched), name


def test_resumed_schedule_continues_at_the_global_step():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    opt._mpisync_schedules = Schedules("auto")
    sched = lrs.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    opt._mpisync_schedules.note_step(5)
    sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    resumed_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed_opt._mpisync_schedules = schedules = Schedules("auto", global_step=5)
    resumed = lrs.StepLR(resumed_opt, step_size=1, gamma=0.5)
    resumed_opt.load_state_dict(saved_opt)
    resumed.load_state_dict(saved_sched)
    resumed_opt.step()
    schedules.note_step(9)
    resumed.step()
    assert resumed.last_epoch == 9
    assert resumed_opt.param_groups[0]["lr"] == 0.5 ** 9


def test_copies_and_pickles_are_plain_schedulers():
    opt = _optimizer("sgd", "float", "global_step")
    sched = lrs.StepLR(opt, step_size=3, gamma=0.5)
    for copied in (copy.deepcopy(sched), copy.copy(sched),
                   pickle.loads(pickle.dumps(sched, protocol=0)),
                   pickle.loads(pickle.dumps(sched))):
        assert type(copied) is lrs.StepLR
        assert copied.state_dict() == sched.state_dict()
    buffer = io.BytesIO()
    torch.save(sched, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is lrs.StepLR


def test_adopted_classes_are_cached_and_hooks_idempotent():
    init = lrs.LRScheduler.__init__
    install_hooks()                 # counted: the hook stays until the last remove_hooks()
    assert lrs.LRScheduler.__init__ is init
    remove_hooks()
    assert lrs.LRScheduler.__init__ is init
    opt = _optimizer("sgd", "float", "auto")
    first, second = lrs.StepLR(opt, step_size=2), lrs.StepLR(opt, step_size=3)
    assert type(first) is type(second)
    opt._mpisync_schedules.adopt(first)  # adopting again changes nothing
    assert type(first) is type(second)
    other = Schedules("global_step")  # a scheduler moved to another Schedules
    opt._mpisync_schedules = other
    other.adopt(first)
    assert type(first) is type(second)
    opt.step()
    other.note_step(4)
    first.step()
    assert first.last_epoch == 4


def test_optimizer_without_schedules_is_untouched():
    opt = _optimizer("sgd", "float", None)
    constant, exponential = lrs.ConstantLR(opt, total_iters=3), lrs.ExponentialLR(opt, gamma=0.9)
    assert type(constant) is lrs.ConstantLR and type(exponential) is lrs.ExponentialLR
    sequential = lrs.SequentialLR(opt, [constant, exponential], [2])
    chained = lrs.ChainedScheduler([constant, exponential], optimizer=opt)
    assert type(sequential) is lrs.SequentialLR and type(chained) is lrs.ChainedScheduler
    assert type(lrs.StepLR(opt, step_size=2)) is lrs.StepLR
    assert type(SWALR(opt, swa_lr=0.05)) is SWALR


def test_explicit_epoch_passes_through():
    opt = _optimizer("sgd", "float", "global_step")
    sched = lrs.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = _optimizer("sgd", "float", None)
    ref = lrs.StepLR(ref_opt, step_size=1, gamma=0.5)
    opt.step()
    ref_opt.step()
    opt._mpisync_schedules.note_step(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates the epoch argument
        sched.step(3)
        ref.step(3)
    assert _state(opt, sched) == _state(ref_opt, ref)
    sched.step()  # the user call still brings it from global step 0 to 8
    for _ in range(8):
        ref.step()
    assert _state(opt, sched) == _state(ref_opt, ref)


def test_warm_restarts_with_fractional_epochs_pass_through():
    kind, make = SCHEDULERS["CosineAnnealingWarmRestarts"]
    opt = _optimizer(kind, "float", "global_step")
    sched = make(opt)
    ref_opt = _optimizer(kind, "float", None)
    ref = make(ref_opt)
    iterations = 4
    for epoch in range(3):
        for index in range(iterations):
            opt.step()
            ref_opt.step()
            opt._mpisync_schedules.note_step(WORKERS * (epoch * iterations + index + 1))
            sched.step(epoch + index / iterations)
            ref.step(epoch + index / iterations)
            assert _state(opt, sched) == _state(ref_opt, ref)


def test_reduce_on_plateau_passes_through():
    opt = _optimizer("sgd", "float", "global_step")
    sched = lrs.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    ref_opt = _optimizer("sgd", "float", None)
    ref = lrs.ReduceLROnPlateau(ref_opt, patience=1, factor=0.5)
    assert type(sched) is lrs.ReduceLROnPlateau
    for index, global_step in enumerate(_sequence("async")):
        opt.step()
        ref_opt.step()
        opt._mpisync_schedules.note_step(global_step)
        metric = 1.0 if index < 3 else 2.0
        sched.step(metric)
        ref.step(metric)
        assert _state(opt, sched) == _state(ref_opt, ref)
    assert sched.state_dict() == ref.state_dict()
    assert not opt._mpisync_schedules.follows_global_step


def test_child_called_directly_passes_through():
    opt = _optimizer("sgd", "float", "global_step")
    child = lrs.ExponentialLR(opt, gamma=0.5)
    chained = lrs.ChainedScheduler([child], optimizer=opt)
    opt.step()
    opt._mpisync_schedules.note_step(4)
    child.step()
    assert child.last_epoch == 1
    chained.step()
    assert child.last_epoch == 5
    opt._mpisync_schedules.advance_to(6)
    assert child.last_epoch == 7


class _Delegating(lrs.LRScheduler):
    """A user scheduler that steps another one, held outside ``_schedulers``."""

    def __init__(self, optimizer, inner):
        self.inner = inner
        super().__init__(optimizer)

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch=None):
        self.inner.step()
        super().step(epoch)


@pytest.mark.parametrize("mode", MODES)
def test_scheduler_stepping_another_passes_its_calls_through(mode):
    def make(opt):
        inner = lrs.StepLR(opt, step_size=2, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the constructor steps inner before opt.step()
            return _Delegating(opt, inner)

    opt = _optimizer("sgd", "float", mode)
    outer = make(opt)
    ref_opt = _optimizer("sgd", "float", None)
    ref = make(ref_opt)
    assert _state(opt, outer) == _state(ref_opt, ref)
    last = 0
    for global_step in _sequence("backup"):
        opt.step()
        ref_opt.step()
        opt._mpisync_schedules.note_step(global_step)
        outer.step()
        for _ in range(_expected_steps(mode, 1, global_step, last)):
            ref.step()
        last = global_step
        assert _state(opt, outer) == _state(ref_opt, ref)
        assert outer.inner.last_epoch == ref.inner.last_epoch


def test_bad_arguments():
    with pytest.raises(ValueError, match="'auto', 'global_step', 'local'"):
        Schedules("per_step")
    with pytest.raises(ValueError, match="global_step must be >= 0"):
        Schedules(global_step=-1)
    with pytest.raises(TypeError):
        Schedules(global_step=1.5)
    schedules = Schedules()
    assert (schedules.mode, schedules.global_step) == ("auto", 0)
    schedules.note_step(3)
    assert schedules.global_step == 3
    with pytest.raises(ValueError, match="must not decrease: got 2 after 3"):
        schedules.note_step(2)
    plain = lrs.StepLR(_optimizer("sgd", "float", None), step_size=1)
    with pytest.raises(ValueError, match="_mpisync_schedules"):
        schedules.adopt(plain)
    assert type(plain) is lrs.StepLR
    with pytest.raises(TypeError, match="LRScheduler"):
        schedules.adopt(object())
