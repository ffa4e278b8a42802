"""How long a job under ``python -m mpisync.launch --restarts`` is down after a rank dies.

Runs this file as a small training program on 2 workers and 1 ps (12 deterministic Adam
steps, a ``Checkpointer`` every 3 global steps, resumed at start), once per rank kind
(``--who worker1 ps chief``): in the first attempt that rank kills itself with SIGKILL
at global step 7. Each rank prints wall-clock stamps, and the driver reads them as they
come: the death, the launcher's line that starts the next attempt, and the next
attempt's first step. Prints one JSON object per run and a last line with all of them::

    .venv/bin/python benchmarks/restart_bench.py
    .venv/bin/python benchmarks/restart_bench.py --who ps --runs 3

Figures: ``death_to_launcher_s`` (the launcher noticed the job had failed),
``death_to_next_first_step_s`` (the job trains again: start-up of every rank, the
resume), ``steps_lost`` (the steps after the newest checkpoint, trained again: at most
``every_steps``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

STEPS, EVERY, KILL_AT = 12, 3, 7


def program(who: str, directory: str) -> None:
    """The training program each rank runs (``--rank-program``)."""
    import torch

    import mpisync

    cluster = mpisync.init()
    attempt = int(os.environ.get("MPISYNC_ATTEMPT", "0"))
    if cluster.is_ps:
        if attempt == 0 and who == "ps":
            def watch() -> None:
                while not os.path.exists(os.path.join(directory, "die")):
                    time.sleep(0.005)
                print(f"STAMP death {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=watch, daemon=True).start()
        cluster.serve()
        cluster.close()
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                        named_parameters=model.named_parameters(),
                                        deterministic=True)
    ckpt = mpisync.Checkpointer(directory, model, opt, every_steps=EVERY)
    ckpt.resume()
    w, first = cluster.worker_index, True
    while opt.global_step < STEPS:
        g = torch.Generator().manual_seed(opt.global_step * 10 + w)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if first and w == 0:
            print(f"STAMP first-step attempt={attempt} step={opt.global_step} "
                  f"{time.time():.3f}", flush=True)
            first = False
        ckpt.maybe_save()
        if attempt == 0 and opt.global_step == KILL_AT:
            if who == "ps" and w == 0:
                open(os.path.join(directory, "die"), "w").close()
                time.sleep(30)                       # the job ends meanwhile
            if (who == "worker1" and w == 1) or (who == "chief" and w == 0):
                print(f"STAMP death {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    opt.close()
    cluster.close()


def one_run(who: str, timeout: float) -> dict:
    """The launcher with ``--restarts 2`` over ``program(who)``: the figures of one run."""
    with tempfile.TemporaryDirectory(prefix="mpisync-restart-") as directory:
        started = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
             "--restarts", "2", "--restart-backoff", "0", "--timeout", str(timeout), "--",
             sys.executable, os.path.abspath(__file__), "--rank-program", who, directory],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        stamps: dict[str, float] = {}
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("STAMP death"):
                stamps["death"] = float(line.split()[2])
            elif line.startswith("STAMP first-step"):
                found = re.search(r"attempt=(\d+) step=(\d+) ([\d.]+)", line)
                assert found is not None
                stamps[f"first{found.group(1)}"] = float(found.group(3))
                stamps[f"resumed{found.group(1)}"] = int(found.group(2)) - 1
            elif "attempt 2 of 3" in line:
                stamps["noticed"] = time.time()
        if proc.wait() != 0 or not {"death", "noticed", "first1"} <= set(stamps):
            raise SystemExit(f"the run ({who}) exited {proc.returncode}:\n" + "".join(lines))
    return {"who": who,
            "launch_to_first_step_s": round(stamps["first0"] - started, 2),
            "death_to_launcher_s": round(stamps["noticed"] - stamps["death"], 2),
            "death_to_next_first_step_s": round(stamps["first1"] - stamps["death"], 2),
            "steps_lost": KILL_AT - int(stamps["resumed1"]), "every_steps": EVERY}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-program":
        program(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--who", nargs="+", choices=("worker1", "ps", "chief"),
                        default=["worker1", "ps", "chief"], help="the rank that dies")
    parser.add_argument("--runs", type=int, default=1, help="runs per rank kind")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per attempt")
    args = parser.parse_args()
    results = []
    for who in args.who:
        for _ in range(args.runs):
            results.append(one_run(who, args.timeout))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"runs": results, "load_1min": os.getloadavg()[0],
                      "death_to_next_first_step_median_s": statistics.median(
                          r["death_to_next_first_step_s"] for r in results)}))


if __name__ == "__main__":
    main()
