"""Full against incremental checkpoints of a table on the ps: bytes written and write time.

Run plainly, it starts one job of 2 workers and 1 ps rank under ``python -m
mpisync.launch`` and prints one JSON line::

    .venv/bin/python benchmarks/checkpoint_bench.py            # 10^6 rows of 64
    .venv/bin/python benchmarks/checkpoint_bench.py --big      # 10^7 rows

The job: an ``mpisync.Embedding`` of R rows x 64 float32 on the ps rank (``--shards``
shards, ``mpisync.fixed_size``), a ``Linear(64, 1)`` head, Adagrad (lr 0.1: its per-row
``sum`` doubles what a file holds of the table). A ``Checkpointer`` (``full_every=8``)
writes a full file; one step then touches 1% of the rows (R/100 distinct ids, one per
sample, split between the workers); the Checkpointer writes the next file, incremental;
a plain ``mpisync.save`` writes a full file of the same step. Worker 0 reports each
file's bytes and write time (from the save to the file written: ``save()`` then
``wait()``), how long the save held the workers (the longest of their ``save()`` calls:
the Checkpointer writes the file beside training), and the load time of the incremental
chain and of the full file (``mpisync.load`` into the same job). Then steps of 512 ids:
five before a full file (a second Checkpointer: full files only) and as many as the
workers take while the chief writes it (``steps_during_full_write``), with the medians
of each.
The files go to ``--dir`` (default: a temporary directory, removed after).

``--hash``: the table is an ``mpisync.HashEmbedding`` of 64-bit ids instead (capacity 20%
above R per shard), filled with R ids by ten steps before the first file; the step
between the two files looks up 1% of those ids again (their rows, state and counts
change). ``--hash --big`` needs about 12 GiB on the ps rank.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

DIM = 64
RESULT = "RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10**6, help="rows of the table")
    p.add_argument("--big", action="store_true", help="10^7 rows")
    p.add_argument("--shards", type=int, default=8, help="table shards on the one ps rank")
    p.add_argument("--touched", type=float, default=0.01, help="fraction of rows a step touches")
    p.add_argument("--hash", action="store_true", help="an mpisync.HashEmbedding table")
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary one)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)   # a rank of the job
    p.add_argument("--timeout", type=int, default=1800, help="launch --timeout, seconds")
    return p.parse_args(argv)


def job(args: argparse.Namespace) -> None:
    import torch

    import mpisync

    cluster = mpisync.init()
    if cluster.is_ps:
        cluster.serve()
        return
    rows = args.rows
    torch.manual_seed(0)
    parts = mpisync.fixed_size(args.shards)
    table = (mpisync.HashEmbedding(DIM, capacity_per_shard=rows * 6 // 5 // args.shards + 64,
                                   partitioner=parts, seed=1) if args.hash else
             mpisync.Embedding(rows, DIM, partitioner=parts, seed=1))
    model = torch.nn.ModuleDict({"emb": table, "head": torch.nn.Linear(DIM, 1)})
    opt = mpisync.SyncReplicasOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        cluster=cluster)
    ckpt = mpisync.Checkpointer(args.dir, model, opt, full_every=8)

    def timed(fn):
        cluster.worker_comm.Barrier()
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    def step(ids):
        mine = ids[cluster.worker_index::cluster.num_workers]
        opt.zero_grad()
        model["head"](model["emb"](mine)).pow(2).mean().backward()
        opt.step()

    def saved(ckpt):
        """A Checkpointer's save: (path, the longest a worker was held, until written)."""
        cluster.worker_comm.Barrier()
        start = time.perf_counter()
        path = ckpt.save()
        held = time.perf_counter() - start
        held = max(cluster.worker_comm.allgather(held))
        ckpt.wait()
        return path, held, time.perf_counter() - start

    # a hash table's ids: R unbounded 64-bit ids (an odd multiplier of 0..R-1), all held
    name = (torch.arange(rows, dtype=torch.int64) * 0x5851F42D4C957F2D if args.hash
            else torch.arange(rows, dtype=torch.int64))
    if args.hash:
        for chunk in name.chunk(10):
            step(chunk)
    full_path, full_held_s, full_s = saved(ckpt)
    touched = int(rows * args.touched)
    ids = torch.randperm(rows, generator=torch.Generator().manual_seed(2))[:touched]
    step(name[ids])
    incr_path, incr_held_s, incr_s = saved(ckpt)
    beside = beside_a_write(args, cluster, model, opt, lambda: step(name[ids[:512]]))
    plain = os.path.join(args.dir, "full.pt")
    _, full2_s = timed(lambda: mpisync.save(plain, model, opt))
    _, load_incr_s = timed(lambda: mpisync.load(incr_path, model, opt))
    _, load_full_s = timed(lambda: mpisync.load(plain, model, opt))
    if cluster.is_chief:
        ck = torch.load(incr_path, weights_only=True, mmap=True)
        assert ck["base"]["file"] == os.path.basename(full_path), ck["base"]
        changed = sum(len(s["ids"]) for s in ck["tables"]["emb.weight"]["shards"])
        print(RESULT + json.dumps({
            "rows": rows, "dim": DIM, "shards": args.shards, "touched_rows": touched,
            "changed_rows_written": changed, "optimizer": "Adagrad",
            "table": "HashEmbedding" if args.hash else "Embedding",
            "workers": cluster.num_workers, "ps": cluster.num_ps,
            "full_bytes": os.path.getsize(full_path), "full_write_s": round(full_s, 3),
            "full_write_after_step_s": round(full2_s, 3),
            "incremental_bytes": os.path.getsize(incr_path),
            "incremental_write_s": round(incr_s, 3),
            "full_workers_held_s": round(full_held_s, 3),
            "incremental_workers_held_s": round(incr_held_s, 3), **beside,
            "load_incremental_chain_s": round(load_incr_s, 3),
            "load_full_s": round(load_full_s, 3)}), flush=True)
    opt.close()


def beside_a_write(args, cluster, model, opt, step) -> dict:
    """Steps of 512 ids before a full file and while the chief writes it (a second
    Checkpointer: full files only): their medians, and how many the workers took."""
    import statistics

    import mpisync

    def timed_step() -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    before = [timed_step() for _ in range(5)]
    ckpt = mpisync.Checkpointer(os.path.join(args.dir, "beside"), model, opt)
    path = ckpt.save()
    during: list[float] = []
    while len(during) < 5000:
        during.append(timed_step())
        # the chief sees the file once it is renamed into place; every worker follows it
        if cluster.worker_comm.bcast(os.path.exists(path) if cluster.is_chief else None):
            break
    ckpt.wait()
    return {"step_before_write_median_s": round(statistics.median(before), 4),
            "steps_during_full_write": len(during),
            "step_during_write_median_s": round(statistics.median(during), 4)}


def main() -> None:
    args = parse_args()
    if args.big:
        args.rows = 10**7
    if args.job:
        job(args)
        return
    where = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    cmd = [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
           "--timeout", str(args.timeout), "--", sys.executable, os.path.abspath(__file__),
           "--job", "--rows", str(args.rows), "--shards", str(args.shards),
           "--touched", str(args.touched), "--dir", where, *(["--hash"] if args.hash else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        if args.dir is None:
            shutil.rmtree(where, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            print(line[len(RESULT):], flush=True)
            return
    sys.exit(f"checkpoint_bench: the job failed (exit {proc.returncode}):\n"
             + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:]))


if __name__ == "__main__":
    main()
