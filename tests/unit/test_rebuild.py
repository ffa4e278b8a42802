"""One-process tests for mpisync.protocol.rebuild: optimizer recipes, partial builds, refusals."""

from __future__ import annotations

import enum
import math
import pickle

import pytest
import torch

from mpisync.errors import ConfigError
from mpisync.protocol.rebuild import TORCH_BOOKKEEPING, OptimizerRecipe, recipe_of

STEPS = 4


class ScaledSGD(torch.optim.Optimizer):
    """SGD whose step is scaled by a constructor argument kept only as an attribute."""

    def __init__(self, params, lr=0.1, scale=1.0):
        super().__init__(params, {"lr": lr})
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.scale)


class CoefSGD(torch.optim.Optimizer):
    """SGD with a required constructor argument that is not in ``defaults``."""

    def __init__(self, params, coef, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.coef = coef
        self.powers = [coef ** k for k in range(3)]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * self.coef, alpha=-group["lr"])


class RenamedDefaults(torch.optim.Optimizer):
    """Its ``defaults`` key is not the name of the constructor argument."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, {"lr": lr, "beta": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * group["beta"])


class WarmStart(torch.optim.Optimizer):
    """Fills its state in the constructor and keeps references to its parameters."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.first = self.param_groups[0]["params"][0]
        self.first_row = self.first.view(-1)[:1]
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["velocity"] = torch.ones_like(p)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    velocity = self.state[p]["velocity"]
                    velocity.mul_(0.5).add_(p.grad)
                    p.add_(velocity, alpha=-group["lr"])


class KeywordSGD(torch.optim.SGD):
    """Passes every keyword argument through."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


def make_params(seed=0, shapes=((4, 3), (3,), (2, 3), (2,), (5,))):
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.nn.Parameter(torch.randn(shape, generator=gen))
            for i, shape in enumerate(shapes)}


def groups_of(params, hypers):
    """Split the params round-robin into len(hypers) groups with these hyper-parameters."""
    names = list(params)
    return [{"params": [params[n] for n in names[i::len(hypers)]], **hyper}
            for i, hyper in enumerate(hypers)]


def name_of(params):
    return {id(p): name for name, p in params.items()}


def clones(params):
    return {name: torch.nn.Parameter(p.detach().clone()) if p.is_floating_point()
            else p.detach().clone() for name, p in params.items()}


def assert_same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), where


def step_both(original, params, rebuilt, copies, steps=STEPS, seed=1):
    """Apply the same gradients to both optimizers; parameters and state stay identical."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for name, p in params.items():
            if p.is_floating_point():
                grad = torch.randn(p.shape, generator=gen)
                p.grad, copies[name].grad = grad.clone(), grad.clone()
        original.step()
        rebuilt.step()
        for name, p in params.items():
            assert torch.equal(p, copies[name]), f"step {step}: {name}"
            assert_same(original.state[p], rebuilt.state[copies[name]], f"state of {name}")
    for ours, theirs in zip(original.param_groups, rebuilt.param_groups):
        assert_same({k: v for k, v in ours.items() if k != "params"},
                    {k: v for k, v in theirs.items() if k != "params"}, "group")


def torch_optimizers():
    """Every optimizer class in torch.optim that takes dense gradients and no closure
    (SparseAdam: tests/mpi/test_tables_jobs.py)."""
    return sorted((c for c in vars(torch.optim).values() if isinstance(c, type)
                   and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
                   and c not in (torch.optim.LBFGS, torch.optim.SparseAdam)),
                  key=lambda c: c.__name__)


CASES = {
    "SGD": ({"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            [{"lr": 0.05, "momentum": 0.5, "dampening": 0.1, "nesterov": False}, {}]),
    "SGD-foreach": ({"lr": 0.1, "momentum": 0.9, "foreach": True}, [{"lr": 0.2}, {}]),
    "Adam": ({"lr": 1e-2, "amsgrad": True}, [{"lr": 5e-3, "betas": (0.8, 0.99)}, {"eps": 1e-6}]),
    "Adam-tensor-lr": ({"lr": torch.tensor(0.01), "weight_decay": 0.1},
                       [{"lr": torch.tensor(0.02)}, {}]),
    "Adam-tensor-betas": ({"lr": 0.01, "betas": (torch.tensor(0.8), torch.tensor(0.95))},
                          [{"amsgrad": True}, {}]),
    "Adam-foreach": ({"lr": 1e-2, "foreach": True, "maximize": True}, [{"lr": 3e-3}, {}]),
    "Adam-fused": ({"lr": 1e-2, "fused": True}, [{"lr": 3e-3, "weight_decay": 0.1}, {}]),
    "AdamW": ({"lr": 1e-2, "weight_decay": 0.05}, [{"weight_decay": 0.5, "amsgrad": True}, {}]),
    "Adagrad": ({"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
                [{"lr": 0.05, "weight_decay": 0.1}, {}]),
    "Adadelta": ({"lr": 1.0, "rho": 0.8}, [{"rho": 0.95, "weight_decay": 0.1}, {}]),
    "Adamax": ({"lr": 2e-3}, [{"betas": (0.7, 0.9)}, {}]),
    "ASGD": ({"lr": 0.05, "t0": 1.0, "lambd": 1e-3}, [{"alpha": 0.5, "t0": 2.0}, {}]),
    "NAdam": ({"lr": 2e-3, "momentum_decay": 3e-3}, [{"decoupled_weight_decay": True,
                                                       "weight_decay": 0.1}, {}]),
    "RAdam": ({"lr": 1e-3}, [{"decoupled_weight_decay": True, "weight_decay": 0.1}, {}]),
    "RMSprop": ({"lr": 1e-2, "centered": True}, [{"momentum": 0.9, "alpha": 0.9}, {}]),
    "Rprop": ({"lr": 1e-2, "etas": (0.4, 1.3)}, [{"step_sizes": (1e-5, 10.0)}, {}]),
    "Adafactor": ({"lr": 1e-2, "beta2_decay": -0.7}, [{"d": 2.0, "weight_decay": 0.1}, {}]),
    "Muon": ({"lr": 2e-2, "momentum": 0.9}, [{"nesterov": False, "ns_steps": 3}, {}]),
}


def test_every_torch_optimizer_is_covered():
    covered = {name.split("-")[0] for name in CASES}
    assert {c.__name__ for c in torch_optimizers()} <= covered


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_optimizer_rebuilds_exactly(case):
    cls = getattr(torch.optim, case.split("-")[0])
    defaults, hypers = CASES[case]
    shapes = ((4, 3), (3, 5), (2, 3), (5, 2), (3, 3)) if cls is torch.optim.Muon else None
    params = make_params(shapes=shapes) if shapes else make_params()
    original = cls(groups_of(params, hypers), **defaults)
    recipe = recipe_of(original, name_of(params))
    assert recipe.cls is cls and recipe.construct == "call" and recipe.attrs == {}
    assert [len(names) for _, names in recipe.groups] == [3, 2]
    copies = clones(params)
    rebuilt = recipe.build(copies)
    assert type(rebuilt) is cls
    step_both(original, params, rebuilt, copies)


def test_partial_build_keeps_group_order_and_hyper_parameters():
    params = make_params()
    hypers = [{"lr": 0.1}, {"lr": 0.2, "momentum": 0.5}, {"lr": 0.3, "weight_decay": 0.1}]
    original = torch.optim.SGD(groups_of(params, hypers), lr=0.01)
    recipe = recipe_of(original, name_of(params))
    assert [names for _, names in recipe.groups] == [("p0", "p3"), ("p1", "p4"), ("p2",)]
    subset = {"p4": params["p4"].detach().clone(), "p0": params["p0"].detach().clone(),
              "frozen": torch.zeros(2)}
    built = recipe.build(subset)
    assert [g["params"] for g in built.param_groups] == [[subset["p0"]], [subset["p4"]], []]
    for ours, theirs in zip(original.param_groups, built.param_groups):
        assert {k: v for k, v in ours.items() if k != "params"} == \
            {k: v for k, v in theirs.items() if k != "params"}
    assert recipe.build({"frozen": torch.zeros(2)}) is None


def test_builds_do_not_share_mutable_values():
    params = make_params()
    original = torch.optim.Adam(params.values(), lr=torch.tensor(0.01))
    original.extra = {"table": [1, 2]}
    recipe = recipe_of(original, name_of(params))
    first, second = recipe.build(clones(params)), recipe.build(clones(params))
    assert first.extra == second.extra and first.extra is not second.extra
    assert first.param_groups[0]["lr"] is not second.param_groups[0]["lr"]
    first.param_groups[0]["lr"].fill_(1.0)
    assert second.param_groups[0]["lr"].item() == pytest.approx(0.01)


def test_constructor_argument_kept_as_attribute():
    params = make_params()
    original = ScaledSGD(groups_of(params, [{"lr": 0.5}, {}]), lr=0.1, scale=3.0)
    recipe = recipe_of(original, name_of(params))
    assert recipe.construct == "call" and recipe.kwargs == {"lr": 0.1}
    assert recipe.attrs == {"scale": 3.0}
    copies = clones(params)
    rebuilt = recipe.build(copies)
    assert rebuilt.scale == 3.0
    step_both(original, params, rebuilt, copies)


def test_required_constructor_argument_uses_fallback_construction():
    params = make_params()
    original = CoefSGD(groups_of(params, [{"lr": 0.5}, {}]), 0.25, lr=0.1)
    recipe = recipe_of(original, name_of(params))
    assert recipe.construct == "new" and recipe.kwargs == {"lr": 0.1}
    assert recipe.attrs == {"coef": 0.25, "powers": [1.0, 0.25, 0.0625]}
    copies = clones(params)
    rebuilt = recipe.build(copies)
    assert type(rebuilt) is CoefSGD and rebuilt.defaults == original.defaults
    step_both(original, params, rebuilt, copies)


def test_defaults_under_other_names_use_fallback_construction():
    params = make_params()
    original = RenamedDefaults(params.values(), lr=0.1, momentum=0.5)
    recipe = recipe_of(original, name_of(params))
    assert recipe.construct == "new" and recipe.kwargs == {"lr": 0.1, "beta": 0.5}
    copies = clones(params)
    step_both(original, params, recipe.build(copies), copies)


def test_constructor_state_and_parameter_references_are_rebuilt_by_the_constructor():
    params = make_params()
    original = WarmStart(groups_of(params, [{"lr": 0.5}, {}]))
    recipe = recipe_of(original, name_of(params))
    assert recipe.construct == "call" and recipe.attrs == {}
    copies = clones(params)
    rebuilt = recipe.build(copies)
    assert rebuilt.first is copies["p0"]
    assert len(rebuilt.state) == len(copies)
    step_both(original, params, rebuilt, copies)


def test_lr_scheduler_wrapper_is_ignored_and_initial_lr_kept():
    params = make_params()
    original = torch.optim.SGD(params.values(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(original, step_size=1, gamma=0.5)
    original.step()
    scheduler.step()
    recipe = recipe_of(original, name_of(params))
    assert recipe.attrs == {}
    assert recipe.groups[0][0]["initial_lr"] == 0.1 and recipe.groups[0][0]["lr"] == 0.05


def test_plain_attributes_are_carried():
    params = make_params()
    original = ScaledSGD(params.values())
    original.table = {"mode": Mode.FAST, "fn": math.sqrt, "dtype": torch.float64,
                      "mask": torch.tensor([1.0, 2.0]), "shape": torch.Size([2]),
                      "sets": {1, 2}, "raw": b"x", "z": 1j, "none": None,
                      "nan": float("nan"), "holes": torch.tensor([math.nan, 1.0])}
    recipe = recipe_of(original, name_of(params))
    rebuilt = pickle.loads(pickle.dumps(recipe)).build(clones(params))
    assert rebuilt.table["mode"] is Mode.FAST and rebuilt.table["fn"] is math.sqrt
    assert torch.equal(rebuilt.table["mask"], original.table["mask"])
    assert math.isnan(rebuilt.table["nan"]) and rebuilt.table["holes"][1] == 1.0
    assert recipe.attrs["table"] is not original.table
    assert "mode" in recipe.summary()["attrs"]


def test_constructor_taking_any_keyword_gets_every_default():
    params = make_params()
    original = KeywordSGD(params.values(), lr=0.1, momentum=0.9, nesterov=True)
    recipe = recipe_of(original, name_of(params))
    assert recipe.construct == "call" and recipe.kwargs == original.defaults
    copies = clones(params)
    step_both(original, params, recipe.build(copies), copies)


def test_integer_parameter_is_accepted_and_left_unchanged():
    params = make_params()
    params["count"] = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    original = torch.optim.Adam(params.values(), lr=0.01)
    recipe = recipe_of(original, name_of(params))
    copies = clones(params)
    rebuilt = recipe.build(copies)
    step_both(original, params, rebuilt, copies)
    assert torch.equal(copies["count"], torch.arange(6).reshape(2, 3))
    assert not copies["count"].requires_grad


def test_recipe_survives_pickle():
    params = make_params()
    original = ScaledSGD(groups_of(params, [{"lr": 0.5}, {"lr": 0.2}]), scale=2.0)
    recipe = pickle.loads(pickle.dumps(recipe_of(original, name_of(params))))
    copies = clones(params)
    step_both(original, params, recipe.build(copies), copies)


def test_summary_names_the_group_that_differs():
    params = make_params()
    hypers = [{"lr": 0.1}, {"lr": 0.2}]
    first = recipe_of(torch.optim.SGD(groups_of(params, hypers)), name_of(params))
    hypers[1]["lr"] = 0.2000001
    second = recipe_of(torch.optim.SGD(groups_of(params, hypers)), name_of(params))
    ours, theirs = first.summary(), second.summary()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == ["group 1 hyper-parameters"]
    assert ours["class"] == "torch.optim.sgd.SGD" and ours["groups"] == "2"
    assert all(isinstance(v, str) for v in ours.values())


def test_summary_tells_tensor_values_apart():
    params = make_params()
    one = recipe_of(torch.optim.Adam(params.values(), lr=torch.tensor(0.01)), name_of(params))
    two = recipe_of(torch.optim.Adam(params.values(), lr=torch.tensor(0.0100001)),
                    name_of(params))
    assert one.summary()["group 0 hyper-parameters"] != two.summary()["group 0 hyper-parameters"]
    assert one.summary()["kwargs"] != two.summary()["kwargs"]


def test_lbfgs_is_refused():
    params = make_params()
    with pytest.raises(ConfigError, match=r"LBFGS.*closure.*first-order"):
        recipe_of(torch.optim.LBFGS(params.values()), name_of(params))


def test_class_defined_in_a_function_is_refused():
    class LocalSGD(torch.optim.SGD):
        pass

    params = make_params()
    with pytest.raises(ConfigError, match=r"LocalSGD.*module level"):
        recipe_of(LocalSGD(params.values(), lr=0.1), name_of(params))


@pytest.mark.parametrize("attr", ["lambda", "alias", "parameter", "object", "local-enum"])
def test_attribute_that_cannot_be_rebuilt_is_refused(attr):
    local = enum.Enum("Local", "A B")
    params = make_params()
    original = ScaledSGD(params.values())
    value, pattern = {
        "lambda": (lambda s: s * 2, r"'schedule'.*<lambda>.*cannot rebuild"),
        "alias": (params["p1"].detach()[1:], r"'schedule'.*sharing storage.*parameters"),
        "parameter": (torch.nn.Parameter(torch.ones(2)), r"'schedule'.*Parameter"),
        "object": ([object()], r"'schedule'.*builtins.object"),
        "local-enum": (local.A, r"'schedule'.*pickled"),
    }[attr]
    original.schedule = value
    with pytest.raises(ConfigError, match=pattern):
        recipe_of(original, name_of(params))


def test_neither_construction_works():
    params = make_params()
    original = CoefSGD(params.values(), 0.5)
    original.hook = lambda: None
    with pytest.raises(ConfigError, match=r"CoefSGD.*missing.*coef.*'hook'"):
        recipe_of(original, name_of(params))


def test_user_step_override_and_unnamed_parameter_are_refused():
    params = make_params()
    original = torch.optim.SGD(params.values(), lr=0.1)
    with pytest.raises(ConfigError, match="no name"):
        recipe_of(original, {id(params["p0"]): "p0"})
    original.step = lambda closure=None: None
    with pytest.raises(ConfigError, match="'step'"):
        recipe_of(original, name_of(params))


def test_recipe_rejects_unknown_construction():
    assert "state" in TORCH_BOOKKEEPING and "param_groups" in TORCH_BOOKKEEPING
    with pytest.raises(ValueError, match="construct"):
        OptimizerRecipe(torch.optim.SGD, {}, {}, (), "copy")
