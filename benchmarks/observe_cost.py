"""What the statistics log and the timeline cost a step: step_bench.py, back to back.

Runs ``benchmarks/step_bench.py`` (the synchronous step of a dense model, W workers,
P ps ranks) in rounds; each round runs every configuration once, in a rotating order:
``off``, ``stats`` (``MPISYNC_STATS``), ``timeline`` (``MPISYNC_TIMELINE``) and ``both``,
plus ``before`` with ``--before DIR``: the same benchmark against another checkout of
mpisync (``PYTHONPATH=DIR``, e.g. a ``git worktree`` of the commit before a change). It
prints one line per configuration (the step median of every run, the median of those
medians and its difference from ``off``) and, last, a JSON object::

    .venv/bin/python benchmarks/observe_cost.py --rounds 5 --mb 4 --steps 200
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--before", default=None, help="another mpisync checkout to compare")
    parser.add_argument("--timeout", type=float, default=300)
    return parser.parse_args()


def run_once(args, env: dict[str, str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "mpisync.launch", "--workers", str(args.workers), "--ps",
           str(args.ps), "--", sys.executable, str(ROOT / "benchmarks" / "step_bench.py"),
           "--mb", str(args.mb), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--json-out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **env), cwd=ROOT,
                          capture_output=True, text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mpisync-observe-"))
    configs = {"off": {}, "stats": {"MPISYNC_STATS": str(tmp / "stats.jsonl")},
               "timeline": {"MPISYNC_TIMELINE": str(tmp / "trace.json")},
               "both": {"MPISYNC_STATS": str(tmp / "stats.jsonl"),
                        "MPISYNC_TIMELINE": str(tmp / "trace.json")}}
    if args.before:
        configs["before"] = {"PYTHONPATH": os.path.abspath(args.before)}
    names = list(configs)
    medians: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            result = run_once(args, configs[name], tmp / f"{name}.json")
            medians[name].append(result["step_ms"]["median"])
            print(f"round {r + 1}/{args.rounds} {name:8s} step median "
                  f"{result['step_ms']['median']:.3f} ms", flush=True)
    off = float(np.median(medians["off"]))
    summary = {}
    for name in names:
        m = float(np.median(medians[name]))
        summary[name] = {"runs_ms": medians[name], "median_ms": round(m, 3),
                         "vs_off_ms": round(m - off, 3), "vs_off_pct": round(100 * (m / off - 1), 1)}
        print(f"{name:8s} median of {len(medians[name])} run medians {m:.3f} ms "
              f"({m - off:+.3f} ms, {100 * (m / off - 1):+.1f}% vs off); runs: "
              + ", ".join(f"{x:.2f}" for x in medians[name]))
    print(json.dumps({"workers": args.workers, "ps": args.ps, "mb": args.mb,
                      "steps": args.steps, "rounds": args.rounds, "configs": summary}))


if __name__ == "__main__":
    main()
