"""Train a DLRM on synthetic click logs, its embedding tables on the ps ranks.

DLRM (Naumov et al., 2019; TorchRec's ``torchrec.models.dlrm.DLRM``) is the model people
benchmark recommenders with: a bottom MLP over the dense features, one embedding table
per sparse feature pooled over its bag of ids, the pairwise dot products of all those
vectors (the feature interaction), a top MLP over the dense vector and the dot products,
and binary cross-entropy on the click. The layers here are TorchRec's: the bottom MLP
ends with a ReLU and the width of the tables' rows, the top MLP's last layer is linear.
Run it on 2 workers and 1 ps rank (this is ``make demo-dlrm``)::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- .venv/bin/python examples/dlrm.py

The tables are ``mpisync.EmbeddingBag(rows, dim, mode="sum")`` in one
``mpisync.EmbeddingBagCollection``: a step sends each ps rank one lookup for every table
it holds shards of, and the rows' gradients go back with the dense ones in the push.
The last ``--hashed`` features (default 1) carry unbounded 64-bit ids, as user or item
ids do in real click logs: their tables are ``mpisync.HashEmbeddingBag``s in the same
collection (a row is given to an id when it is first seen, on the ps rank that owns it;
its values are drawn with ``init_std`` the spread of the other tables' uniform initial
rows), looked up in the same exchange as the others.

The click logs come from a known true model, so the trained one can be compared with the
best possible predictor. The teacher is a small DLRM of its own, fixed by ``--seed``:
rows of width 4, a dense projection, pairwise dot products with random weights and a
first-order term per table, its logits scaled to a standard deviation of 1.6 and shifted
to a click rate of about 25%. The first-order terms carry most of the logits' variance
(the dot products about 3%): a run of the default length learns the first-order terms
well and the dot products in part, and it ends within 0.01 of the true model's AUC. Each
sample has 13 dense features and ``--tables`` bags of 1 to 3 ids, drawn Zipf-like over
each table's ``--rows`` rows (a few ids are common, most are rare); a hashed feature's ids
are its rows' fixed random 64-bit names. Every worker draws its own batches from
``numpy.random.default_rng([seed, worker_index, step])`` (a fresh batch each step, no
epochs); the held-out samples come from a stream no worker draws from.

Optimizers: DLRM's and TorchRec's recipe, a row-wise Adagrad for the tables
(``mpisync.RowWiseAdagrad``, TorchRec's ``EXACT_ROWWISE_ADAGRAD``: one accumulator per
row, ``--lr``) and Adam for the MLPs (``--dense-lr``), both in one
``SyncReplicasOptimizer([adam, rowwise], ...)``: a step is one push, one token and one
pull, the ps ranks applying each optimizer to its own parameters (the rows a step touched,
the MLPs' weights). ``--optimizer adagrad`` steps every parameter with one
``torch.optim.Adagrad`` instead, as ``ctr.py`` does.

With ``--checkpoint-dir DIR`` the job writes a checkpoint there every
``--checkpoint-every`` global steps (``mpisync.Checkpointer``) and resumes from the newest
one at start: each worker's batch of a global step is drawn from
``numpy.random.default_rng([seed, worker_index, step])``, so a job resumed (after a
failure under ``python -m mpisync.launch --restarts N``, or requeued by Slurm) draws the
batches an unbroken one draws.

The chief evaluates on the held-out samples at the end and prints the model's AUC and
log-loss beside the true model's and the constant predictor's (the click rate: AUC 0.5);
it exits non-zero unless the model's AUC is within ``--max-auc-gap`` (default 0.01) of
the true model's. With ``--local`` the same
model trains in one plain process on ``torch.nn.EmbeddingBag`` tables, without MPI ranks
(``mpisync.RowWiseAdagrad`` steps the tables there as any torch optimizer would).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

NUM_DENSE = 13
MAX_BAG = 3                   # ids per bag: 1 to 3
TEACHER_DIM = 4               # width of the true model's rows
TEACHER_STD = 1.6             # standard deviation of the true logits
FIRST_ORDER = 30.0            # weight of the first-order terms against the dot products
CLICK_RATE = 0.25             # about the mean click probability
TEACHER_STREAM = 1_000_000    # default_rng([seed, this]): the teacher's parameters
TEST_STREAM = 1_000_001       # ... the held-out samples (workers use 0, 1, ...)
NAMES_STREAM = 1_000_002      # ... the 64-bit ids of the hashed features' rows
CALIBRATION = 20_000          # samples the teacher's scale and shift are fixed on
EVAL_BATCH = 4096


# ---------------------------------------------------------------- the click logs

def zipf_cdf(rows: int, exponent: float = 1.2) -> np.ndarray:
    """The cumulative probabilities of ids ``0 .. rows - 1``, proportional to
    ``1 / (id + 1) ** exponent`` (id 0 is the commonest)."""
    p = 1.0 / np.arange(1, rows + 1) ** exponent
    return np.cumsum(p / p.sum())


class Batch:
    """Samples of the click logs: dense features, one bag of ids per table, clicks.

    ``ids[t]`` and ``offsets[t]`` are table ``t``'s bags as ``nn.EmbeddingBag`` takes them
    (int64 ids, where each sample's bag starts); ``true_prob`` the probability each click
    was drawn with.
    """

    def __init__(self, dense: np.ndarray, ids: list[np.ndarray], offsets: list[np.ndarray],
                 clicks: np.ndarray, true_prob: np.ndarray) -> None:
        self.dense, self.ids, self.offsets = dense, ids, offsets
        self.clicks, self.true_prob = clicks, true_prob

    def __len__(self) -> int:
        return len(self.clicks)

    def slice(self, start: int, stop: int) -> Batch:
        """Samples ``start .. stop - 1`` (offsets rebased to their first id)."""
        ids, offsets = [], []
        for t_ids, t_off in zip(self.ids, self.offsets):
            ends = np.append(t_off, len(t_ids))
            lo, hi = ends[start], ends[stop]
            ids.append(t_ids[lo:hi])
            offsets.append(t_off[start:stop] - lo)
        return Batch(self.dense[start:stop], ids, offsets, self.clicks[start:stop],
                     self.true_prob[start:stop])


class Teacher:
    """The true model: a small DLRM fixed by ``seed``; ``draw`` samples click logs from it.

    ``logit = shift + scale * raw`` with ``raw`` the sum of the pairwise dot products of
    ``tanh(dense @ A)`` and every table's pooled row (sum over the bag of width-4 rows),
    each with its own random weight, plus ``FIRST_ORDER`` times a first-order term per
    table (a random linear function of its pooled row); ``scale`` and
    ``shift`` are fixed on a draw of the teacher's own, so that the logits have a
    standard deviation of ``TEACHER_STD`` and the click rate is about ``CLICK_RATE``.
    """

    def __init__(self, seed: int, num_tables: int, rows: int, hashed: int = 0) -> None:
        if num_tables < 1 or rows < 1 or not 0 <= hashed <= num_tables:
            raise ValueError(f"the teacher needs at least one table of one row and at most "
                             f"as many hashed features as tables, got {num_tables} tables "
                             f"of {rows} rows, {hashed} hashed")
        rng = np.random.default_rng([seed, TEACHER_STREAM])
        self.num_tables, self.rows, self.cdf = num_tables, rows, zipf_cdf(rows)
        self.project = rng.normal(0.0, 1.0 / np.sqrt(NUM_DENSE), (NUM_DENSE, TEACHER_DIM))
        self.tables = rng.normal(0.0, 1.0, (num_tables, rows, TEACHER_DIM))
        self.first_order = rng.normal(0.0, 1.0, (num_tables, TEACHER_DIM))
        vectors = num_tables + 1
        self.pair_weight = np.triu(rng.normal(0.0, 1.0, (vectors, vectors)), k=1)
        self.scale, self.shift = 1.0, 0.0
        raw = self._raw(*self._features(rng, CALIBRATION))
        self.scale = TEACHER_STD / raw.std()
        # the mean of sigmoid(shift + N(0, std^2)) is about sigmoid(shift / sqrt(1 + pi std^2 / 8))
        self.shift = (np.log(CLICK_RATE / (1 - CLICK_RATE)) * np.sqrt(1 + np.pi * TEACHER_STD ** 2 / 8)
                      - self.scale * raw.mean())
        # the ids the samples carry: row numbers, or for the last ``hashed`` tables each
        # row's random 64-bit name (distinct, from a stream of their own)
        names = np.random.default_rng([seed, NAMES_STREAM])
        self.names = [None if t < num_tables - hashed else
                      names.choice(2 ** 62, rows, replace=False).astype(np.int64)
                      for t in range(num_tables)]

    def _features(self, rng: np.random.Generator, n: int):
        """Dense features and each table's bags (ids, offsets, lengths) for ``n`` samples."""
        dense = rng.standard_normal((n, NUM_DENSE))
        ids, offsets, lengths = [], [], []
        for _ in range(self.num_tables):
            length = rng.integers(1, MAX_BAG + 1, n)
            t_ids = np.minimum(np.searchsorted(self.cdf, rng.random(int(length.sum()))),
                               self.rows - 1)
            ids.append(t_ids.astype(np.int64))
            offsets.append(np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64))
            lengths.append(length)
        return dense, ids, offsets, lengths

    def _raw(self, dense, ids, offsets, lengths) -> np.ndarray:
        vectors = [np.tanh(dense @ self.project)]
        first = np.zeros(len(dense))
        for t in range(self.num_tables):
            bag = np.repeat(np.arange(len(dense)), lengths[t])
            pooled = np.zeros((len(dense), TEACHER_DIM))
            np.add.at(pooled, bag, self.tables[t][ids[t]])
            vectors.append(pooled)
            first += pooled @ self.first_order[t]
        stacked = np.stack(vectors, axis=1)                      # [n, tables + 1, 4]
        dots = np.einsum("nid,njd->nij", stacked, stacked)
        pairs = (dots * self.pair_weight).sum((1, 2)) / np.sqrt(len(vectors))
        return pairs + FIRST_ORDER * first / np.sqrt(self.num_tables)

    def draw(self, rng: np.random.Generator, n: int) -> Batch:
        """``n`` samples: features from ``rng``, clicks drawn with the true probabilities."""
        dense, ids, offsets, lengths = self._features(rng, n)
        logit = self.shift + self.scale * self._raw(dense, ids, offsets, lengths)
        prob = 1.0 / (1.0 + np.exp(-logit))
        clicks = rng.random(n) < prob
        shown = [rows if names is None else names[rows] for rows, names in zip(ids, self.names)]
        return Batch(dense.astype(np.float32), shown, offsets, clicks.astype(np.float32),
                     prob.astype(np.float32))


# ---------------------------------------------------------------- metrics

def auc(y: np.ndarray, p: np.ndarray) -> float:
    """Area under the ROC curve from the ranks of ``p`` (ties share their mean rank)."""
    y, p = np.asarray(y) > 0.5, np.asarray(p, dtype=np.float64)
    positives, negatives = int(y.sum()), int((~y).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs both clicks and non-clicks")
    order = np.argsort(p, kind="mergesort")
    _, first, counts = np.unique(p[order], return_index=True, return_counts=True)
    ranks = np.empty(len(p))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)       # 1-based mean ranks
    return float((ranks[y].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def log_loss(y: np.ndarray, p: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``p``, clipped to ``[eps, 1 - eps]``."""
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1.0 - eps)
    y = np.asarray(y, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


# ---------------------------------------------------------------- the model

def mlp(widths: list[int], last_relu: bool) -> torch.nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...``, a ReLU after each (the last too if
    ``last_relu``), as TorchRec's ``MLP`` and ``OverArch``."""
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class PairDots(torch.autograd.Function):
    """The pairwise dot products ``v_i . v_j``, ``i < j``, of each sample's vectors
    ``stacked`` ``[B, F, D]``: ``bmm(stacked, stacked^T)`` at the flattened positions
    ``pairs`` (``i * F + j``).

    The products are symmetric, so the gradient is one ``bmm``: with ``G`` the output's
    gradient at both ``(i, j)`` and ``(j, i)`` (``mirror``: ``j * F + i``),
    ``grad = G @ stacked``. Autograd's own backward of ``bmm(s, s^T)`` takes two ``bmm``s
    and adds them, and the three small batched products are a large part of a DLRM step on
    the CPU.
    """

    @staticmethod
    def forward(ctx, stacked: torch.Tensor, pairs: torch.Tensor,
                mirror: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(stacked, pairs, mirror)
        return torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1).index_select(1, pairs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        stacked, pairs, mirror = ctx.saved_tensors
        size, vectors, _ = stacked.shape
        grad = grad.to(stacked.dtype)    # under autocast the products were of lower precision
        full = grad.new_zeros(size, vectors * vectors)
        full.index_copy_(1, pairs, grad).index_copy_(1, mirror, grad)
        return torch.bmm(full.view(size, vectors, vectors), stacked), None, None


class DLRM(torch.nn.Module):
    """TorchRec's DLRM over any collection of tables that returns ``{feature: pooled}``.

    Args:
        tables: called as ``tables({feature: (ids, offsets)})``, returns ``{feature:
            [B, dim]}`` in ``features``' order (an ``mpisync.EmbeddingBagCollection``, or
            ``LocalTables`` in one process).
        features: the feature names, in the order of the interaction.
        dim: width of the tables' rows (the bottom MLP's last layer).
        bottom: hidden widths of the bottom MLP (before ``dim``).
        top: widths of the top MLP's layers after its input (the last is 1, the logit).

    ``forward(dense, sparse)`` returns the click logits ``[B]``: ``x = bottom(dense)``,
    ``v = [x, pooled...]``, ``top(cat(x, v_i . v_j for i < j))``.
    """

    def __init__(self, tables: torch.nn.Module, features: list[str], dim: int, *,
                 bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (64, 32, 1)) -> None:
        super().__init__()
        self.tables, self.features = tables, list(features)
        self.bottom = mlp([NUM_DENSE, *bottom, dim], last_relu=True)
        vectors = len(features) + 1
        self.top = mlp([dim + vectors * (vectors - 1) // 2, *top], last_relu=False)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        # the pairs i < j as positions in a flattened [F+1, F+1] block, and j, i (PairDots)
        self.register_buffer("pairs", rows * vectors + cols, persistent=False)
        self.register_buffer("mirror", cols * vectors + rows, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: dict) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.tables(sparse)
        stacked = torch.stack([x, *(pooled[f] for f in self.features)], dim=1)  # [B, F+1, D]
        return self.top(torch.cat([x, self.dots(stacked)], dim=1)).squeeze(1)

    def dots(self, stacked: torch.Tensor) -> torch.Tensor:
        """The interaction: ``v_i . v_j`` for ``i < j``, ``[B, F(F+1)/2]``."""
        return PairDots.apply(stacked, self.pairs, self.mirror)


class LocalTables(torch.nn.Module):
    """``torch.nn.EmbeddingBag`` tables in this process, called as the mpisync collection."""

    def __init__(self, tables: dict[str, torch.nn.EmbeddingBag]) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleDict(tables)

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        return {name: table(*features[name]) for name, table in self.tables.items()}


class LocalHashed(torch.nn.Module):
    """A plain ``torch.nn.EmbeddingBag`` of ``rows`` rows behind a map from 64-bit ids to
    rows, each id given the next free row when first seen, with the initial values
    ``mpisync.HashEmbeddingBag`` gives it (``mpisync.hashing.initial_rows``): the hash
    table's rule while its rows last (``--local``)."""

    def __init__(self, rows: int, dim: int, seed: int, init_std: float) -> None:
        super().__init__()
        # zeros until an id is seen: no draw from torch's generator, which the MLPs use next
        self.bag = torch.nn.EmbeddingBag.from_pretrained(torch.zeros(rows, dim), freeze=False,
                                                         mode="sum", sparse=True)
        self.seed, self.init_std = seed, init_std
        self.slots: dict[int, int] = {}

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from mpisync import hashing  # the hash tables' rows; no MPI
        new = [i for i in dict.fromkeys(ids.tolist()) if i not in self.slots]
        if len(self.slots) + len(new) > self.bag.num_embeddings:
            raise ValueError(f"{len(self.slots) + len(new)} distinct ids for "
                             f"{self.bag.num_embeddings} rows")
        if new:
            at = torch.arange(len(self.slots), len(self.slots) + len(new))
            self.slots.update(zip(new, at.tolist()))
            with torch.no_grad():
                self.bag.weight[at] = hashing.initial_rows(
                    torch.tensor(new), self.bag.embedding_dim, self.seed,
                    self.bag.weight.dtype, self.init_std)
        rows = torch.tensor([self.slots[i] for i in ids.tolist()], dtype=torch.int64)
        return self.bag(rows, offsets)


def feature_names(num_tables: int) -> list[str]:
    return [f"t{i}" for i in range(num_tables)]


def initial_rows(rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """A table's first values: uniform in +-sqrt(1 / rows), as TorchRec's tables start."""
    bound = (1.0 / rows) ** 0.5
    return torch.empty(rows, dim).uniform_(-bound, bound, generator=generator)


def hashed_std(rows: int) -> float:
    """A hash table's ``init_std``: the spread of ``initial_rows`` (uniform in +-b has
    standard deviation b / sqrt(3))."""
    return (3.0 * rows) ** -0.5


def optimizers(args, model: DLRM, tables: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """``--optimizer``: Adam for the MLPs and a row-wise Adagrad for the tables, or one
    Adagrad for every parameter."""
    if args.optimizer == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=args.lr)]
    from mpisync import RowWiseAdagrad
    in_tables = {id(p) for p in tables.parameters()}
    mlps = [p for p in model.parameters() if id(p) not in in_tables]
    return [torch.optim.Adam(mlps, lr=args.dense_lr),
            RowWiseAdagrad(list(tables.parameters()), lr=args.lr)]


class Stepped:
    """Several torch optimizers stepped as one (``--local``: what a
    ``SyncReplicasOptimizer`` given a list does on the ps ranks)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


def build(args, kind: str) -> tuple[DLRM, list[torch.optim.Optimizer]]:
    """The model and its optimizers (``optimizers``), the same on every worker.

    ``kind``: ``"mpisync"`` puts the tables on the ps ranks (one shard per ps rank, the
    chief's initial rows shipped there), ``"torch"`` keeps them here.
    """
    torch.manual_seed(args.seed)                  # the same MLPs on every worker
    generator = torch.Generator().manual_seed(args.seed)
    names = feature_names(args.tables)
    hashed = set(names[len(names) - args.hashed:]) if args.hashed else set()
    first = {name: initial_rows(args.rows, args.dim, generator) for name in names}
    if kind == "mpisync":
        # imported only here: --local runs without MPI
        import mpisync
        tables: torch.nn.Module = mpisync.EmbeddingBagCollection({
            name: mpisync.HashEmbeddingBag(args.dim, capacity_per_shard=args.rows,
                                           mode="sum", seed=args.seed,
                                           init_std=hashed_std(args.rows)) if name in hashed
            else mpisync.EmbeddingBag(args.rows, args.dim, mode="sum", weight=first[name])
            for name in names})
    elif kind == "torch":
        tables = LocalTables({
            name: LocalHashed(args.rows, args.dim, args.seed, hashed_std(args.rows))
            if name in hashed else
            torch.nn.EmbeddingBag.from_pretrained(first[name], freeze=False, mode="sum",
                                                  sparse=True)
            for name in names})
    else:
        raise ValueError(f"kind must be 'torch' or 'mpisync', got {kind!r}")
    model = DLRM(tables, names, args.dim)
    return model, optimizers(args, model, tables)


def inputs(batch: Batch, names: list[str]) -> tuple[torch.Tensor, dict]:
    """The model's inputs: the dense tensor and ``{feature: (ids, offsets)}``."""
    sparse = {name: (torch.from_numpy(ids), torch.from_numpy(offsets))
              for name, ids, offsets in zip(names, batch.ids, batch.offsets)}
    return torch.from_numpy(batch.dense), sparse


# ---------------------------------------------------------------- training

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="training steps")
    parser.add_argument("--batch", type=int, default=2048, help="samples per worker per step")
    parser.add_argument("--tables", type=int, default=26, help="sparse features, a table each")
    parser.add_argument("--rows", type=int, default=100, help="rows of each table")
    parser.add_argument("--hashed", type=int, default=1,
                        help="the last this many features carry 64-bit ids, looked up in "
                             "mpisync.HashEmbeddingBag tables (a row per id seen)")
    parser.add_argument("--dim", type=int, default=16, help="width of the tables' rows")
    parser.add_argument("--optimizer", choices=("adam+rowwise", "adagrad"),
                        default="adam+rowwise",
                        help="adam+rowwise: Adam for the MLPs and mpisync.RowWiseAdagrad for "
                             "the tables, in one SyncReplicasOptimizer; adagrad: one "
                             "torch.optim.Adagrad for every parameter")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of the tables' Adagrad (of every parameter's "
                             "with --optimizer adagrad)")
    parser.add_argument("--dense-lr", type=float, default=0.003,
                        help="Adam's learning rate, for the MLPs")
    parser.add_argument("--test-samples", type=int, default=20_000)
    parser.add_argument("--max-auc-gap", type=float, default=0.01, metavar="GAP",
                        help="exit non-zero unless the model's held-out AUC is at least the "
                             "true model's minus GAP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100, help="steps between log lines")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="write checkpoints here and resume from the newest at start")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                        help="global steps between checkpoints (with --checkpoint-dir)")
    parser.add_argument("--local", action="store_true",
                        help="train in one plain process on torch.nn.EmbeddingBag tables")
    args = parser.parse_args()
    # at least 100 held-out samples: the AUC needs clicks and non-clicks among them
    for name, least in (("steps", 1), ("batch", 1), ("tables", 1), ("rows", 1), ("dim", 1),
                        ("test_samples", 100), ("checkpoint_every", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got "
                         f"{getattr(args, name)}")
    if not 0 <= args.max_auc_gap < 0.5:
        parser.error(f"--max-auc-gap must be at least 0 and below 0.5, got {args.max_auc_gap}")
    args.max_auc_gap += 0.0              # -0 reads as 0
    if not 0 <= args.hashed <= args.tables:
        parser.error(f"--hashed must be between 0 and --tables ({args.tables}), got "
                     f"{args.hashed}")
    return args


def run_steps(args, model, opt, teacher: Teacher, worker: int, *, first: int = 1,
              log: bool = True, metric=None, ckpt=None) -> None:
    """Steps ``first .. --steps``, each on a fresh batch of ``--batch`` samples drawn from
    ``default_rng([seed, worker, step])``.

    ``metric``: an ``mpisync.Mean`` that records each batch's loss locally; ``ckpt``: an
    ``mpisync.Checkpointer`` offered every step (``maybe_save``).
    """
    loss_fn = torch.nn.BCEWithLogitsLoss()
    recent, start = [], time.perf_counter()
    for step in range(first, args.steps + 1):
        # a SyncReplicasOptimizer with backup workers stops once the others have finished
        if getattr(opt, "stopped", False):
            return
        batch = teacher.draw(np.random.default_rng([args.seed, worker, step]), args.batch)
        dense, sparse = inputs(batch, model.features)
        opt.zero_grad()
        loss = loss_fn(model(dense, sparse), torch.from_numpy(batch.clicks))
        loss.backward()
        opt.step()
        if ckpt is not None:
            ckpt.maybe_save()
        if metric is not None:
            metric.update(loss.detach(), weight=len(batch))
        recent.append(loss.item())
        if log and step % args.log_every == 0:
            print(f"step {step:5d}  loss {np.mean(recent):.4f}  "
                  f"elapsed {time.perf_counter() - start:.2f} s", flush=True)
            recent.clear()


def evaluate(model: DLRM, test: Batch) -> dict[str, tuple[float, float]]:
    """``(AUC, log-loss)`` on the held-out samples of the model and of the true model."""
    with torch.no_grad():
        preds = []
        for i in range(0, len(test), EVAL_BATCH):
            dense, sparse = inputs(test.slice(i, min(i + EVAL_BATCH, len(test))),
                                   model.features)
            preds.append(torch.sigmoid(model(dense, sparse)))
    scores = {"model": torch.cat(preds).numpy(), "true": test.true_prob,
              "constant": np.full(len(test), float(test.clicks.mean()))}
    return {name: (auc(test.clicks, p), log_loss(test.clicks, p)) for name, p in scores.items()}


def header(args, test: Batch, where: str, num_workers: int) -> str:
    return (f"dlrm: {args.tables} tables of {args.rows} rows x {args.dim} ({args.hashed} "
            f"hashed), {NUM_DENSE} dense "
            f"features, {where}, global batch {args.batch * num_workers}, {args.steps} steps; "
            f"held-out click rate {float(test.clicks.mean()):.3f} on {len(test)} samples")


def report(scores, seconds: float, max_gap: float, stats: dict | None = None,
           train_loss: float | None = None) -> None:
    (model_auc, model_ll), (true_auc, true_ll) = scores["model"], scores["true"]
    constant_ll = scores["constant"][1]
    print(f"test AUC: {model_auc:.4f} (true model: {true_auc:.4f}, constant click rate: 0.5)")
    print(f"test log-loss: {model_ll:.4f} (true model: {true_ll:.4f}, constant click rate: "
          f"{constant_ll:.4f})")
    if train_loss is not None:
        print(f"every worker's training log-loss: {train_loss:.4f}")
    line = f"training took {seconds:.2f} s"
    if stats is not None:
        line += (f"; global_step {stats['global_step']}, "
                 f"gradients_applied {stats['gradients_applied']}, "
                 f"gradients_dropped {stats['gradients_dropped']}")
    print(line, flush=True)
    gap = true_auc - model_auc
    print(f"dlrm: the model's AUC is {abs(gap):.4f} {'below' if gap >= 0 else 'above'} the "
          f"true model's (at most {max_gap} below asked)", flush=True)
    if not model_auc >= true_auc - max_gap:
        raise SystemExit(f"dlrm: test AUC {model_auc:.4f} is more than {max_gap} below the "
                         f"true model's ({true_auc:.4f})")


def train_local(args) -> None:
    """Train in this process alone, on ``torch.nn.EmbeddingBag`` tables."""
    teacher = Teacher(args.seed, args.tables, args.rows, args.hashed)
    test = teacher.draw(np.random.default_rng([args.seed, TEST_STREAM]), args.test_samples)
    model, opts = build(args, "torch")
    opt = Stepped(opts)
    print(header(args, test, "one process", 1), flush=True)
    start = time.perf_counter()
    run_steps(args, model, opt, teacher, 0)
    seconds = time.perf_counter() - start
    report(evaluate(model, test), seconds, args.max_auc_gap)


def train(args, cluster) -> None:
    """Train as one worker of an mpisync job; the chief evaluates and reports."""
    import mpisync
    teacher = Teacher(args.seed, args.tables, args.rows, args.hashed)
    model, opts = build(args, "mpisync")
    opt = mpisync.SyncReplicasOptimizer(opts, named_parameters=model.named_parameters(),
                                        cluster=cluster)
    test = None
    if cluster.is_chief:
        test = teacher.draw(np.random.default_rng([args.seed, TEST_STREAM]), args.test_samples)
        where = f"{cluster.num_workers} workers, {cluster.num_ps} ps"
        print(header(args, test, where, cluster.num_workers), flush=True)
    ckpt = None
    if args.checkpoint_dir is not None:
        ckpt = mpisync.Checkpointer(args.checkpoint_dir, model, opt,
                                    every_steps=args.checkpoint_every, keep=2)
        ckpt.resume()
        if cluster.is_chief and opt.global_step:
            print(f"dlrm: resumed from {args.checkpoint_dir} at global step "
                  f"{opt.global_step}", flush=True)
    start = time.perf_counter()
    metric = mpisync.Mean()
    run_steps(args, model, opt, teacher, cluster.worker_index, first=opt.global_step + 1,
              log=cluster.is_chief, metric=metric, ckpt=ckpt)
    # the tables' rows live on the ps ranks: evaluate before close() stops them
    scores = evaluate(model, test) if test is not None else None
    opt.close()                               # on every worker, then collectives among them
    train_loss = float(metric.compute())      # collective: every worker reads
    if cluster.is_chief:
        report(scores, time.perf_counter() - start, args.max_auc_gap, opt.stats, train_loss)


def main() -> None:
    args = parse_args()
    if args.local:
        train_local(args)
        return
    # imported only here: --local needs no MPI
    import mpisync
    cluster = mpisync.init()
    if cluster.is_ps:
        cluster.serve()
    else:
        train(args, cluster)


if __name__ == "__main__":
    main()
