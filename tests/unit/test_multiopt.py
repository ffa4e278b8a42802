"""One-process tests for mpisync.protocol.multi: several optimizers joined as one.

The joint optimizer's groups are the inner optimizers' own dicts, its state theirs, its step
and its state dict round trip equal to the inner optimizers'; the recipe rebuilds it over a
subset of the parameters; bad lists are refused with messages that say what is wrong.
"""
from __future__ import annotations

import pickle

import pytest
import torch

import mpisync
from mpisync.protocol.multi import (
    JointOptimizer,
    JointRecipe,
    inner_of,
    join_state_dicts,
    joint_problem,
    sole_holder,
    split_state_dict,
)
from mpisync.protocol.rebuild import changed_settings, recipe_of, settings_of


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def optimizers(m: torch.nn.Sequential) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam([{"params": [m[0].weight]}, {"params": [m[0].bias], "lr": 0.2}],
                             lr=0.1),
            torch.optim.SGD(m[2].parameters(), lr=0.05, momentum=0.9)]


def train(m, step, zero, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        zero()
        m(torch.randn(5, 3, generator=g)).square().sum().backward()
        step()


def test_groups_are_the_inner_optimizers_dicts_and_a_scheduler_on_one_is_seen():
    m = model()
    a, b = optimizers(m)
    joint = JointOptimizer([a, b])
    assert len(joint.param_groups) == 3
    assert all(x is y for x, y in zip(joint.param_groups, a.param_groups + b.param_groups))
    sched = torch.optim.lr_scheduler.StepLR(a, step_size=1, gamma=0.5)
    train(m, lambda: (joint.step(), sched.step()), joint.zero_grad, steps=1)
    assert [g["lr"] for g in joint.param_groups] == [0.05, 0.1, 0.05]
    assert inner_of(joint, joint.param_groups[2]) is b
    assert inner_of(joint, {**joint.param_groups[1]}) is a    # a copy: by its parameters
    assert inner_of(a, a.param_groups[0]) is a


def test_step_and_state_equal_the_inner_optimizers_stepped_alone():
    m, twin = model(), model()
    joint = JointOptimizer(optimizers(m))
    alone = optimizers(twin)
    train(m, joint.step, joint.zero_grad)
    train(twin, lambda: [o.step() for o in alone], lambda: [o.zero_grad() for o in alone])
    for p, q in zip(m.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert len(joint.state) == 4
    assert torch.equal(joint.state[m[2].weight]["momentum_buffer"],
                       alone[1].state[twin[2].weight]["momentum_buffer"])
    assert m[0].weight in joint.state and torch.zeros(1) not in joint.state
    sd = joint.state_dict()
    assert _same(sd, join_state_dicts([o.state_dict() for o in alone]))


def _same(x, y) -> bool:
    if torch.is_tensor(x):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


def test_state_dict_round_trip_loads_each_inner_optimizer():
    m = model()
    joint = JointOptimizer(optimizers(m))
    train(m, joint.step, joint.zero_grad)
    sd = joint.state_dict()
    parts = split_state_dict(sd, joint.counts())
    assert [sorted(p["state"]) for p in parts] == [[0, 1], [0, 1]]
    assert _same(join_state_dicts(parts), sd)
    fresh = model()
    other = JointOptimizer(optimizers(fresh))
    groups = other.param_groups
    other.load_state_dict(sd)
    assert other.param_groups is groups            # refreshed in place
    assert all(x is y for x, y in zip(groups, [g for o in other.optimizers
                                               for g in o.param_groups]))
    assert _same(other.state_dict(), sd)
    with pytest.raises(ValueError, match=r"the state has 2 param groups, the optimizers 3"):
        split_state_dict({"state": {}, "param_groups": sd["param_groups"][:2]}, [2, 1])


def test_recipe_rebuilds_over_a_subset_with_empty_groups_where_nothing_is_held():
    m = model()
    joint = JointOptimizer(optimizers(m))
    names = dict(m.named_parameters())
    name_of = {id(p): n for n, p in names.items()}
    recipe = pickle.loads(pickle.dumps(JointRecipe(tuple(recipe_of(o, name_of)
                                                         for o in joint.optimizers))))
    assert len(recipe.groups) == 3
    assert recipe.summary()["optimizers"] == "2"
    assert recipe.summary()["optimizer 1 class"] == "torch.optim.sgd.SGD"
    built = recipe.build({"2.weight": torch.zeros(2, 4, requires_grad=True)})
    assert [type(o) for o in built.optimizers] == [torch.optim.Adam, torch.optim.SGD]
    assert [len(g["params"]) for g in built.param_groups] == [0, 0, 1]
    assert [g["lr"] for g in built.param_groups] == [0.1, 0.2, 0.05]
    assert recipe.build({"elsewhere": torch.zeros(1)}) is None


def test_settings_of_a_joint_optimizer_are_each_inner_optimizers():
    m = model()
    a, b = optimizers(m)
    joint = JointOptimizer([a, b])
    settings = settings_of(joint)
    assert changed_settings(settings, joint) == []
    b.custom = 3
    assert changed_settings(settings, joint) == []     # not there at set-up: not watched
    settings = settings_of(joint)
    b.custom = 4
    assert changed_settings(settings, joint) == ["1.custom"]


def test_add_param_group_is_refused():
    m = model()
    joint = JointOptimizer(optimizers(m))
    with pytest.raises(TypeError, match="add it to one of the inner optimizers"):
        joint.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("given, expected", [
    ([], "the list of optimizers is empty"),
    ("optimizer", "expected a list of torch optimizers, got str"),
    (["not one"], "optimizers[0] is of type str, not a torch.optim.Optimizer"),
])
def test_refused_lists(given, expected):
    assert joint_problem(given, []).startswith(expected)


def test_a_parameter_in_two_optimizers_or_in_none_is_refused_by_name():
    m = model()
    named = list(m.named_parameters())
    a, b = optimizers(m)
    twice = torch.optim.SGD([m[0].bias], lr=0.1)
    assert joint_problem([a, b, twice], named) == (
        "parameter '0.bias' is in optimizers[0] and in optimizers[2]; each parameter "
        "belongs to one optimizer")
    assert joint_problem([a], named) == (
        "parameter '2.weight' of named_parameters is in no optimizer of the list (1 given); "
        "give it to one of them (or set requires_grad=False to keep it frozen)")
    m[2].requires_grad_(False)
    assert joint_problem([a], named) is None          # frozen parameters may stay out
    assert joint_problem([a, b], named) is None


def test_a_table_in_no_optimizer_is_refused_frozen_or_not():
    """A table lives on the ps ranks of the optimizer that holds it: one held by none
    (frozen too, unlike a dense parameter) could not be looked up."""
    table = mpisync.EmbeddingBag(10, 4, mode="sum")
    head = torch.nn.Linear(4, 1)
    named = [("table.weight", table.weight), *head.named_parameters()]
    dense = torch.optim.SGD(head.parameters(), lr=0.1)
    expected = ("table 'table.weight' of named_parameters is in no optimizer of the list (1 "
                "given); a table lives on the ps ranks of the optimizer that holds it: give it "
                "to one of them (with requires_grad=False it is looked up and never stepped)")
    assert joint_problem([dense], named) == expected
    table.weight.requires_grad_(False)
    assert joint_problem([dense], named) == expected
    held = torch.optim.Adagrad(table.parameters(), lr=0.1)   # frozen and held: accepted
    assert joint_problem([dense, held], named) is None


def test_a_scheduler_over_the_joint_optimizer_finds_the_hyper_parameters_they_share():
    """OneCycleLR looks for momentum (or betas) in ``defaults``: over two SGDs with
    momentum it cycles both, as one scheduler on each would; over Adam and SGD, which share
    neither, torch refuses it as it refuses an optimizer without either."""
    def sgds(m):
        return [torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9),
                torch.optim.SGD(m[2].parameters(), lr=0.05, momentum=0.8)]

    m = model()
    joint = JointOptimizer(sgds(m))
    assert joint.defaults["momentum"] == 0.9 and "lr" in joint.defaults
    alone = sgds(model())
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.3, total_steps=10)
              for o in (joint, *alone)]
    for _ in range(4):
        for o in (joint, *alone):
            o.step()
        for sc in scheds:
            sc.step()
        assert [(g["lr"], g["momentum"]) for g in joint.param_groups] == \
            [(g["lr"], g["momentum"]) for o in alone for g in o.param_groups]
    assert "momentum" not in JointOptimizer(optimizers(model())).defaults
    with pytest.raises(ValueError, match="momentum or beta1"):
        torch.optim.lr_scheduler.OneCycleLR(JointOptimizer(optimizers(model())), max_lr=0.3,
                                            total_steps=10)


def test_a_sync_replicas_optimizer_in_the_list_is_refused():
    class Wrapped(torch.optim.SGD):
        _mpisync_wrapper = True

    m = model()
    assert joint_problem([Wrapped(m.parameters(), lr=0.1)], []) == (
        "optimizers[0] is a SyncReplicasOptimizer; give the torch optimizers")


def test_an_optimizer_joined_before_joins_again():
    """A joined optimizer carries the Schedules its schedulers follow: not configuration,
    and no sign of a SyncReplicasOptimizer (the same optimizers join a later one)."""
    from mpisync.worker.schedule import Schedules
    m = model()
    a, b = optimizers(m)
    a._mpisync_schedules = b._mpisync_schedules = Schedules()
    named = list(m.named_parameters())
    assert joint_problem([a, b], named) is None
    name_of = {id(p): n for n, p in named}
    assert "_mpisync_schedules" not in settings_of(JointOptimizer([a, b]))
    assert recipe_of(a, name_of).build(dict(named)) is not None


def test_step_within_only_params_steps_those_parameters_only():
    from mpisync.ps.fused import only_params
    m = model()
    joint = JointOptimizer(optimizers(m))
    train(m, lambda: None, joint.zero_grad, steps=1)
    before = [p.detach().clone() for p in m.parameters()]
    with only_params(joint, [[], [m[0].bias], [m[2].weight]]):
        joint.step()
    changed = [not torch.equal(p, q) for p, q in zip(m.parameters(), before)]
    assert changed == [False, True, True, False]
    assert len(joint.param_groups) == 3 and len(joint.optimizers[0].param_groups) == 2
    assert set(joint.state) == {m[0].bias, m[2].weight}


def test_sole_holder_is_the_inner_optimizer_of_every_parameter_given():
    m = model()
    a, b = optimizers(m)
    joint = JointOptimizer([a, b])
    assert sole_holder(joint, [m[0].weight, m[0].bias]) is a
    assert sole_holder(joint, [m[2].bias]) is b
    assert sole_holder(joint, [m[0].weight, m[2].bias]) is joint
    assert sole_holder(joint, []) is joint
    assert sole_holder(a, [m[0].weight]) is a


def test_a_changed_attribute_of_an_inner_optimizer_is_named_with_its_place():
    from mpisync.errors import ConfigError
    from mpisync.worker.refusals import check_settings
    m = model()
    a, b = optimizers(m)
    b.custom = 3
    joint = JointOptimizer([a, b])
    settings = settings_of(joint)
    b.custom = 4
    with pytest.raises(ConfigError, match=r"worker 0: the wrapped SGD \(optimizer 1 of the "
                                          r"list\)'s attribute 'custom' changed from 3 to 4"):
        check_settings(settings, joint, "worker 0")
