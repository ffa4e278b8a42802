"""Checkpoint files that go wrong on purpose: ``load_bad FILE``, ``interrupted DIR``."""
from __future__ import annotations

import sys

import torch
from common import run
from resume import Net, batch

import mpisync


def train_one(m, opt, w: int) -> None:
    x, ids, y = batch(opt.global_step, w)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x, ids), y).backward()
    opt.step()


def worker(cluster) -> dict:
    mode, where = sys.argv[1], sys.argv[2]
    w = cluster.worker_index
    m = Net()
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adam(m.parameters(), lr=0.05),
                                        named_parameters=m.named_parameters())
    for _ in range(2):
        train_one(m, opt, w)
    out = {}
    if mode == "load_bad":
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        state = opt.state_dict()
        try:
            mpisync.load(where, m, opt)
            out["error"] = "loaded"
        except mpisync.ConfigError as exc:
            out["error"] = str(exc)
        after = opt.state_dict()
        out["unchanged"] = (all(torch.equal(before[n], p) for n, p in m.named_parameters())
                            and after["mpisync"]["global_step"] == 2
                            and torch.equal(state["state"][2]["exp_avg"],
                                            after["state"][2]["exp_avg"]))
        train_one(m, opt, w)                  # training goes on
    else:
        ck = mpisync.Checkpointer(where, m, opt, keep=3)
        ck.save(extra={"epoch": 1})
        train_one(m, opt, w)
        try:     # a lambda cannot be pickled: the write fails after the table went in
            mpisync.save(ck.path(opt.global_step), m, opt, extra={"bad": lambda: 0})
            out["error"] = "saved"
        except OSError as exc:
            out["error"] = str(exc)
    opt.close()
    return out


if __name__ == "__main__":
    run(worker)
