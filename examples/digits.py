"""Train a small MLP on scikit-learn's digits with mpisync (synchronous parameter servers).

The data set (8x8 images of the digits 0-9, 1797 samples) ships inside scikit-learn, so
nothing is downloaded. Run it on 2 workers and 1 ps rank (this is ``make demo``)::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- .venv/bin/python examples/digits.py

or with more ranks, e.g. ``--workers 3 --ps 2``. Every worker builds the same model from
the same seed and reads its own share of each epoch through ``cluster.sampler`` (one
permutation per epoch, the same on every worker, dealt out to the workers; ``drop_last``
so that every worker runs as many steps). Training loss and accuracy are
``mpisync.Mean`` and ``mpisync.Accuracy``: each worker records its batches locally and
the workers combine them when read, over every example of the epoch. The chief (worker 0)
logs, evaluates on the held-out test set at the end and exits non-zero if the accuracy is
below 0.9. It also evaluates the moving averages of the parameters that the ps ranks keep
(``--ema-decay``, with TensorFlow's ``num_updates`` warm-up).
"""
from __future__ import annotations

import argparse
import textwrap
import time

import torch

import mpisync

MIN_ACCURACY = 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--replicas-to-aggregate", type=int, default=None,
                        help="gradients averaged per step (default: all workers)")
    parser.add_argument("--ema-decay", type=float, default=0.99,
                        help="moving average of the parameters kept on the ps ranks (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    parser.add_argument("--progress", action="store_true",
                        help="a progress bar on the chief (log lines when not a terminal) "
                             "instead of the step lines: mpisync.Progress")
    return parser.parse_args()


def load_data(seed: int):
    """Stratified 75/25 split, standardized with the training set's statistics.

    scikit-learn is imported here, by the workers only: the ps ranks never pay its
    import (about 1.4 s of CPU, through SciPy)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=seed)
    mean, std = x_train.mean(0), x_train.std(0)
    std[std == 0] = 1.0                       # a few border pixels are always 0
    return (torch.as_tensor((x_train - mean) / std, dtype=torch.float32),
            torch.as_tensor(y_train, dtype=torch.long),
            torch.as_tensor((x_test - mean) / std, dtype=torch.float32),
            torch.as_tensor(y_test, dtype=torch.long))


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def train(args, cluster) -> None:
    torch.manual_seed(args.seed)              # same initial model on every worker
    # on the worker's GPU where it has one (cluster.device); the ps ranks stay on the CPU
    x_train, y_train, x_test, y_test = (t.to(cluster.device) for t in load_data(args.seed))
    model = make_model().to(cluster.device)
    opt = mpisync.SyncReplicasOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(),
        replicas_to_aggregate=args.replicas_to_aggregate, cluster=cluster,
        ema_decay=args.ema_decay or None, ema_num_updates=True)
    B, W = args.batch_size, cluster.num_workers
    steps_per_epoch = len(x_train) // W // B  # drop the ragged ends: equal step counts
    if steps_per_epoch == 0:                  # on every worker; close() runs at exit
        raise SystemExit(f"--batch-size {B} x {W} workers exceeds the {len(x_train)} "
                         f"training samples")
    if cluster.is_chief:
        print(f"digits: {len(x_train)} train / {len(x_test)} test samples, {W} workers, "
              f"{cluster.num_ps} ps, global batch {B * W}, "
              f"{steps_per_epoch} steps/epoch, {args.epochs} epochs", flush=True)
        print("ranks by node:\n" + textwrap.indent(cluster.describe(), "  "), flush=True)
    start = time.perf_counter()
    progress = mpisync.Progress(opt, total=args.epochs * steps_per_epoch, batch_size=B,
                                every=args.log_every, enabled=args.progress)
    loss, accuracy = mpisync.Mean(), mpisync.Accuracy()      # this worker's records
    run_epochs(args, cluster, model, opt, x_train, y_train, progress, loss, accuracy)
    progress.close()

    def evaluate() -> float:
        with torch.no_grad():
            return (model(x_test).argmax(1) == y_test).float().mean().item()

    test_accuracy = averaged_accuracy = None
    if cluster.is_chief:                      # the model holds the newest pulled parameters
        test_accuracy = evaluate()
        if args.ema_decay:
            with opt.averaged():              # ... and here their moving averages
                averaged_accuracy = evaluate()
    # The safe end of training: close on every worker first (a worker still inside step()
    # then finishes it without us, or stops), then collectives among the workers.
    opt.close()
    train_metrics = loss.compute(), accuracy.compute()   # collective: every worker
    if cluster.is_chief:
        report(args, opt.stats, test_accuracy, averaged_accuracy, train_metrics,
               time.perf_counter() - start)


def run_epochs(args, cluster, model, opt, x_train, y_train, progress: mpisync.Progress,
               loss_metric: mpisync.Mean, accuracy: mpisync.Accuracy) -> None:
    """Train on this worker's share of each epoch, recording loss and accuracy locally.

    In strict sync every worker is between the same two steps at an epoch's end, so the
    chief can print the epoch's metrics there (``compute()`` is collective); with backup
    workers they are read once, after ``opt.close()``.
    """
    data = torch.utils.data.TensorDataset(x_train, y_train)
    sampler = cluster.sampler(data, shuffle=True, seed=args.seed, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                                         drop_last=True)
    strict = args.replicas_to_aggregate in (None, cluster.num_workers)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)              # a new order each epoch, the same on every worker
        loss_metric.reset()
        accuracy.reset()
        for x, y in loader:
            if opt.stopped:                   # backup workers: the others have finished
                return
            opt.zero_grad()
            scores = model(x)
            loss = loss_fn(scores, y)
            loss.backward()
            opt.step()
            loss_metric.update(loss.detach(), weight=len(y))    # local: no communication
            accuracy.update(scores.detach(), y)
            progress.report(loss=loss.item())
            if cluster.is_chief and not progress.active and opt.global_step % args.log_every == 0:
                print(f"step {opt.global_step:5d}  epoch {epoch}  "
                      f"chief loss {loss_metric.compute(local=True):.4f}  "
                      f"elapsed {time.perf_counter() - start:.2f} s", flush=True)
        if strict and epoch < args.epochs - 1:
            epoch_loss, epoch_accuracy = loss_metric.compute(), accuracy.compute()
            if cluster.is_chief and not progress.active:
                print(f"epoch {epoch}: training loss {epoch_loss:.4f}, training accuracy "
                      f"{epoch_accuracy:.3f} (every worker's examples)", flush=True)


def report(args, stats, accuracy, averaged_accuracy, train_metrics, seconds) -> None:
    print(f"test accuracy: {accuracy:.3f}")
    if averaged_accuracy is not None:
        print(f"test accuracy of the moving averages (decay {args.ema_decay}): "
              f"{averaged_accuracy:.3f}")
    print(f"last epoch, every worker's examples: training loss {train_metrics[0]:.4f}, "
          f"training accuracy {train_metrics[1]:.3f}")
    print(f"training took {seconds:.2f} s; global_step {stats['global_step']}, "
          f"gradients_applied {stats['gradients_applied']}, "
          f"gradients_dropped {stats['gradients_dropped']}, "
          f"taken_per_worker {stats['taken_per_worker']}", flush=True)
    if accuracy < MIN_ACCURACY:
        raise SystemExit(f"digits: test accuracy {accuracy:.3f} is below {MIN_ACCURACY}")


def main() -> None:
    args = parse_args()
    cluster = mpisync.init()
    if cluster.is_ps:
        cluster.serve()
    else:
        train(args, cluster)


if __name__ == "__main__":
    main()
