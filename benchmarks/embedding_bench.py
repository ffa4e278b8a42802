"""Step time, bytes and memory of an embedding table on the ps ranks against a replicated one.

One configuration per MPI job, e.g. on 2 workers and 1 ps rank::

    .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- \\
        .venv/bin/python benchmarks/embedding_bench.py --kind table --rows 1000000

The model: 26 ids per sample (one shared id space, as in DLRM), their rows of width 64
flattened into ``Linear(26 * 64, 1)``, a logistic loss on random labels, a batch of 1024
samples per worker per step, plain SGD (lr 0.1) through a ``SyncReplicasOptimizer``.
The ids come from a seeded generator, different on each worker (``--ids``: a bounded
Zipf law scattered over the table, or uniform). ``--kind`` picks the table:

- ``table``: an ``mpisync.Embedding`` whose rows live on the ps ranks only (initialised
  there from a seed); a step looks up the batch's unique rows and pushes their gradients;
- ``dense``: a ``torch.nn.Embedding`` (``sparse=False``) held whole on every worker; a
  step pushes the gradient of the whole table and pulls the whole table back, what DDP
  or an allreduce would move.

Worker 0 prints one line ``RESULT {json}``: the median step time over ``--steps`` timed
steps after ``--warmup`` untimed ones, the bytes pushed per step, every rank's peak RSS.

``--all`` (a plain process, not under MPI) runs each (kind, rows) as its own job and
prints one JSON document with a row per configuration and the table/dense ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

# torch and mpisync are imported where a job needs them: the --all driver runs without them
DIM = 64
FIELDS = 26
BATCH = 1024
MiB = 1 << 20
ROWS_ALL = (10**5, 10**6, 10**7)
SCATTER = 2_654_435_761          # a prime: rank -> id is a bijection for 10^k rows
RESULT = "RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("table", "dense"), default="table",
                        help="table: mpisync.Embedding on the ps; dense: replicated nn.Embedding")
    parser.add_argument("--rows", type=int, default=10**6, help="rows of the table")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--shards", type=int, default=1,
                        help="table shards (mpisync.fixed_size), kind table only")
    parser.add_argument("--ids", choices=("zipf", "uniform"), default="zipf",
                        help="how ids are drawn (zipf: exponent --zipf-s over the rows)")
    parser.add_argument("--zipf-s", type=float, default=1.05, help="Zipf exponent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all", action="store_true",
                        help="driver: run every (kind, rows) as its own MPI job")
    parser.add_argument("--dense-max-rows", type=int, default=10**6,
                        help="driver: skip dense above this many rows (memory)")
    parser.add_argument("--workers", type=int, default=2, help="driver: worker ranks")
    parser.add_argument("--ps", type=int, default=1, help="driver: ps ranks")
    parser.add_argument("--timeout", type=float, default=600, help="driver: seconds per job")
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be at least 1 and --warmup at least 0, got {args.steps} "
                     f"and {args.warmup}")
    return args


# ---------------------------------------------------------------- ids and model

def draw_ids(rng: np.random.Generator, rows: int, how: str, s: float) -> np.ndarray:
    """``BATCH x FIELDS`` int64 ids.

    ``zipf``: rank ``r`` (0 the commonest) with probability about ``(r + 1) ** -s``, by
    inverting the continuous power law on ``[1, rows + 1)``; ranks are scattered over the
    table (``r * SCATTER mod rows``) so that popular ids do not share a shard.
    """
    u = rng.random((BATCH, FIELDS))
    if how == "uniform":
        return np.minimum((u * rows).astype(np.int64), rows - 1)
    top = (rows + 1.0) ** (1.0 - s) - 1.0
    rank = np.floor((1.0 + u * top) ** (1.0 / (1.0 - s))).astype(np.int64) - 1
    rank = np.clip(rank, 0, rows - 1)
    return rank * SCATTER % rows


def build_model(kind: str, rows: int, shards: int, seed: int):
    """The embedding (ps-resident or replicated dense) under ``Linear(FIELDS * DIM, 1)``."""
    import torch

    import mpisync

    torch.manual_seed(seed)
    if kind == "table":
        emb = mpisync.Embedding(rows, DIM, partitioner=mpisync.fixed_size(shards),
                                partition_strategy="mod", seed=seed)
    else:
        emb = torch.nn.Embedding(rows, DIM, sparse=False)
    return torch.nn.Sequential(emb, torch.nn.Flatten(), torch.nn.Linear(FIELDS * DIM, 1))


# ---------------------------------------------------------------- one MPI job

def peak_rss_mb() -> float:
    """This process's peak resident set (ru_maxrss is KiB on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def sleepy_barrier(comm) -> None:
    """A barrier that sleeps while it waits, so that idle ranks leave the cores alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def ms(seconds: list[float], q: float = 50) -> float:
    """The ``q``-th percentile of ``seconds``, in ms."""
    return round(float(np.percentile(seconds, q)) * 1e3, 2)


def train(cluster, args) -> dict:
    """The worker loop; timings and bytes on this worker."""
    import torch

    import mpisync

    model = build_model(args.kind, args.rows, args.shards, args.seed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    rng = np.random.default_rng([args.seed, cluster.worker_index])
    sleepy_barrier(cluster.comm)     # every rank here: set-up timed from now
    start = time.perf_counter()
    opt = mpisync.SyncReplicasOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        cluster=cluster)
    construct_s = time.perf_counter() - start
    step_s, fwd_bwd_s, opt_step_s, pushed, unique = [], [], [], [], []
    for i in range(args.warmup + args.steps):
        ids = torch.from_numpy(draw_ids(rng, args.rows, args.ids, args.zipf_s))
        labels = torch.from_numpy(rng.random(BATCH) < 0.2).float()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(ids).squeeze(1), labels)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i == 0:
            first_step_s = t2 - start
        if i >= args.warmup:
            step_s.append(t2 - t0)
            fwd_bwd_s.append(t1 - t0)
            opt_step_s.append(t2 - t1)
            unique.append(len(torch.unique(ids)))
            pushed.append(sum(opt.stats["bytes_per_ps"]))   # a request to ps 0, untimed
    opt.close()
    return {"step_ms": ms(step_s), "step_ms_p10": ms(step_s, 10), "step_ms_p90": ms(step_s, 90),
            "forward_backward_ms": ms(fwd_bwd_s), "opt_step_ms": ms(opt_step_s),
            "bytes_per_step": int(np.median(pushed)), "unique_ids_per_step": int(np.median(unique)),
            "setup_s": round(first_step_s, 2), "construct_s": round(construct_s, 2),
            "global_step": opt.stats["global_step"]}


def run_job(args) -> None:
    import torch

    import mpisync

    cluster = mpisync.init()
    wall = time.perf_counter()
    # the first optimizer torch builds imports torch._dynamo (seconds): not the set-up's time
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    mine = None
    if cluster.is_ps:
        sleepy_barrier(cluster.comm)     # the workers have built their models
        cluster.serve()                  # until every worker has left the job
    else:
        mine = train(cluster, args)
    world = cluster.comm             # COMM_WORLD: close() frees only mpisync's own
    cluster.close()
    sleepy_barrier(world)
    rss = world.gather((cluster.is_ps, peak_rss_mb()), root=0)
    if not cluster.is_chief:
        return
    result = {
        "kind": args.kind, "rows": args.rows, "dim": DIM, "shards": args.shards if
        args.kind == "table" else None, "ids": args.ids, "zipf_s": args.zipf_s,
        "batch": f"{BATCH} x {FIELDS}", "workers": cluster.num_workers, "ps": cluster.num_ps,
        "steps": args.steps, "warmup": args.warmup, **mine,
        "table_bytes": args.rows * DIM * 4,
        "worker_peak_rss_mb": [r for is_ps, r in rss if not is_ps],
        "ps_peak_rss_mb": [r for is_ps, r in rss if is_ps],
        "wall_s": round(time.perf_counter() - wall, 2),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(RESULT + line, flush=True)


# ---------------------------------------------------------------- the driver

def job_command(args, kind: str, rows: int) -> list[str]:
    """The launch command line of one configuration (the driver's own flags passed on)."""
    return [sys.executable, "-m", "mpisync.launch", "--workers", str(args.workers),
            "--ps", str(args.ps), "--timeout", str(args.timeout), "--",
            sys.executable, os.path.abspath(__file__), "--kind", kind, "--rows", str(rows),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--shards", str(args.shards), "--ids", args.ids, "--zipf-s", str(args.zipf_s),
            "--seed", str(args.seed)]


def run_one(args, kind: str, rows: int) -> dict:
    """One configuration as its own MPI job; its RESULT line, or why there is none."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    # check=False: a failed job becomes a row with its error; launch --timeout ends a hang
    proc = subprocess.run(job_command(args, kind, rows), env=env, capture_output=True,
                          text=True, check=False)
    elapsed = round(time.perf_counter() - start, 1)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return {**json.loads(line[len(RESULT):]), "job_s": elapsed}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"kind": kind, "rows": rows, "error": f"exit {proc.returncode} after {elapsed} s",
            "output_tail": tail}


SUMMARY_KEYS = ("step_ms", "opt_step_ms", "bytes_per_step", "unique_ids_per_step",
                "setup_s")


def summary(run: dict) -> dict:
    """One row of the driver's table: the figures compared, the largest RSS of each role."""
    row = {"kind": run["kind"], "rows": run["rows"]}
    if "error" in run:
        return {**row, "error": run["error"]}
    row.update({key: run[key] for key in SUMMARY_KEYS})
    row.update(worker_peak_rss_mb=max(run["worker_peak_rss_mb"]),
               ps_peak_rss_mb=max(run["ps_peak_rss_mb"]), ps_table_bytes=run["table_bytes"])
    return row


def ratios(table: dict, dense: dict) -> dict:
    """table / dense of the figures compared."""
    return {key: round(table[key] / dense[key], 4)
            for key in ("step_ms", "bytes_per_step", "worker_peak_rss_mb")}


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}; {os.cpu_count()} cores; {platform.system()} {platform.release()}"


def drive(args) -> None:
    """Every (kind, rows) as its own job, one after another; one JSON document."""
    rows_out, runs, skipped = [], [], []
    for rows in ROWS_ALL:
        got = {}
        for kind in ("table", "dense"):
            if kind == "dense" and rows > args.dense_max_rows:
                gib = (args.workers + args.ps) * 2 * rows * DIM * 4 / 2**30
                reason = (f"dense at {rows} rows skipped: the table and its gradient on each "
                          f"of {args.workers} workers and {args.ps} ps need about {gib:.0f} "
                          f"GiB (--dense-max-rows {args.dense_max_rows})")
                print(reason, file=sys.stderr, flush=True)
                skipped.append(reason)
                continue
            print(f"{kind}, {rows} rows ...", file=sys.stderr, flush=True)
            run = run_one(args, kind, rows)
            runs.append(run)
            got[kind] = summary(run)
        if "error" not in got["table"] and "error" not in got.get("dense", {"error": None}):
            got["table"]["table_over_dense"] = ratios(got["table"], got["dense"])
        rows_out += got.values()
    doc = {"machine": machine(), "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
           "rows": rows_out, "skipped": skipped, "runs": runs}
    text = json.dumps(doc, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)


def main() -> None:
    args = parse_args()
    if args.all:
        drive(args)
    else:
        run_job(args)


if __name__ == "__main__":
    main()
