"""How long a user waits from ``python -m mpisync.launch`` to the first step applied.

Runs ``examples/digits.py`` as ``make demo`` does, on 2 workers and 1 ps under the
launcher, with the statistics log on (``MPISYNC_STATS``): its first step's ``t``
(wall-clock seconds when every ps had applied global step 1) minus the moment the launcher
was started is the figure. With ``--baseline DIR`` the same runs alternate with another checkout of mpisync
(put first on ``PYTHONPATH``, its own ``examples/digits.py``), and the JSON gives the
medians of both and their ratio: compare ratios, this machine is shared and noisy::

    .venv/bin/python benchmarks/startup.py --runs 5
    .venv/bin/python benchmarks/startup.py --runs 5 --baseline /tmp/base

Prints one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(code: Path, timeout: float) -> dict:
    """One launch of the digits example from ``code``: seconds to step 1, and in all."""
    with tempfile.TemporaryDirectory(prefix="mpisync-startup-") as tmp:
        stats = Path(tmp) / "stats.jsonl"
        env = dict(os.environ, MPISYNC_STATS=str(stats), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(code),
                                                            os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1", "--",
                   sys.executable, str(code / "examples" / "digits.py")]
        started = time.time()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=tmp, check=False)
        ended = time.time()
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n"
                             f"{proc.stdout}{proc.stderr}")
        first = next(line for line in map(json.loads, stats.read_text().splitlines())
                     if line.get("step") == 1)
    return {"first_step_s": round(first["t"] - started, 3), "total_s": round(ended - started, 3)}


def summary(runs: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in runs),
                  "min": min(r[key] for r in runs), "max": max(r[key] for r in runs)}
            for key in ("first_step_s", "total_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of mpisync, timed in turn with this one")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    sides = {"mpisync": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.runs):
        for name, code in sides.items():
            runs[name].append(one_run(code, args.timeout))
            print(name, runs[name][-1], file=sys.stderr, flush=True)
    result = {name: summary(r) for name, r in runs.items()}
    result["runs"] = args.runs
    result["load_1min"] = round(os.getloadavg()[0], 2)
    if args.baseline:
        result["ratio_first_step"] = round(
            result["mpisync"]["first_step_s"]["median"]
            / result["baseline"]["first_step_s"]["median"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
