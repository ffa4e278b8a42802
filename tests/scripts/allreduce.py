"""dense="allreduce" in the loops people write, against plain torch (see test_allreduce_jobs.py).

Each case trains under mpisync with the dense parameters averaged among the workers, and
``reference(case)`` trains the same model in one process: per step, every worker's loss
(each micro-batch's) divided by the number of workers, backward, clipping, the step, and
the moving averages by their formula. A case's model may use a parameter on some workers
only (``branch``), or on one worker only with a table every worker uses (``table-branch``).
``--backend=horovod`` first runs the cases with Horovod's allreduce.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from common import dataset, emit, run

import mpisync

WORKERS, BATCH, STEPS = 2, 6, 6
ROWS, DIM, FIELDS = 40, 3, 2
F64 = torch.float64


@dataclass
class Case:
    name: str
    optimizer: str = "adam"          # "adam" | "sgd" (momentum 0.9)
    model: str = "mlp"               # "mlp" | "mixed" | "branch" | "table" | "table-branch"
    clip: float | None = None        # clip_grad_norm_ of the dense parameters after backward
    micro: int = 1                   # backward passes per step (gradient accumulation)
    zero: str = "none"               # zero_grad(set_to_none=True), or "zeros"
    restore_at: int | None = None    # state_dict() after this step, loaded into a new job
    unfreeze_at: int | None = None   # the body is frozen when wrapped, trained from this step
    plateau: bool = False            # ReduceLROnPlateau stepped with each worker's own loss
    sync: dict = field(default_factory=dict)
    steps: int = STEPS


CASES = [
    Case("adam"),
    Case("sgd-momentum-zeros", optimizer="sgd", zero="zeros"),
    Case("clip-after-backward", clip=0.05),
    Case("accumulate-two-backwards", optimizer="sgd", micro=2),
    Case("accumulate-and-clip-zeros", micro=3, clip=0.02, zero="zeros"),
    Case("mixed-dtypes-small-buckets", model="mixed", sync={"bucket_bytes": 64}),
    Case("branch-on-one-worker", model="branch", optimizer="sgd"),
    Case("table-adam", model="table"),
    Case("table-sgd-momentum", model="table", optimizer="sgd"),
    Case("table-branch-one-worker", model="table-branch", optimizer="sgd"),
    Case("ema-num-updates", sync={"ema_decay": 0.9, "ema_num_updates": True}),
    Case("restore-adam-ema", restore_at=2, sync={"ema_decay": 0.8}),
    Case("restore-table", model="table", restore_at=3),
    Case("sum-reduction", optimizer="sgd", sync={"reduction": "sum"}),
    Case("unfreeze-later", optimizer="sgd", unfreeze_at=2),
    Case("table-only-micro-batches", model="table-branch", micro=2),
    Case("plateau-on-own-loss", plateau=True),
    Case("scalar-parameter", model="scalar", optimizer="sgd", zero="zeros"),
]
BY_NAME = {c.name: c for c in CASES}


class Net(torch.nn.Module):
    """An MLP; ``mixed``: a float32 layer before a float64 one; ``branch``: a parameter
    added on worker 0 at odd steps only; ``table``: an embedding before the MLP."""

    def __init__(self, kind: str, plain: bool):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        width = 10 + (DIM * FIELDS if kind.startswith("table") else 0)
        self.body = torch.nn.Linear(width, 8).to(torch.float32 if kind == "mixed" else F64)
        self.head = torch.nn.Linear(8, 3).to(F64)
        self.extra = torch.nn.Parameter(torch.full((3,), 0.25, dtype=F64))
        if kind == "scalar":
            self.scale = torch.nn.Parameter(torch.tensor(0.5, dtype=F64))
        self.emb = None
        if kind.startswith("table"):
            w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3), dtype=F64)
            if plain:
                self.emb = torch.nn.Embedding(ROWS, DIM, dtype=F64)
                with torch.no_grad():
                    self.emb.weight.copy_(w)
            else:
                self.emb = mpisync.Embedding(ROWS, DIM, weight=w, dtype=F64,
                                             partitioner=mpisync.fixed_size(2))
            self.register_buffer("proj", torch.randn(DIM * FIELDS, 3, dtype=F64,
                                                     generator=torch.Generator().manual_seed(4)))

    def forward(self, x, ids, worker: int, t: int):
        if self.kind == "table-branch":       # worker 1 touches only the table
            out = self.emb(ids).flatten(1) @ self.proj
            return out + self.head(torch.tanh(self.body(torch.cat(
                [x, torch.zeros(len(x), DIM * FIELDS, dtype=F64)], 1)))) if worker == 0 else out
        if self.emb is not None:
            x = torch.cat([x, self.emb(ids).flatten(1)], 1)
        h = torch.tanh(self.body(x.to(self.body.weight.dtype))).to(F64)
        out = self.head(h)
        if self.kind == "branch" and worker == 0 and t % 2:
            out = out + self.extra
        if self.kind == "scalar":
            out = out * self.scale.exp()        # CLIP's logit_scale: a 0-dim parameter
        return out


def make_optimizer(case: Case, m: Net) -> torch.optim.Optimizer:
    if case.unfreeze_at is not None:
        m.body.requires_grad_(False)         # frozen now, in the group all the same
    if case.optimizer == "sgd":
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(m.parameters(), lr=0.02)


def data(steps: int):
    x, y = dataset(WORKERS * BATCH * steps, seed=5, dtype=F64)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, ROWS, (len(x), FIELDS), generator=g)
    return x, y, ids


def micro_losses(case: Case, m: Net, worker: int, t: int, x, y, ids):
    """This worker's loss at step t, as ``case.micro`` micro-batch losses that sum to it."""
    lo = t * WORKERS * BATCH + worker * BATCH
    size = BATCH // case.micro
    for k in range(case.micro):
        rows = slice(lo + k * size, lo + (k + 1) * size)
        out = m(x[rows], ids[rows], worker, t)
        yield torch.nn.functional.cross_entropy(out, y[rows]) / case.micro


def dense_params(m: Net) -> list[torch.Tensor]:
    return [p for n, p in m.named_parameters() if not n.startswith("emb")]


def reference(case: Case) -> dict:
    """Plain torch in one process: all the workers' losses per step, then one step."""
    m = Net(case.model, plain=True)
    opt = make_optimizer(case, m)
    x, y, ids = data(case.steps)
    decay = case.sync.get("ema_decay")
    avg = {n: p.detach().clone() for n, p in m.named_parameters()}
    scale = 1.0 if case.sync.get("reduction") == "sum" else 1.0 / WORKERS
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5) \
        if case.plateau else None
    for t in range(case.steps):
        if t == case.unfreeze_at:
            m.body.requires_grad_(True)
        opt.zero_grad(set_to_none=case.zero == "none")
        chief_loss = 0.0
        for w in range(WORKERS):
            for loss in micro_losses(case, m, w, t, x, y, ids):
                (loss * scale).backward()
                chief_loss += loss.item() if w == 0 else 0.0
        if case.clip:
            torch.nn.utils.clip_grad_norm_(dense_params(m), case.clip)
        opt.step()
        if decay is not None:
            n_t = t + 1
            d = min(decay, (1 + n_t) / (10 + n_t)) if case.sync.get("ema_num_updates") else decay
            for n, p in m.named_parameters():
                avg[n].lerp_(p.detach(), 1.0 - d)
        if plateau is not None:
            plateau.step(chief_loss)         # the chief's values are the ones applied
    out = dict(snapshot(m, opt), table=table_of(m))
    if decay is not None:
        out["averages"] = {n: v.tolist() for n, v in avg.items() if not n.startswith("emb")}
    return out


def snapshot(m: Net, opt) -> dict:
    """The dense parameters and their optimizer state, by name (the table's apart)."""
    names = [n for n, _ in m.named_parameters()]
    params = {n: p.detach().tolist() for n, p in m.named_parameters() if not n.startswith("emb")}
    state = opt.state_dict()["state"]
    return {"params": params,
            "state": {names[i]: {k: v.tolist() for k, v in s.items() if torch.is_tensor(v)}
                      for i, s in state.items() if not names[i].startswith("emb")}}


def table_of(m: Net) -> list:
    if m.emb is None:
        return []
    if isinstance(m.emb, mpisync.Embedding):
        return m.emb.rows(torch.arange(ROWS)).tolist()
    return m.emb.weight.detach().tolist()


def train(cluster, case: Case, extra: dict) -> dict:
    w = cluster.worker_index
    x, y, ids = data(case.steps)

    def wrap(m: Net):
        return mpisync.SyncReplicasOptimizer(make_optimizer(case, m),
                                             named_parameters=m.named_parameters(),
                                             dense="allreduce", **case.sync, **extra)

    m = Net(case.model, plain=False)
    opt = wrap(m)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5) \
        if case.plateau else None
    grads_after_backward = []
    for t in range(case.steps):
        if t == case.unfreeze_at:
            m.body.requires_grad_(True)
        if case.restore_at is not None and t == case.restore_at:
            saved, model_state = opt.state_dict(), m.state_dict()
            opt.close()
            m = Net(case.model, plain=False)
            m.load_state_dict(model_state)
            opt = wrap(m)
            opt.load_state_dict(saved)
        opt.zero_grad(set_to_none=case.zero == "none")
        own_loss = 0.0
        for loss in micro_losses(case, m, w, t, x, y, ids):
            loss.backward()
            own_loss += loss.item()
        if t == 0:       # what backward left in .grad: the mean over the workers already
            grads_after_backward = [p.grad.tolist() if p.grad is not None else None
                                    for p in dense_params(m)]
        if case.clip:
            torch.nn.utils.clip_grad_norm_(dense_params(m), case.clip)
        opt.step()
        if plateau is not None:
            plateau.step(own_loss)           # a metric of this worker's batch alone
    out = snapshot(m, opt)
    if "ema_decay" in case.sync:
        out["averages"] = {n: v.tolist() for n, v in opt.averages().items()
                           if not n.startswith("emb")}
    out.update(global_step=opt.global_step, grads_after_backward=grads_after_backward,
               table=table_of(m), plan=str(opt.plan), stats_bytes=opt.stats["bytes_per_ps"])
    opt.close()
    return out


def worker(cluster):
    names, extra = sys.argv[1:], {}
    if names and names[0].startswith("--backend="):
        extra["allreduce_backend"] = names.pop(0).split("=", 1)[1]
    for name in names:
        emit(role="worker", worker=cluster.worker_index, case=name,
             **train(cluster, BY_NAME[name], extra))


if __name__ == "__main__":
    run(worker)
