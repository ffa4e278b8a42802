"""A job stopped by a signal: it saves, exits with PREEMPTED_EXIT, and resumes.

``preemption.py MODE DIR``, 2 workers and 1 ps, the data of ``restarts.py`` (each worker's
batch at global step t drawn from a generator seeded with t):

- ``usr1``: with a ``Checkpointer`` on DIR, resuming from its newest checkpoint; in a run
  that starts at global step 0, worker 1 sends SIGUSR1 to itself after the backward pass of
  global step SIGNAL_AT. Trains to STEPS otherwise.
- ``term``: no Checkpointer; worker 0 sends SIGTERM to its process group (every rank and
  ``mpiexec``) at global step SIGNAL_AT and trains on: the job must end, not stall.
- ``early``: every rank prints ``preemption.py: not listening yet`` and sleeps EARLY
  seconds before ``mpisync.init()``, so that a signal finds no rank listening for it.
- ``init``: as ``usr1`` without the worker's own signal, but every rank prints
  ``preemption.py: listening, no Checkpointer yet`` after ``mpisync.init()`` and waits (up
  to EARLY seconds) for a signal before anything else: one noted before the Checkpointer.
- ``slow``: as ``usr1`` without the worker's own signal, worker 0 sleeping SLOW seconds
  after each step (so that a signal from outside, e.g. Slurm's, comes mid-run); the chief
  writes the final parameters to DIR/final.pt (``restarts.py``'s unbroken run ends with
  the same).
"""
from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from common import emit
from restarts import STEPS, batch, trained_model

import mpisync
from mpisync.runtime import stopping

SIGNAL_AT = 5
SLOW = 0.5
EARLY = 60


def worker(cluster, args) -> dict:
    w = cluster.worker_index
    m, opt = trained_model()
    ckpt = mpisync.Checkpointer(args.dir, m, opt, every_steps=100) if args.mode != "term" \
        else None
    if ckpt is not None:
        ckpt.resume()
    started_at = opt.global_step
    if w == 0:
        print(f"preemption.py: starts at global step {started_at}", flush=True)
    steps = STEPS if ckpt is not None else 10**6
    while opt.global_step < steps:
        t = opt.global_step
        x, y = batch(t, w)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        if started_at == 0 and t == SIGNAL_AT:
            if args.mode == "usr1" and w == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            elif args.mode == "term" and w == 0:
                os.killpg(os.getpgid(0), signal.SIGTERM)
        opt.step()
        if args.mode == "slow" and w == 0:
            time.sleep(SLOW)
        if ckpt is not None:
            ckpt.maybe_save()
    if args.mode == "slow" and w == 0:
        torch.save({n: p.detach().clone() for n, p in m.named_parameters()},
                   os.path.join(args.dir, "final.pt"))
    opt.close()
    return {"started_at": started_at, "global_step": opt.global_step}


def main() -> None:
    p = argparse.ArgumentParser(prog="preemption.py")
    p.add_argument("mode", choices=("usr1", "term", "slow", "early", "init"))
    p.add_argument("dir")
    args = p.parse_args()
    if args.mode == "early":
        print("preemption.py: not listening yet", flush=True)
        time.sleep(EARLY)
    cluster = mpisync.init()
    if args.mode == "init":
        print("preemption.py: listening, no Checkpointer yet", flush=True)
        deadline = time.monotonic() + EARLY
        while stopping.received() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    if cluster.is_ps:
        cluster.serve()
        return
    emit(role="worker", worker=cluster.worker_index, **worker(cluster, args))


if __name__ == "__main__":
    main()
