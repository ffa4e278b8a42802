"""Torch's optimizers built after init() import torch._dynamo only once something else did.

Each case runs in a fresh Python (this process imported torch._dynamo long ago), once with
``lazydynamo.spare()`` and once without, and prints what it computed: the two must be equal.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from mpisync.runtime import lazydynamo
    spare = sys.argv[1] == "spare"
    taken = lazydynamo.spare() if spare else []
    out = {"taken": taken}
    if sys.argv[2] == "deterministic":
        lazydynamo.deterministic() if spare else torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)                       # a frozen parameter
    count = torch.zeros(2, dtype=torch.int64)                 # an integer one, never stepped
    opt = torch.optim.Adam([{"params": [model[0].weight]}], lr=0.1, betas=(0.8, 0.9))
    opt.add_param_group({"params": list(model[1].parameters()), "lr": torch.tensor(0.05)})
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def step(set_to_none):
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    opt.zero_grad(set_to_none=False)
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    out["dynamo_before_compile"] = "torch._dynamo" in sys.modules
    out["inductor_before_compile"] = "torch._inductor" in sys.modules
    out["spared_before_compile"] = [n for n in lazydynamo.METHODS if lazydynamo.spared(n)]
    import torch._dynamo                              # what torch.compile imports
    from torch._dynamo.utils import counters
    out["spared_after_import"] = [n for n in lazydynamo.METHODS if lazydynamo.spared(n)]
    extra = torch.nn.Parameter(torch.ones(3))

    @torch.compile(backend="eager")                   # the methods' first calls since
    def compiled(inputs, state):
        doubled = inputs * 2
        opt.load_state_dict(state)
        opt.add_param_group({"params": [extra], "lr": 0.5})
        opt.zero_grad(set_to_none=False)
        return doubled + 1, opt.state_dict()

    compiled(x, opt.state_dict())
    out["frames"] = dict(counters["frames"])
    out["graph_breaks"] = sorted((k.splitlines()[0], v) for k, v in counters["graph_break"].items())
    step(True)
    step(False)
    opt.load_state_dict(opt.state_dict())
    step(True)
    out["params"] = [p.tolist() for p in model.parameters()] + [count.tolist()]
    out["state"] = repr(opt.state_dict())
    import torch._inductor.config
    out["deterministic"] = [torch.are_deterministic_algorithms_enabled(),
                            torch._inductor.config.deterministic]
    print(json.dumps(out))
""")


def _run(mode: str, deterministic: bool = False) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode,
                           "deterministic" if deterministic else "default"], check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_spared_optimizers_compute_what_torchs_compute_and_import_dynamo_late():
    """With deterministic algorithms (``deterministic=True``'s set-up):
    ``lazydynamo.deterministic()`` in place of ``torch.use_deterministic_algorithms(True)``,
    which imports torch._inductor and torch._dynamo only to set the inductor's config (set
    here once it is imported)."""
    deterministic = True
    spared, plain = _run("spare", deterministic), _run("plain", deterministic)
    assert spared["taken"] == ["add_param_group", "zero_grad", "state_dict", "load_state_dict"]
    assert spared["dynamo_before_compile"] is False   # the point: no import at construction
    assert spared["inductor_before_compile"] is False
    assert plain["dynamo_before_compile"] is True     # what torch does alone
    assert spared["deterministic"] == plain["deterministic"] == [deterministic] * 2
    assert spared["spared_before_compile"] == list(spared["taken"])
    assert spared["spared_after_import"] == []       # torch's own switches, at once
    for key in ("params", "state", "frames", "graph_breaks"):
        assert spared.get(key) == plain.get(key), key
    # under torch.compile the methods stay out of the graph, as torch keeps them
    assert spared["graph_breaks"] and spared["frames"]["total"] > 1, spared


def test_nothing_changes_once_torch_imported_dynamo_first():
    import torch._dynamo  # noqa: F401 (this process has it; torch's switches stand)

    from mpisync.runtime import lazydynamo
    assert lazydynamo.spare() == []
    assert not any(lazydynamo.spared(name) for name in lazydynamo.METHODS)


def test_deterministic_holds_where_another_thread_imports_the_inductors_config():
    """A config setting is per thread: imported first by another thread, the config still
    says deterministic in the thread that asked for it (where it compiles)."""
    code = textwrap.dedent("""
        import importlib, threading, torch
        from mpisync.runtime import lazydynamo
        lazydynamo.deterministic()
        t = threading.Thread(target=importlib.import_module, args=("torch._inductor.config",))
        t.start()
        t.join()
        import torch._inductor.config as config
        print(config.deterministic, torch.are_deterministic_algorithms_enabled())
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"], done.stdout

