"""Watching a job: the statistics log, the timeline and the chief's progress display.

One worker (``--laggard``) may sleep before every step (``--sleep``) or once
(``--sleep-at``); with ``--tty FILE`` the chief's stderr is a pseudo-terminal whose
output is copied to FILE.

``--case NAME:OPTIONS`` (given several times) runs several trainings one after another in
one job, each with its own options (a RESULT record per case and worker).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import pty
import struct
import sys
import termios
import threading
import time

import torch
from common import dataset, emit, make_optimizer, model, run
from training_cases import split_cases

import mpisync


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--steps", type=int, default=20, help="global steps to train for")
    p.add_argument("--laggard", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0.0, help="the laggard, before each step")
    p.add_argument("--sleep-at", type=int, default=-1, help="... or 1 s once, at this push")
    p.add_argument("--stats-arg", default=None, help="stats_log= instead of MPISYNC_STATS")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--tty", default=None, help="the chief's stderr is a pty copied here")
    p.add_argument("--case", action="append", default=[], metavar="NAME:OPTIONS",
                   help="run this case in the job (this program's options); repeatable")
    return p.parse_args(argv)


class Terminal:
    """fd 2 becomes a pseudo-terminal (100 columns); what it shows is collected."""

    def __init__(self):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.saved = os.dup(2)
        os.dup2(slave, 2)
        os.close(slave)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:            # the slave side closed
                return
            if not data:
                return
            self.chunks.append(data)

    def close(self, path: str) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)         # the last reference to the slave goes
        self.reader.join(timeout=5)
        with open(path, "wb") as f:
            f.write(b"".join(self.chunks))


def train(args, cluster) -> dict:
    w = cluster.worker_index
    terminal = Terminal() if args.tty and cluster.is_chief else None
    net = model()
    opt = mpisync.SyncReplicasOptimizer(
        make_optimizer("sgd", net.parameters()), named_parameters=net.named_parameters(),
        replicas_to_aggregate=args.replicas, stats_log=args.stats_arg)
    progress = (mpisync.Progress(opt, total=args.steps, batch_size=16, every=args.every)
                if args.progress else None)
    x, y = dataset(512, seed=w)
    pushes = 0
    while not opt.stopped and opt.global_step < args.steps:
        if w == args.laggard and (args.sleep or pushes == args.sleep_at):
            time.sleep(args.sleep or 1.0)
        i = pushes % 32
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[i * 16:(i + 1) * 16]),
                                                 y[i * 16:(i + 1) * 16])
        loss.backward()
        opt.step()
        pushes += 1
        if progress is not None:
            progress.report(loss=loss)
    if progress is not None:
        progress.close()
    opt.close()
    if terminal is not None:
        terminal.close(args.tty)
    stats = opt.stats
    return {"pushes": pushes, "local_steps": stats["local_steps"],
            "taken_per_worker": stats["taken_per_worker"],
            "dropped_per_worker": stats["dropped_per_worker"],
            "gradients_applied": stats["gradients_applied"],
            "gradients_dropped": stats["gradients_dropped"],
            "global_step": stats["global_step"]}


def worker(cluster) -> dict | None:
    args = parse()
    if not args.case:
        return train(args, cluster)
    for name, case_args in split_cases(args.case, parse):
        emit(role="worker", worker=cluster.worker_index, case=name, **train(case_args, cluster))
    return None


if __name__ == "__main__":
    run(worker)
