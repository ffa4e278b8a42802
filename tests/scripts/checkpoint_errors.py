"""Checkpoint files that go wrong on purpose: ``load_bad FILE...``, ``interrupted DIR``,
``uneven DIR``.

``load_bad``: one model and optimizer train 2 steps, then load each FILE in turn: every
worker catches the refusal, checks that nothing was loaded, trains a step and goes on to
the next file (case ``load_bad:<the file's folder>``). ``interrupted``: a save whose write
fails after the tables went in (case ``interrupted``). ``uneven``: uneven data, worker 1
closes after UNEVEN[1] steps while worker 0 goes on stepping and calling a Checkpointer's
``maybe_save()`` for UNEVEN[0]: its steps and saves become no-ops, none waits for worker 1
(case ``uneven``). ``bad_files`` writes the bad files
from a good checkpoint (the test calls it, and checks each file's refusal in one process):
some are no checkpoint, some lack an entry (``no_model``, ``no_optimizer``, ``no_strategy``:
a table's), and ``not_a_tensor`` makes the chief's check itself raise.
"""
from __future__ import annotations

import os
import sys
import zipfile

import torch
from common import emit, run
from resume import Net, batch

import mpisync

BAD_KINDS = ("truncated", "newer", "other_model", "not_a_checkpoint", "unreadable", "missing",
             "no_model", "no_optimizer", "no_strategy", "not_a_tensor")
#: uneven: the steps each worker's loop runs (worker 1 closes first)
UNEVEN = (6, 2)


def bad_files(good, directory) -> dict[str, str]:
    """``{kind: DIRECTORY/<kind>/bad.pt}``, each file made from the checkpoint ``good``
    (``missing``: no file there)."""
    paths = {}
    with open(good, "rb") as f:
        data = f.read()
    for kind in BAD_KINDS:
        os.makedirs(os.path.join(directory, kind), exist_ok=True)
        dst = paths[kind] = os.path.join(directory, kind, "bad.pt")
        if kind == "truncated":
            with open(dst, "wb") as f:
                f.write(data[: len(data) * 2 // 3])
        elif kind == "unreadable":                 # a zip file, but not torch's
            with zipfile.ZipFile(dst, "w") as z:
                z.writestr("notes.txt", "not a checkpoint")
        elif kind != "missing":
            ck = torch.load(good, weights_only=True)
            if kind == "newer":
                ck["version"] = 99
            elif kind == "other_model":
                ck["model"]["body.weight"] = torch.zeros(3, 3)
            elif kind == "no_model":
                del ck["model"]
            elif kind == "no_optimizer":
                del ck["optimizer"]
            elif kind == "no_strategy":
                del ck["tables"]["emb.weight"]["strategy"]
            elif kind == "not_a_tensor":           # passes the check of the entries
                ck["model"]["body.weight"] = "not a tensor"
            else:                                  # the model's state_dict alone
                ck = ck["model"]
            torch.save(ck, dst)
    return paths


def train_one(m, opt, w: int) -> None:
    x, ids, y = batch(opt.global_step, w)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x, ids), y).backward()
    opt.step()


def make(w: int):
    m = Net()
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adam(m.parameters(), lr=0.05),
                                        named_parameters=m.named_parameters())
    for _ in range(2):
        train_one(m, opt, w)
    return m, opt


def load_bad(w: int, files: list[str]):
    m, opt = make(w)
    for path in files:
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        state = opt.state_dict()
        out = {"step_at_load": opt.global_step}
        try:
            mpisync.load(path, m, opt)
            out["error"] = "loaded"
        except mpisync.ConfigError as exc:
            out["error"] = str(exc)
        after = opt.state_dict()
        out["unchanged"] = (all(torch.equal(before[n], p) for n, p in m.named_parameters())
                            and after["mpisync"]["global_step"] == out["step_at_load"]
                            and torch.equal(state["state"][2]["exp_avg"],
                                            after["state"][2]["exp_avg"]))
        train_one(m, opt, w)                  # training goes on
        yield f"load_bad:{os.path.basename(os.path.dirname(path))}", dict(
            out, global_step=opt.global_step)
    opt.close()


def interrupted(w: int, where: str) -> dict:
    m, opt = make(w)
    ck = mpisync.Checkpointer(where, m, opt, keep=3)
    ck.save(extra={"epoch": 1})
    train_one(m, opt, w)
    try:     # a lambda cannot be pickled: the write fails after the table went in
        mpisync.save(ck.path(opt.global_step), m, opt, extra={"bad": lambda: 0})
        out = {"error": "saved"}
    except OSError as exc:
        out = {"error": str(exc)}
    opt.close()
    return out


def uneven(w: int, where: str) -> dict:
    m, opt = make(w)
    ck = mpisync.Checkpointer(where, m, opt, every_steps=1)
    saved = []
    for _ in range(UNEVEN[w]):
        train_one(m, opt, w)
        path = ck.maybe_save()
        saved.append(path and os.path.basename(path))
    out = {"saved": saved, "stopped": opt.stopped, "dir": where, "global_step": opt.global_step}
    opt.close()
    return out


def cases(cluster, argv: list[str]):
    """``argv`` = ``load_bad FILE...``, ``interrupted DIR`` or ``uneven DIR``."""
    mode, where = argv[0], argv[1:]
    if mode == "load_bad":
        yield from load_bad(cluster.worker_index, where)
    elif mode == "uneven":
        yield "uneven", uneven(cluster.worker_index, where[0])
    else:
        yield "interrupted", interrupted(cluster.worker_index, where[0])


def worker(cluster) -> None:
    for case, record in cases(cluster, sys.argv[1:]):
        emit(role="worker", worker=cluster.worker_index, case=case, **record)


if __name__ == "__main__":
    run(worker)
