"""Checkpoints: a run, the same run killed after a checkpoint, and its resumption.

``resume.py MODE DIR [options]``: MODE ``full`` trains STEPS steps, saving every EVERY
steps; ``kill`` does the same but worker 1 kills itself with SIGKILL right after the
checkpoint of step KILL_AT; ``resume`` loads the newest checkpoint in DIR and trains to
STEPS. Each worker's batch at global step t is drawn from a generator seeded with t, so
a resumed run sees the data an uninterrupted one sees. The model has a dense part and an
``mpisync.Embedding`` table on the ps ranks; the loop has an LR scheduler and, with
``--ema``, moving averages; everything runs in deterministic mode. ``--full-every K``
writes incremental checkpoints (every K-th file of a chain full; default 1: all full).
Through checkpoint_jobs.py, ``full`` and ``resume`` share a job with other programs: their
record is case ``MODE``, ``MODE-ema``, with ``-incr`` after it when K is above 1.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
from common import run

import mpisync

WORKERS, BATCH, STEPS, EVERY, KILL_AT = 2, 8, 9, 3, 6
ROWS, DIM, FIELDS, FEATURES = 30, 4, 2, 5


class Net(torch.nn.Module):
    def __init__(self, plain: bool = False):
        super().__init__()
        torch.manual_seed(0)
        w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))
        if plain:
            self.emb = torch.nn.Embedding(ROWS, DIM)
            with torch.no_grad():
                self.emb.weight.copy_(w)
        else:
            self.emb = mpisync.Embedding(ROWS, DIM, weight=w)
        self.body = torch.nn.Linear(FEATURES + DIM * FIELDS, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, ids):
        return self.head(torch.tanh(self.body(torch.cat([x, self.emb(ids).flatten(1)], 1))))


def batch(t: int, worker: int, workers: int = WORKERS):
    """Step t's batch of one worker of ``workers`` (all of them: ``worker=-1``)."""
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(workers * BATCH, FEATURES, generator=g)
    ids = torch.randint(0, ROWS, (workers * BATCH, FIELDS), generator=g)
    y = torch.randint(0, 3, (workers * BATCH,), generator=g)
    rows = slice(worker * BATCH, (worker + 1) * BATCH) if worker >= 0 else slice(None)
    return x[rows], ids[rows], y[rows]


def make(model, ema: bool, dense: str = "ps"):
    inner = torch.optim.Adam(model.parameters(), lr=0.05)
    opt = mpisync.SyncReplicasOptimizer(inner, named_parameters=model.named_parameters(),
                                        deterministic=True, dense=dense,
                                        ema_decay=0.9 if ema else None)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return opt, sched


def snapshot(m, opt) -> dict:
    out = {n: p.detach().tolist() for n, p in m.named_parameters() if n != "emb.weight"}
    out["table"] = m.emb.rows(torch.arange(ROWS)).tolist()
    if opt._spec.ema_decay is not None:
        out["averages"] = {n: v.tolist() for n, v in opt.averages().items()}
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def worker(cluster, args) -> dict:
    w = cluster.worker_index
    m = Net()
    opt, sched = make(m, args.ema, args.dense)
    ck = mpisync.Checkpointer(args.dir, m, opt, keep=2, every_steps=EVERY,
                              full_every=args.full_every)
    resumed_from = None
    if args.mode == "resume":
        extra = ck.resume()
        assert extra is not None, "no checkpoint to resume from"
        sched.load_state_dict(extra["scheduler"])
        resumed_from = opt.global_step
    while opt.global_step < STEPS:
        x, ids, y = batch(opt.global_step, w, cluster.num_workers)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x, ids), y).backward()
        opt.step()
        sched.step()
        path = ck.maybe_save(extra={"scheduler": sched.state_dict(), "note": "hi"})
        if path and args.mode == "kill" and opt.global_step == KILL_AT:
            ck.wait()                                  # the chief has written it
            if w == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # no excepthook, no atexit
    ck.wait()
    out = dict(snapshot(m, opt), resumed_from=resumed_from, global_step=opt.global_step,
               files=sorted(os.listdir(args.dir)))
    opt.close()
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="resume.py")
    p.add_argument("mode", choices=["full", "kill", "resume"])  # resume: from DIR's newest
    p.add_argument("dir")
    p.add_argument("--ema", action="store_true")
    p.add_argument("--dense", default="ps")
    p.add_argument("--full-every", type=int, default=1)
    return p.parse_args(argv)


def cases(cluster, argv: list[str]):
    """The run that ``argv`` asks for, as one case of a checkpoint_jobs.py job."""
    args = parse(argv)
    yield (args.mode + ("-ema" if args.ema else "") + ("-incr" if args.full_every > 1 else ""),
           worker(cluster, args))


def main() -> None:
    args = parse()
    run(lambda cluster: worker(cluster, args))


if __name__ == "__main__":
    main()
