"""Metrics kept on each worker and aggregated over the workers only when read (sync on read)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .ps_ranks import Cluster

__all__ = ["AGGREGATIONS", "Accuracy", "Mean", "Metric", "Sum"]

#: How a metric's records combine: their (weighted) sum, or their weighted mean.
AGGREGATIONS = ("sum", "mean")


class Metric:
    """A value each worker accumulates on its own and the workers combine when it is read.

    ``update()`` adds to this worker's total (and count) with no communication at all,
    as TensorFlow's sync-on-read variables do; ``compute()`` reduces the totals of every
    worker (one ``cluster.batch_reduce``: collective, call it on every worker at the same
    point) and gives the same number on every worker. With ``aggregation="mean"`` that
    number is the weighted mean over everything every worker recorded (the totals and
    the counts are summed over the workers, then divided): a worker that recorded more
    weighs more, it is not a mean of the workers' means. ``reset()`` starts again (locally).

    Totals are kept in float64 on the device of the first tensor recorded.

    Args:
        aggregation: ``"mean"`` (default) or ``"sum"``.
        cluster: what ``mpisync.init()`` returned (default: the last one).
    """

    def __init__(self, aggregation: str = "mean", cluster: Cluster | None = None) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.aggregation = aggregation
        self._cluster = cluster
        self.reset()

    def reset(self) -> None:
        """Forget what this worker recorded (local: no communication)."""
        self._total = torch.zeros((), dtype=torch.float64)
        self._count = torch.zeros((), dtype=torch.float64)

    def update(self, value: torch.Tensor | float,
               weight: torch.Tensor | float = 1.0) -> None:
        """Record ``value`` (a number or a tensor, each element a record) with ``weight``
        (broadcast to ``value``'s shape: a number, or a tensor of a shape that broadcasts
        to it). Local: no communication."""
        value = _float64(value, "value")
        weight = _float64(weight, "weight", value.device)
        try:                  # to value's shape: a weight never adds records (torchmetrics)
            weight = torch.broadcast_to(weight, value.shape)
        except RuntimeError:
            raise ValueError(f"weight of shape {list(weight.shape)} does not broadcast to a "
                             f"value of shape {list(value.shape)}") from None
        self._add((value * weight).sum(), weight.sum())

    def _add(self, total: torch.Tensor, count: torch.Tensor) -> None:
        if self._total.device != total.device:
            self._total, self._count = self._total.to(total.device), self._count.to(total.device)
        self._total += total
        self._count += count

    def compute(self, local: bool = False) -> float:
        """The metric over every worker's records: collective (every worker calls it).

        With ``local`` this worker's own records only, with no communication. A mean of
        no records is NaN.
        """
        if local:
            total, count = float(self._total), float(self._count)
        else:
            total, count = (float(v) for v in
                            self._get_cluster().batch_reduce([self._total, self._count]))
        if self.aggregation == "sum":
            return total
        return total / count if count else math.nan

    def _get_cluster(self) -> Cluster:
        if self._cluster is None:
            from .ps_ranks import _current
            if _current is None:
                raise RuntimeError("call mpisync.init() on every rank before reading a metric")
            self._cluster = _current
        return self._cluster

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(aggregation={self.aggregation!r}, local total "
                f"{float(self._total):g}, local count {float(self._count):g})")


class Mean(Metric):
    """The weighted mean of the values recorded on every worker (``Metric("mean")``).

    ``loss.update(batch_loss, weight=len(batch))`` gives the mean per example.
    """

    def __init__(self, cluster: Cluster | None = None) -> None:
        super().__init__("mean", cluster)


class Sum(Metric):
    """The sum of the values recorded on every worker (``Metric("sum")``)."""

    def __init__(self, cluster: Cluster | None = None) -> None:
        super().__init__("sum", cluster)


class Accuracy(Metric):
    """The fraction of correct predictions over every worker's records.

    ``update(preds, target)``: ``preds`` are class scores ``(N, C, ...)`` (the arg-max
    over dimension 1 is the prediction), labels of ``target``'s shape, or, for floating
    ``preds`` of ``target``'s shape (or ``(N, 1, ...)``: one score per example, as a binary
    classifier gives), probabilities compared with ``threshold``.
    """

    def __init__(self, threshold: float = 0.5, cluster: Cluster | None = None) -> None:
        super().__init__("mean", cluster)
        self.threshold = threshold

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:  # type: ignore[override]
        """Record whether each prediction is right (local: no communication).

        Args:
            preds: class scores ``(N, C, ...)``, one score per example (``(N, 1, ...)`` or
                ``target``'s shape, floating: compared with ``threshold``), or labels of
                ``target``'s shape.
            target: the true labels.

        Raises:
            ValueError: predictions of a shape that fits none of these, naming both shapes.
        """
        preds, target = torch.as_tensor(preds).detach(), torch.as_tensor(target).detach()
        if preds.dim() == target.dim() + 1:      # (N, 1, ...): one binary score each
            preds = preds.argmax(dim=1) if preds.shape[1] > 1 else preds.squeeze(1)
        if preds.shape == target.shape and preds.is_floating_point():
            preds = preds >= self.threshold
        if preds.shape != target.shape:
            raise ValueError(f"Accuracy: predictions of shape {list(preds.shape)} for targets "
                             f"of shape {list(target.shape)}; expected scores (N, C, ...) or "
                             f"one prediction per target")
        correct = (preds.to(target.dtype) == target).sum().to(torch.float64)
        self._add(correct, torch.tensor(float(target.numel()), dtype=torch.float64,
                                        device=correct.device))


def _float64(x: torch.Tensor | float, what: str, device: torch.device | None = None) -> torch.Tensor:
    if torch.is_tensor(x):
        if x.is_complex():
            raise TypeError(f"a metric's {what} must be real, got a {x.dtype} tensor")
        return x.detach().to(dtype=torch.float64, device=device or x.device)
    try:
        return torch.as_tensor(x, dtype=torch.float64, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"a metric's {what} must be a number or a tensor, got "
                        f"{type(x).__name__}") from None
