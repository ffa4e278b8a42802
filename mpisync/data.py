"""Data over the workers: a sampler that gives each worker its share of every epoch."""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler, IterableDataset

__all__ = ["WorkerSampler", "live_samplers"]

# Every WorkerSampler alive, by creation number: what a checkpoint saves and restores.
_LIVE: weakref.WeakValueDictionary[int, WorkerSampler] = weakref.WeakValueDictionary()
_created = itertools.count()


def live_samplers() -> list[WorkerSampler]:
    """The ``WorkerSampler`` objects alive in this process, in the order they were made.

    ``mpisync.save`` saves their ``state_dict()`` and ``mpisync.load`` restores them in
    this order: build the same samplers, in the same order, before loading.
    """
    return [s for _, s in sorted(_LIVE.items())]


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

    Its position in the epoch is saved and restored with checkpoints (``state_dict()``,
    ``load_state_dict()``; ``mpisync.save`` and ``mpisync.load`` find every live
    ``WorkerSampler`` by themselves): a resumed job's next ``__iter__`` goes on where the
    saved one stood. An index counts as handed out when ``__iter__`` yields it. A
    ``DataLoader`` with worker processes (``num_workers > 0``) draws indices ahead of the
    batches it returns (``prefetch_factor`` batches per process), and those count too: a
    resumed job skips them. With ``num_workers=0`` the position is exact.

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
        self.position = 0               # indices of this epoch handed out
        self._skip = 0                  # to pass over in the next __iter__ (a loaded state)
        _LIVE[next(_created)] = self

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next ``__iter__`` on; another epoch than
        the current one starts at its beginning (a loaded position is for its own epoch)."""
        if epoch != self.epoch:
            self.position = self._skip = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "seed", "position"}``: the epoch, the seed, and how many indices
        ``__iter__`` has handed out in this epoch (plain ints)."""
        return {"epoch": int(self.epoch), "seed": int(self.seed),
                "position": int(self.position)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Stand where ``state`` (from ``state_dict()``) stood: the next ``__iter__`` of its
        epoch leaves out the ``position`` indices already handed out.

        Raises:
            ValueError: ``state`` lacks an entry or holds a negative or non-int one.
        """
        values = {}
        for key in ("epoch", "seed", "position"):
            value = state.get(key) if isinstance(state, dict) else None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"WorkerSampler.load_state_dict(): {key!r} must be an "
                                 f"int >= 0, got {value!r} in {state!r}")
            values[key] = value
        self.epoch, self.seed = values["epoch"], values["seed"]
        self.position = self._skip = min(values["position"], self.num_samples)

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
        start, self._skip = self._skip, 0
        self.position = start
        return self._hand_out(mine, start)

    def _hand_out(self, mine: list[int], start: int) -> Iterator[int]:
        for index in mine[start:]:
            self.position += 1          # counted as handed out when yielded
            yield index

    def __len__(self) -> int:
        return self.num_samples
