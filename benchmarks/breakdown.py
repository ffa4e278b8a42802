"""Where a dense step's time goes, on every rank: step_bench.py under the timeline.

Runs ``benchmarks/step_bench.py`` (W workers, P ps ranks, a dense model of ``--mb`` MiB,
the ps optimizer only) with ``MPISYNC_TIMELINE`` and prints, per rank and phase, the median
duration over the timed steps, and the median of each phase's start relative to the
first push of its step: a worker's ``compute`` (filling its gradients), ``push``,
``token wait`` and ``pull``; a ps rank's ``receive`` (from the first push to the step's
start), ``reduce``, ``apply`` and ``send`` (``mpisync/ps/timings.py``)::

    .venv/bin/python benchmarks/breakdown.py --workers 2 --ps 1 --mb 4

The last line is the table as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    trace = Path(tempfile.mkdtemp(prefix="mpisync-breakdown-")) / "trace.json"
    cmd = [sys.executable, "-m", "mpisync.launch", "--workers", str(args.workers), "--ps",
           str(args.ps), "--", sys.executable, str(ROOT / "benchmarks" / "step_bench.py"),
           "--mb", str(args.mb), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--no-allreduce-step"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MPISYNC_TIMELINE=str(trace))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    step_ms = json.loads(proc.stdout.strip().splitlines()[-1])["step_ms"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"].split(" (")[0] for e in events
             if e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X" and e["args"]["step"] >= args.warmup]
    first_push = defaultdict(lambda: float("inf"))
    for e in spans:
        if e["name"] == "push":
            first_push[e["args"]["step"]] = min(first_push[e["args"]["step"]], e["ts"])
    rows = defaultdict(lambda: ([], []))
    for e in spans:
        start = first_push[e["args"]["step"]]
        if start == float("inf"):
            continue
        durs, offsets = rows[(e["pid"], e["name"])]
        durs.append(e["dur"] / 1e3)
        offsets.append((e["ts"] - start) / 1e3)
    table = []
    print(f"step median {step_ms['median']} ms (p10 {step_ms['p10']}, p90 {step_ms['p90']}); "
          f"per rank and phase, medians in ms, 'at' from the step's first push:")
    for (pid, name), (durs, offsets) in sorted(rows.items()):
        row = {"rank": names.get(pid, pid), "phase": name,
               "at_ms": round(float(np.median(offsets)), 3),
               "ms": round(float(np.median(durs)), 3)}
        table.append(row)
        print(f"  {row['rank']:10s} {name:11s} at {row['at_ms']:8.3f}  lasts {row['ms']:8.3f}")
    print(json.dumps({"workers": args.workers, "ps": args.ps, "mb": args.mb,
                      "step_ms": step_ms, "phases": table}))


if __name__ == "__main__":
    main()
