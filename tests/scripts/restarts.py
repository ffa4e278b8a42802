"""A job run under ``python -m mpisync.launch --restarts``: it resumes from its newest
checkpoint, and in its first attempt one rank fails at a chosen global step.

``restarts.py MODE DIR OUT``: 2 workers and 1 ps train a small model to global step
STEPS in deterministic mode, saving a checkpoint every EVERY steps into DIR and resuming
from the newest one at start; the chief writes the final parameters to OUT (torch.save).
Each worker's batch at global step t is drawn from a generator seeded with t, so a resumed
run sees the data an unbroken one sees. MODE says what fails:

- ``none``: nothing;
- ``kill-each``: one rank of each kind kills itself with SIGKILL, one per attempt
  (``MPISYNC_ATTEMPT``), at the global step EACH names: the ps in attempt 0 (once the
  chief, at that step, left a word in DIR and waits), the chief in attempt 1, worker 1 in
  attempt 2; attempt 3 ends the training;
- ``raise``: the chief raises RuntimeError at global step RAISE_AT, in every attempt.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch
from common import CLASSES, FEATURES, emit, model

import mpisync

WORKERS, BATCH, STEPS, EVERY, RAISE_AT = 2, 8, 12, 3, 5
MODES = ("none", "kill-each", "raise")
#: kill-each: the rank that dies in each attempt, and at which global step
EACH = {0: ("ps", 4), 1: ("chief", 8), 2: ("worker1", 11)}


def attempt() -> int:
    return int(os.environ.get("MPISYNC_ATTEMPT", "0"))


def batch(t: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global step t's batch of one worker."""
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(WORKERS * BATCH, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (WORKERS * BATCH,), generator=g)
    rows = slice(worker * BATCH, (worker + 1) * BATCH)
    return x[rows], y[rows]


def kill_plan(mode: str) -> tuple[str, int] | None:
    """The rank that dies in this attempt ("ps", "chief" or "worker1") and at which global
    step, or None."""
    return EACH.get(attempt()) if mode == "kill-each" else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)       # no excepthook, no atexit, no record


def ps_dies_on_word(path: str) -> None:
    """The ps rank kills itself once ``path`` exists (the chief writes it at the step)."""
    def watch() -> None:
        while not os.path.exists(path):
            time.sleep(0.01)
        die()
    threading.Thread(target=watch, daemon=True).start()


def trained_model():
    """The model and its deterministic SGD-with-momentum optimizer (preemption.py too)."""
    m = model(hidden=8)
    opt = mpisync.SyncReplicasOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        named_parameters=m.named_parameters(), deterministic=True)
    return m, opt


def worker(cluster, args) -> dict:
    w = cluster.worker_index
    m, opt = trained_model()
    ckpt = mpisync.Checkpointer(args.dir, m, opt, every_steps=EVERY)
    ckpt.resume()
    resumed_from = opt.global_step
    if w == 0:
        print(f"restarts.py: attempt {attempt()} starts at global step {resumed_from}",
              flush=True)
    plan = kill_plan(args.mode)
    victim, kill_at = plan if plan else (None, -1)
    target = {"chief": 0, "worker1": 1, "ps": 0}.get(victim)
    while opt.global_step < STEPS:
        x, y = batch(opt.global_step, w)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        ckpt.maybe_save()
        if args.mode == "raise" and w == 0 and opt.global_step == RAISE_AT:
            raise RuntimeError("boom")
        if opt.global_step == kill_at:
            ckpt.wait()                # the newest file is written (every worker)
        if w == target and opt.global_step == kill_at:
            if victim != "ps":
                die()
            with open(os.path.join(args.dir, f"kill-ps-{attempt()}"), "w"):
                pass
            time.sleep(120)            # the job ends with the ps rank long before
            raise RuntimeError("the ps rank did not die")
    if w == 0:
        torch.save({n: p.detach().clone() for n, p in m.named_parameters()}, args.out)
    opt.close()
    return {"resumed_from": resumed_from, "global_step": opt.global_step,
            "attempt": attempt()}


def main() -> None:
    p = argparse.ArgumentParser(prog="restarts.py")
    p.add_argument("mode", choices=MODES)
    p.add_argument("dir")
    p.add_argument("out")
    args = p.parse_args()
    cluster = mpisync.init()
    if cluster.is_ps:
        plan = kill_plan(args.mode)
        if plan and plan[0] == "ps":
            ps_dies_on_word(os.path.join(args.dir, f"kill-ps-{attempt()}"))
        cluster.serve()
        return
    emit(role="worker", worker=cluster.worker_index, **worker(cluster, args))

if __name__ == "__main__":
    main()
