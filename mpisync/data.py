"""Data over the workers: a sampler that gives each worker its share of every epoch."""
from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler, IterableDataset

__all__ = ["WorkerSampler"]


class WorkerSampler(DistributedSampler):
    """``torch.utils.data.DistributedSampler`` over the workers only (no ps rank counts).

    Each epoch is one order of the whole dataset (a permutation drawn from ``seed +
    epoch`` when ``shuffle``, else ``0 .. n-1``), the same on every worker; worker ``i``
    takes its positions ``i, i + W, i + 2W, ...``. Call ``set_epoch(epoch)`` before each
    epoch for a new order.

    ``drop_last=False`` (default): every example exactly once per epoch; when ``W`` does
    not divide the dataset, the first ``n % W`` workers get one example more (torch's own
    sampler would repeat examples instead, so that the shares are equal).
    ``drop_last=True``: every worker gets ``n // W`` examples and the last ``n % W`` of
    the epoch's order are left out (other ones each epoch when shuffled), as torch does.

    As with torch's sampler, every worker must pass the same dataset (length) and ``seed``:
    each computes the order itself, with no messages.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no ``len()``.
    """

    def __init__(self, dataset: Sized, num_workers: int, worker_index: int,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            kind = "an IterableDataset" if isinstance(dataset, IterableDataset) else \
                f"a {type(dataset).__name__} without len()"
            raise TypeError(f"a sampler deals out the indices of a map-style dataset (len() and "
                            f"[i]), got {kind}; an iterable dataset shards itself: in its "
                            f"__iter__, keep the examples i with i % cluster.num_workers == "
                            f"cluster.worker_index")
        # torch's annotation says Dataset, but its sampler reads only len(dataset)
        super().__init__(dataset, num_replicas=num_workers,  # type: ignore[arg-type]
                         rank=worker_index, shuffle=shuffle, seed=seed, drop_last=drop_last)
        n = len(dataset)
        self.total_size = n // num_workers * num_workers if drop_last else n
        # no padding: without drop_last the first n % W workers take one more
        self.num_samples = len(range(worker_index, self.total_size, num_workers))

    def __iter__(self) -> Iterator[int]:
        dataset = self.dataset
        assert isinstance(dataset, Sized)       # checked in __init__
        n = len(dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        mine = order[self.rank:self.total_size:self.num_replicas]
        assert len(mine) == self.num_samples
        return iter(mine)

    def __len__(self) -> int:
        return self.num_samples
