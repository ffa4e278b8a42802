"""Peak memory of saving a big table and loading it into another partitioning.

``tables_reshard_memory.py DIR ROWS [SAVED_SHARDS LOADED_SHARDS]``: a ROWS x 16 float32
``mpisync.Embedding`` table (drawn on the ps ranks) with Adagrad, ``fixed_size(SAVED)``
"mod", trains one step and is saved to DIR; a second model with ``fixed_size(LOADED)``
"div" loads it. Each rank reports how far its resident memory rose above what it held
just before the save and just before the load (Linux: the peak is reset through
``/proc/self/clear_refs``; the ps ranks sample theirs every 5 ms), with the bytes of
the table and of one shard, rows and Adagrad state together.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch
from common import emit

import mpisync

DIM = 16


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Peak:
    """The highest anonymous and file-backed resident memory since ``reset()``, sampled."""

    def __init__(self):
        self.base = self.anon = self.file = 0
        self.stop = threading.Event()
        self.reset()
        threading.Thread(target=self._sample, daemon=True).start()

    def reset(self) -> None:
        self.base, self.anon, self.file = _kb("RssAnon"), 0, 0

    def _sample(self) -> None:
        while not self.stop.wait(0.002):
            self.anon = max(self.anon, _kb("RssAnon"))
            self.file = max(self.file, _kb("RssFile"))

    def rise_mb(self) -> tuple[float, float]:
        """(anonymous memory above the one at ``reset()``, file-backed pages), MB."""
        time.sleep(0.01)
        return (self.anon - self.base) / 1024, self.file / 1024


def make(rows: int, shards: int, strategy: str):
    m = torch.nn.ModuleDict({
        "emb": mpisync.Embedding(rows, DIM, partitioner=mpisync.fixed_size(shards),
                                 partition_strategy=strategy),
        "head": torch.nn.Linear(DIM, 1)})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(m.parameters(), lr=0.1),
                                        named_parameters=m.named_parameters())
    return m, opt


def worker(cluster, where: str, rows: int, before: int, after: int) -> None:
    path = os.path.join(where, "big.pt")
    m, opt = make(rows, before, "mod")
    ids = torch.randint(0, rows, (64,), generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    m["head"](m["emb"](ids)).sum().backward()
    opt.step()
    peak = Peak()
    mpisync.save(path, m, opt)
    saved = peak.rise_mb()
    opt.close()
    m, opt = make(rows, after, "div")
    peak.reset()
    mpisync.load(path, m, opt)
    loaded = peak.rise_mb()
    opt.close()
    row_bytes = 2 * DIM * 4                    # the row and its Adagrad sum
    emit(role="worker", worker=cluster.worker_index, save_rise_mb=saved, load_rise_mb=loaded, table_mb=rows * row_bytes / 2**20,
         saved_shard_mb=rows / before * row_bytes / 2**20,
         loaded_shard_mb=rows / after * row_bytes / 2**20, file_mb=os.path.getsize(path) / 2**20)


def ps(cluster) -> None:
    peak = Peak()
    cluster.serve()
    emit(role="ps", ps=cluster.ps_index, rise_mb=peak.rise_mb())


def main() -> None:
    where, rows = sys.argv[1], int(sys.argv[2])
    before, after = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (4, 8)
    cluster = mpisync.init()
    if cluster.is_ps:
        ps(cluster)
        return
    started = time.perf_counter()
    worker(cluster, where, rows, before, after)
    if cluster.is_chief:
        print(f"worker 0: {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
