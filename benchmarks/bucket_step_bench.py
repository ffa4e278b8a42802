"""Time one bucket's reduce and step on a ps rank: compiled in the reduce against torch's step.

One process, no MPI; run it on one core, e.g.::

    taskset -c 0 .venv/bin/python benchmarks/bucket_step_bench.py --optimizer rmsprop \\
        --options '{"centered": true, "momentum": 0.9}'

A bucket of D MiB of float32 (one parameter) is stepped, as a ps rank steps it
(``mpisync.ps.fused.Applier``), with the mean of two workers' gradients in turn two ways:
``compiled``, the reduce's pass that steps the parameters too (``Applier.compiled_step``);
``torch``, the compiled mean (``kernels.dense_mean``) then torch's step over the bucket
(``Applier.apply``). Both start from the same parameters and state and must end bitwise
equal. The heap is kept as on a serving ps rank (``mpisync.runtime.heap``). Prints one JSON
object: medians in ms and their ratio.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from mpisync.native import kernels
from mpisync.ps.fused import Applier
from mpisync.runtime import heap

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
              "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="bucket size in MiB (float32)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rmsprop")
    parser.add_argument("--options", default="{}", help="the optimizer's options (JSON)")
    parser.add_argument("--reps", type=int, default=300, help="timed steps of each way")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps of each way")
    return parser.parse_args()


def bucket(cls, options: dict, n: int, start: torch.Tensor) -> tuple[Applier, torch.Tensor]:
    """An applier over one bucket of one parameter (as a ps rank lays it out), its
    reduced-gradient buffer, the optimizer's state made by one step of torch's."""
    region, grad_region = start.clone(), torch.zeros(n)
    param = torch.nn.Parameter(region)
    opt = cls([param], **{"lr": 1e-9, **options})
    applier = Applier(opt, [param], [grad_region], [(0, 0, n)], [region], [grad_region],
                      [range(1)])
    applier.begin(np.ones(1, bool))
    grad_region.copy_(start)
    applier.apply(0)                    # the first step is torch's (it makes the state)
    applier.end()
    return applier, grad_region


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    heap.keep()                 # as a ps rank serving: the optimizer's temporaries reused
    n = int(args.mb * (1 << 20)) // 4
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    start = torch.randn(n, generator=gen)
    cls, options = OPTIMIZERS[args.optimizer], json.loads(args.options)
    compiled, out_c = bucket(cls, options, n, start)
    plain, out_t = bucket(cls, options, n, start)

    def step_compiled():
        compiled.begin(np.ones(1, bool))
        step = compiled.compiled_step(0, out_c)
        if step is None:
            raise SystemExit(f"{args.optimizer} {options}: not stepped in the reduce here")
        step(grads)
        compiled.end()

    def step_torch():
        plain.begin(np.ones(1, bool))
        kernels.dense_mean(out_t, grads, True)
        plain.apply(0)
        plain.end()

    times = {"compiled": [], "torch": []}
    for rep in range(args.warmup + args.reps):
        for name, fn in (("compiled", step_compiled), ("torch", step_torch)):
            t0 = time.perf_counter()
            fn()
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    a, b = compiled.optimizer, plain.optimizer
    same = torch.equal(a.param_groups[0]["params"][0], b.param_groups[0]["params"][0]) and all(
        torch.equal(v, b.state[b.param_groups[0]["params"][0]][k])
        for k, v in a.state[a.param_groups[0]["params"][0]].items())
    if not same:
        raise SystemExit("the compiled step is not torch's bitwise")
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(json.dumps({"machine": platform.processor() or platform.machine(), "mb": args.mb,
                      "optimizer": args.optimizer, "options": options, "reps": args.reps,
                      "compiled_ms": round(ms["compiled"], 3), "torch_ms": round(ms["torch"], 3),
                      "ratio": round(ms["compiled"] / ms["torch"], 3),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
