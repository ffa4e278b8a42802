"""Predict clicks on synthetic click logs with an embedding table held on the ps ranks.

The click logs come from a seeded generator whose ground truth is known, so the model can
be compared with the best possible predictor. Each sample has 26 categorical fields and 13
dense features. Every field has its own vocabulary (50 to 20,000 ids, Zipf-like: a few
ids are common, most are rare, as in real click logs) and a hidden effect per id; the
dense features have a hidden linear effect plus one pairwise interaction; a click is drawn
from ``sigmoid(bias + sum of effects)``, about 20% of the samples. As in DLRM, the fields
share ONE id space (global id = the field's offset + its local id), so one embedding table
of ``total_ids(seed)`` rows serves all of them; here it is an ``mpisync.Embedding`` whose
rows live on the ps ranks. Run it on 2 workers and 1 ps rank::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- .venv/bin/python examples/ctr.py

Every worker builds the same model from the same seed and takes its slice of each global
batch (``batch_size * num_workers`` samples of one permutation per epoch), as in
``digits.py``. The chief evaluates on held-out samples of the same generator and prints
the log-loss and AUC of the model, of the constant predictor (the training click rate)
and of the true model (the generator's own probabilities); it exits non-zero unless the
model's log-loss is at least 2% below the constant predictor's. With ``--local`` the same
model trains in one plain process on a ``torch.nn.Embedding``, without MPI or mpisync.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

NUM_FIELDS = 26
NUM_DENSE = 13
MIN_VOCAB, MAX_VOCAB = 50, 20_000
BIAS = -1.9                                  # the effects' spread lifts the CTR to ~21%
MIN_LOG_LOSS_GAIN = 0.02                     # the model must beat the constant by 2%
EVAL_BATCH = 4096


# ---------------------------------------------------------------- the click logs

def _streams(seed: int) -> list[np.random.Generator]:
    """Independent generators for the vocabulary sizes, the true effects and the samples."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]


def field_vocab_sizes(seed: int, num_fields: int = NUM_FIELDS) -> np.ndarray:
    """Each field's vocabulary size, log-uniform in [50, 20000], fixed by ``seed``."""
    rng = _streams(seed)[0]
    sizes = np.exp(rng.uniform(np.log(MIN_VOCAB), np.log(MAX_VOCAB), num_fields))
    return sizes.round().astype(np.int64)


def total_ids(seed: int, num_fields: int = NUM_FIELDS) -> int:
    """Rows of the shared embedding table: the sum of the fields' vocabulary sizes."""
    return int(field_vocab_sizes(seed, num_fields).sum())


def _zipf(size: int, exponent: float) -> np.ndarray:
    """Probabilities proportional to ``1 / (rank + 1) ** exponent``; local id 0 is the commonest."""
    p = 1.0 / np.arange(1, size + 1) ** exponent
    return p / p.sum()


def generate(n_samples: int, seed: int, *, num_fields: int = NUM_FIELDS,
             vocab_sizes: np.ndarray | None = None, num_dense: int = NUM_DENSE,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Draw ``n_samples`` click-log samples; the ground truth is fixed by ``seed``.

    Args:
        n_samples: number of samples; draw the training and the test set in one call and
            split them, so that they share the ground truth.
        seed: fixes the vocabulary sizes, the true effects and the samples.
        num_fields: categorical fields per sample.
        vocab_sizes: the fields' vocabulary sizes; default
            ``field_vocab_sizes(seed, num_fields)``.
        num_dense: dense features per sample (at least 2: two of them interact).

    Returns:
        ``cat_ids`` (int64 ``[n, num_fields]``, global ids: field ``f``'s local id plus the
        sum of the vocabulary sizes of fields ``0 .. f-1``), ``dense`` (float32
        ``[n, num_dense]``), ``clicks`` (float32 ``[n]``, 0 or 1) and ``true_prob``
        (float32 ``[n]``, the probability each click was drawn with).
    """
    sizes = np.asarray(field_vocab_sizes(seed, num_fields) if vocab_sizes is None
                       else vocab_sizes, dtype=np.int64)
    if sizes.shape != (num_fields,) or (sizes < 1).any():
        raise ValueError(f"vocab_sizes must be {num_fields} positive sizes, got {sizes}")
    if num_dense < 2:
        raise ValueError(f"num_dense must be at least 2, got {num_dense}")
    _, truth, draw = _streams(seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    cat_ids = np.empty((n_samples, num_fields), dtype=np.int64)
    logit = np.full(n_samples, BIAS)
    weak = truth.random(num_fields) < 0.3     # about a third of the fields barely matter
    for f, size in enumerate(sizes):
        p = _zipf(int(size), truth.uniform(1.0, 1.3))
        scale = 0.05 if weak[f] else truth.uniform(0.15, 0.45)
        effect = truth.normal(0.0, scale, size)
        effect -= p @ effect                  # centred: BIAS alone sets the mean logit
        local = draw.choice(int(size), n_samples, p=p)
        cat_ids[:, f] = offsets[f] + local
        logit += effect[local]
    dense = draw.standard_normal((n_samples, num_dense))
    logit += dense @ truth.normal(0.0, 0.3, num_dense) + 0.4 * dense[:, 0] * dense[:, 1]
    true_prob = 1.0 / (1.0 + np.exp(-logit))
    clicks = draw.random(n_samples) < true_prob
    return (cat_ids, dense.astype(np.float32), clicks.astype(np.float32),
            true_prob.astype(np.float32))


# ---------------------------------------------------------------- metrics

def auc(y: np.ndarray, p: np.ndarray) -> float:
    """Area under the ROC curve (ties count one half). scikit-learn is imported here, where
    it is used: the ps ranks never pay its import (about 1.4 s of CPU, through SciPy)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p))


def log_loss(y: np.ndarray, p: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``p``, clipped to ``[eps, 1 - eps]``."""
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1.0 - eps)
    y = np.asarray(y, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


# ---------------------------------------------------------------- the model

class CTRNet(torch.nn.Module):
    """Embeddings of the categorical ids, flattened and joined to the dense features, an MLP.

    Args:
        emb: called as ``emb(ids)`` with int64 ids ``[B, num_fields]``; returns
            ``[B, num_fields, embedding_dim]``.
        num_dense: dense features per sample.
        num_fields: categorical fields per sample.
        embedding_dim: width of ``emb``'s rows.
        hidden: widths of the MLP's hidden layers.

    ``forward(ids, dense)`` returns the click logits ``[B]``.
    """

    def __init__(self, emb: torch.nn.Module, num_dense: int, *, num_fields: int = NUM_FIELDS,
                 embedding_dim: int, hidden: tuple[int, ...] = (64, 32)) -> None:
        super().__init__()
        self.emb = emb
        layers: list[torch.nn.Module] = []
        width = num_fields * embedding_dim + num_dense
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb(ids).flatten(1), dense], dim=1)
        return self.mlp(x).squeeze(1)


def make_embedding(total_ids: int, dim: int, kind: str, *, num_ps: int = 1,
                   seed: int = 0) -> torch.nn.Module:
    """The embedding table: ``"torch"`` in this process, ``"mpisync"`` on the ps ranks.

    ``"mpisync"`` spreads the rows over ``num_ps`` ps ranks (row ``i`` on ps ``i % num_ps``)
    and draws them from ``seed``; it needs a running mpisync job.
    """
    if kind == "torch":
        return torch.nn.Embedding(total_ids, dim)
    if kind == "mpisync":
        # imported only here: --local runs without MPI
        import mpisync
        return mpisync.Embedding(total_ids, dim, partitioner=mpisync.fixed_size(num_ps),
                                 partition_strategy="mod", seed=seed)
    raise ValueError(f"kind must be 'torch' or 'mpisync', got {kind!r}")


# ---------------------------------------------------------------- training

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1,
                        help="passes over the training set (CTR models overfit after one or two)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per worker per step")
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument("--samples", type=int, default=60_000, help="training samples")
    parser.add_argument("--test-samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    parser.add_argument("--local", action="store_true",
                        help="train in one plain process on a torch.nn.Embedding (no MPI)")
    return parser.parse_args()


def load_data(args):
    """Training and test tensors ``(ids, dense, clicks, true_prob)`` of one ground truth."""
    data = generate(args.samples + args.test_samples, args.seed)
    tensors = [torch.from_numpy(a) for a in data]
    return ([t[:args.samples] for t in tensors], [t[args.samples:] for t in tensors])


def build(args, kind: str, num_ps: int = 1):
    """The model and its Adagrad optimizer, the same on every worker."""
    torch.manual_seed(args.seed)              # same MLP on every worker
    emb = make_embedding(total_ids(args.seed), args.dim, kind, num_ps=num_ps, seed=args.seed)
    model = CTRNet(emb, NUM_DENSE, embedding_dim=args.dim)
    return model, torch.optim.Adagrad(model.parameters(), lr=args.lr)


def run_epochs(args, model, opt, train, steps_per_epoch: int, *, num_workers: int = 1,
               worker_index: int = 0, log: bool = True, metrics=None) -> float:
    """Train; each worker takes its slice of every global batch. Its mean loss at the end.

    ``metrics``: ``(mpisync.Mean, mpisync.Accuracy)`` that record each batch's log-loss
    and click accuracy locally, reset each epoch (read them on every worker afterwards).
    """
    ids, dense, clicks, _ = train
    B, W, me = args.batch_size, num_workers, worker_index
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses, recent, step, start = [], [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(ids),
                              generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        for metric in metrics or ():
            metric.reset()
        for i in range(steps_per_epoch):
            # a SyncReplicasOptimizer with backup workers stops once the others have
            # finished; a plain torch optimizer has no such attribute and never stops
            if getattr(opt, "stopped", False):
                return float(np.mean(losses))
            idx = perm[(i * W + me) * B:(i * W + me + 1) * B]
            opt.zero_grad()
            logits = model(ids[idx], dense[idx])
            loss = loss_fn(logits, clicks[idx])
            loss.backward()
            opt.step()
            if metrics is not None:           # local records: no communication
                metrics[0].update(loss.detach(), weight=len(idx))
                metrics[1].update(logits.detach(), clicks[idx])
            step += 1
            losses.append(loss.item())
            recent.append(loss.item())
            if log and step % args.log_every == 0:
                print(f"step {step:5d}  epoch {epoch}  loss {np.mean(recent):.4f}  "
                      f"elapsed {time.perf_counter() - start:.2f} s", flush=True)
                recent.clear()
    return float(np.mean(losses[-steps_per_epoch:]))


def steps_per_epoch_of(args, num_workers: int) -> int:
    steps = args.samples // (args.batch_size * num_workers)   # drop the ragged end: equal
    if steps == 0:                                           # step counts on every worker
        raise SystemExit(f"--batch-size {args.batch_size} x {num_workers} workers exceeds "
                         f"the {args.samples} training samples")
    return steps


def predict(model, ids: torch.Tensor, dense: torch.Tensor) -> np.ndarray:
    """Click probabilities, in batches of ``EVAL_BATCH`` samples."""
    with torch.no_grad():
        return torch.cat([torch.sigmoid(model(ids[i:i + EVAL_BATCH], dense[i:i + EVAL_BATCH]))
                          for i in range(0, len(ids), EVAL_BATCH)]).numpy()


def evaluate(model, train, test) -> dict[str, tuple[float, float]]:
    """``(log-loss, AUC)`` on the test set of the model, the constant and the true model."""
    clicks, true_prob = test[2].numpy(), test[3].numpy()
    rate = float(train[2].mean())
    preds = {"model": predict(model, test[0], test[1]),
             "constant": np.full(len(clicks), rate),
             "true": true_prob}
    return {name: (log_loss(clicks, p), auc(clicks, p)) for name, p in preds.items()}


def header(args, train, test, num_workers: int, num_ps: int, steps_per_epoch: int) -> str:
    where = "one process" if args.local else f"{num_workers} workers, {num_ps} ps"
    return (f"ctr: {len(train[0])} train / {len(test[0])} test samples, "
            f"{total_ids(args.seed)} ids x {args.dim}, training click rate "
            f"{float(train[2].mean()):.3f}, {where}, global batch "
            f"{args.batch_size * num_workers}, {steps_per_epoch} steps/epoch, "
            f"{args.epochs} epochs")


def report(scores, seconds: float, stats: dict | None = None, train_metrics=None) -> None:
    (model_ll, model_auc), (const_ll, _), (true_ll, true_auc) = (
        scores["model"], scores["constant"], scores["true"])
    print(f"test log-loss: {model_ll:.4f} (constant predictor: {const_ll:.4f}, "
          f"true model: {true_ll:.4f})")
    print(f"test AUC: {model_auc:.4f} (constant predictor: 0.5, true model: {true_auc:.4f})")
    if train_metrics is not None:
        print(f"last epoch, every worker's examples: training log-loss {train_metrics[0]:.4f}, "
              f"click accuracy {train_metrics[1]:.3f}")
    line = f"training took {seconds:.2f} s"
    if stats is not None:
        line += (f"; global_step {stats['global_step']}, "
                 f"gradients_applied {stats['gradients_applied']}, "
                 f"gradients_dropped {stats['gradients_dropped']}, "
                 f"taken_per_worker {stats['taken_per_worker']}")
    print(line, flush=True)
    if model_ll > (1.0 - MIN_LOG_LOSS_GAIN) * const_ll:
        raise SystemExit(f"ctr: test log-loss {model_ll:.4f} is not {MIN_LOG_LOSS_GAIN:.0%} "
                         f"below the constant predictor's {const_ll:.4f}")


def train_local(args) -> None:
    """Train in this process alone, on a ``torch.nn.Embedding``."""
    train_set, test = load_data(args)
    model, opt = build(args, "torch")
    steps = steps_per_epoch_of(args, 1)
    print(header(args, train_set, test, 1, 0, steps), flush=True)
    start = time.perf_counter()
    run_epochs(args, model, opt, train_set, steps)
    seconds = time.perf_counter() - start
    report(evaluate(model, train_set, test), seconds)


def train(args, cluster) -> None:
    """Train as one worker of an mpisync job; the chief evaluates and reports."""
    import mpisync
    train_set, test = load_data(args)
    model, adagrad = build(args, "mpisync", cluster.num_ps)
    opt = mpisync.SyncReplicasOptimizer(adagrad, named_parameters=model.named_parameters(),
                                        cluster=cluster)
    W = cluster.num_workers
    steps = steps_per_epoch_of(args, W)       # close() runs at exit if this fails
    if cluster.is_chief:
        print(header(args, train_set, test, W, cluster.num_ps, steps), flush=True)
    start = time.perf_counter()
    metrics = mpisync.Mean(), mpisync.Accuracy(threshold=0.0)     # logits: click if > 0
    run_epochs(args, model, opt, train_set, steps, num_workers=W,
               worker_index=cluster.worker_index, log=cluster.is_chief, metrics=metrics)
    # the embedding's rows live on the ps ranks: evaluate before close() stops them
    scores = evaluate(model, train_set, test) if cluster.is_chief else None
    opt.close()                               # on every worker, then collectives among them
    train_metrics = [m.compute() for m in metrics]      # collective: every worker reads
    if cluster.is_chief:
        report(scores, time.perf_counter() - start, opt.stats, train_metrics)


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
