"""The ps's table step alone, in one process: reduce two workers' rows, apply the optimizer.

The recommender benchmark's shard (``--rows`` 10^6 x 64 float32, one ps rank; 5 x 10^5
for each of two) and two workers' pushes of 78,658 unique uniform ids each (a batch of
4,096 bags of 20). Times, per step (the minimum and median over ``--steps``), in wall
clock and in this process's CPU time (``time.process_time()``: on a machine shared with
other jobs the steadier figure; the work is single-threaded with ``OMP_NUM_THREADS=1``):

- ``torch``: what the ps did before ``mpisync.tables.rowopt``: ``accumulate.reduce_rows`` (a COO
  coalesce, divided by 2) and ``torch.optim.Adagrad.step()`` on the sparse gradient;
- ``rowopt``: ``rowopt.merge_rows`` and ``rowopt.apply_rows`` (Adagrad, bitwise the same);
- ``rowwise``: ``merge_rows`` and ``apply_rows`` with ``mpisync.RowWiseAdagrad``.

Prints one JSON object::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/row_apply_bench.py
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import mpisync
from mpisync.accumulate import reduce_rows
from mpisync.tables.rowopt import RowScratch, apply_rows, merge_rows

DIM = 64


def pushes(rows: int, unique: int, workers: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randperm(rows, generator=g)[:unique].sort().values,
             torch.randn(unique, DIM, generator=g)) for _ in range(workers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the shard")
    parser.add_argument("--unique", type=int, default=78_658, help="rows a worker pushes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.sparse.check_sparse_tensor_invariants.disable()   # as the ps: built coalesced
    shape = (args.rows, DIM)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = {"rows": args.rows, "dim": DIM, "workers": args.workers,
           "unique_per_worker": args.unique, "threads": torch.get_num_threads()}
    for name in ("torch", "rowopt", "rowwise"):
        p = torch.nn.Parameter(weight.clone())
        opt = (mpisync.RowWiseAdagrad if name == "rowwise" else torch.optim.Adagrad)([p], lr=0.01)
        group, scratch, merge_scratch = opt.param_groups[0], RowScratch(), RowScratch()
        reduce_s, apply_s, cpu_s = [], [], []
        for step in range(args.steps + 1):
            pieces = pushes(args.rows, args.unique, args.workers, step)
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "torch":
                p.grad = reduce_rows(pieces, shape, args.workers, "mean")
                t1 = time.perf_counter()
                opt.step()
            else:
                ids, values = merge_rows(pieces, args.rows, args.workers, "mean", merge_scratch)
                t1 = time.perf_counter()
                apply_rows(opt, group, p, ids, values, scratch)
            t2, c2 = time.perf_counter(), time.process_time()
            if step:                                # the first step warms the buffers up
                reduce_s.append(t1 - t0)
                apply_s.append(t2 - t1)
                cpu_s.append(c2 - c0)
        total = np.add(reduce_s, apply_s)
        out[name] = {"reduce_ms": round(float(np.median(reduce_s)) * 1e3, 1),
                     "apply_ms": round(float(np.median(apply_s)) * 1e3, 1),
                     "step_ms": round(float(np.median(total)) * 1e3, 1),
                     "step_ms_min": round(float(np.min(total)) * 1e3, 1),
                     "step_cpu_ms": round(float(np.median(cpu_s)) * 1e3, 1),
                     "step_cpu_ms_min": round(float(np.min(cpu_s)) * 1e3, 1),
                     "merged_rows": len(values) if name != "torch" else int(p.grad._nnz())}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
