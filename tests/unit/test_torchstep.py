"""A ps rank's ``torchstep.step(optimizer)`` is torch's ``optimizer.step()``, bitwise, for
every torch optimizer a ps steps, and imports no ``torch._dynamo`` on the way.

Runs in a fresh Python (this process imported torch._dynamo long ago, and the step then
takes torch's own path): each optimizer steps twin copies of one model, one through
``torchstep.step`` and one through ``optimizer.step()``, over a few steps of changing
gradients, and the parameters and state must be equal bit for bit.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from mpisync.native import torchstep

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from mpisync.native import torchstep
    from mpisync.runtime import lazydynamo

    O = torch.optim
    CASES = {
        "sgd": (O.SGD, dict(lr=0.1)),
        "sgd-nesterov-decay": (O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                           weight_decay=0.01)),
        "sgd-foreach": (O.SGD, dict(lr=0.1, momentum=0.5, foreach=True)),
        "adam": (O.Adam, dict(lr=0.01)),
        "adam-amsgrad-tensor-lr": (O.Adam, dict(lr=torch.tensor(0.01), amsgrad=True)),
        "adam-foreach": (O.Adam, dict(lr=0.01, foreach=True)),
        "adamw": (O.AdamW, dict(lr=0.01, weight_decay=0.1)),
        "adagrad": (O.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
        "rmsprop-centered": (O.RMSprop, dict(lr=0.01, centered=True, momentum=0.9)),
        "adadelta": (O.Adadelta, dict()),
        "adamax": (O.Adamax, dict(lr=0.01)),
        "nadam": (O.NAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
        "radam": (O.RAdam, dict(lr=0.01)),
        "asgd": (O.ASGD, dict(lr=0.01)),
        "rprop": (O.Rprop, dict(lr=0.01)),
        "adam-maximize": (O.Adam, dict(lr=0.01, maximize=True)),
    }

    def build(cls, kwargs):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
        return params, cls(params, **kwargs)

    def run(params, opt, stepper):
        for k in range(4):
            g = torch.Generator().manual_seed(k)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            stepper(opt)

    lazydynamo.spare()              # as mpisync.init() does: built without torch._dynamo
    built = {name: (build(*case), build(*case)) for name, case in CASES.items()}
    out = {"short": [], "equal": {}}
    for name, ((a, opt_a), _) in built.items():    # first every ps step: no import
        assert torchstep._unwrapped(type(opt_a)) is not None, name
        run(a, opt_a, torchstep.step)
        if "torch._dynamo" not in sys.modules:
            out["short"].append(name)
    # a scheduler counts the steps of the optimizer it is attached to (a step set on the
    # instance): those go through it, and the scheduler sees them
    import warnings
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(plain, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torchstep.step(plain)
        scheduler.step()             # warns when it saw no step of the optimizer before it
    out["scheduler_warnings"] = [str(w.message) for w in seen]
    for name, ((a, opt_a), (b, opt_b)) in built.items():   # then torch's own
        run(b, opt_b, lambda opt: opt.step())
        sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        out["equal"][name] = all(torch.equal(pa, pb) for pa, pb in zip(a, b)) and all(
            torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))
            for i in sa for k in sa[i]) and sa.keys() == sb.keys()
    out["dynamo_after"] = "torch._dynamo" in sys.modules
    print(json.dumps(out))
""")


def test_the_ps_step_is_torchs_step_bitwise_without_importing_dynamo():
    done = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert all(out["equal"].values()), out["equal"]
    assert out["short"] == list(out["equal"]), out      # every one without the import
    assert out["dynamo_after"] is True          # torch's own step imports it
    assert out["scheduler_warnings"] == [], out["scheduler_warnings"]


def test_hooks_differentiable_optimizers_and_their_own_steps_go_through_torchs_step():
    calls = []
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.5)
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    assert torchstep.hooked(opt)
    torchstep.step(opt)
    assert calls == ["post"] and torch.equal(p.detach(), torch.full((2,), 0.5))

    class OwnStep(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            calls.append("own")

    assert torchstep._unwrapped(OwnStep) is None
    torchstep.step(OwnStep([torch.nn.Parameter(torch.ones(1))]))
    assert calls == ["post", "own"]


