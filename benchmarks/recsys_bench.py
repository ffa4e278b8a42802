"""A recommender-scale table: mpisync's rows path against one process and TorchRec.

One table of ``--rows`` (10^6) x 64 float32 rows, bags of 20 ids drawn uniformly with a
seeded generator (``numpy.random.default_rng([seed, worker_index])``), sum pooling,
``Linear(64, 1)``, ``BCEWithLogitsLoss`` on random labels (20% ones), Adagrad (lr 0.01),
``--batch`` (4,096) samples per worker. ``--kind`` picks who trains it:

- ``mpisync`` (under ``python -m mpisync.launch``): ``mpisync.EmbeddingBag(rows, 64,
  mode="sum")``, the table on the ps ranks (one shard per ps rank, ``"mod"``), drawn
  there from the seed; ``torch.optim.Adagrad`` wrapped in a ``SyncReplicasOptimizer``.
  A step looks up the batch's unique rows, pushes their gradients with the ``Linear``'s,
  and the ps ranks apply sparse Adagrad to those rows::

      .venv/bin/python -m mpisync.launch --workers 2 --ps 1 -- \\
          .venv/bin/python benchmarks/recsys_bench.py --kind mpisync

  The table keeps the library's default ``pool_on_ps="auto"``, which pools these bags
  (20 ids that rarely repeat) on the ps ranks: a step sends each ps rank the ids it owns
  with their bags and gets back 4,096 pooled sums, and the push carries each bag's
  gradient with the ids instead of row gradients; every byte is then counted by
  ``opt.stats`` (``bytes_per_ps``, ``lookup_sent_per_ps``, ``lookup_received_per_ps``).
  ``--pool-on-ps off`` looks the unique rows up instead (``pool_on_ps=False``), ``on``
  always pools.

- ``local``: one plain process, ``nn.EmbeddingBag(rows, 64, mode="sum", sparse=True)`` and
  ``torch.optim.Adagrad`` on the combined batch of ``--workers`` workers (the same ids
  and labels the workers of the ``mpisync`` job draw)::

      .venv/bin/python benchmarks/recsys_bench.py --kind local --workers 2

Each prints one JSON object as the last line of stdout (the chief, for ``mpisync``): the
median step time over ``--steps`` timed steps after ``--warmup`` untimed ones, its phases,
the bytes moved per step, every rank's peak RSS.

``--optimizer rowwise`` trains with ``mpisync.RowWiseAdagrad`` instead of Adagrad (one
accumulator per row, TorchRec's ``EXACT_ROWWISE_ADAGRAD``), for every parameter.

``--all`` (a plain process, not under MPI) runs, one job after another, mpisync on 2
workers and 1 ps rank and on 2 workers and 2 ps ranks (``--pool-on-ps`` passed on), the
one-process run (1 and 2
threads), and, where the peers' virtualenv exists (``make venv-peers``), TorchRec
(``torchrec_bench.py``: exact and row-wise Adagrad), and prints one JSON document with
mpisync's figures as ratios to TorchRec's and to the one process's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

# the script's folder is on sys.path: the helpers of the table benchmark (numpy only)
from embedding_bench import machine, ms, peak_rss_mb, sleepy_barrier

# torch and mpisync are imported where a job needs them: the --all driver runs without them
DIM = 64
BAG = 20
PHASES = ("step", "lookup", "head_loss", "backward", "opt_step")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_PYTHON = os.path.join(ROOT, ".venv-peers", "bin", "python")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("mpisync", "local"), default="mpisync",
                        help="mpisync: the table on the ps ranks; local: one plain process")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the table")
    parser.add_argument("--batch", type=int, default=4096, help="samples per worker")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--lr", type=float, default=0.01, help="Adagrad learning rate")
    parser.add_argument("--optimizer", choices=("adagrad", "rowwise"), default="adagrad",
                        help="adagrad: torch.optim.Adagrad; rowwise: mpisync.RowWiseAdagrad "
                             "(one accumulator per row, as TorchRec's EXACT_ROWWISE_ADAGRAD)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-on-ps", choices=("auto", "on", "off"), default="auto",
                        help="mpisync: the table's pool_on_ps: 'auto' (the library's "
                             "default: whichever moves fewer bytes), 'on' (True) or 'off' "
                             "(False); driver: passed to every mpisync job")
    parser.add_argument("--workers", type=int, default=2,
                        help="local: workers whose batches are combined; driver: worker ranks")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: OMP_NUM_THREADS, else torch's)")
    parser.add_argument("--all", action="store_true",
                        help="driver: every configuration as its own job, one JSON document")
    parser.add_argument("--peers", choices=("auto", "off"), default="auto",
                        help="driver: run TorchRec when .venv-peers exists (auto) or not")
    parser.add_argument("--repeat", type=int, default=1,
                        help="driver: rounds of every configuration (medians of their medians)")
    parser.add_argument("--timeout", type=float, default=600, help="driver: seconds per job")
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1:
        parser.error(f"--steps and --repeat must be at least 1 and --warmup at least 0, got "
                     f"{args.steps}, {args.repeat} and {args.warmup}")
    if args.rows < 1 or args.batch < 1 or args.workers < 1:
        parser.error("--rows, --batch and --workers must be at least 1")
    return args


# ---------------------------------------------------------------- data and bytes

def draw(rng: np.random.Generator, rows: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """One worker's batch: ``batch x 20`` int64 ids, uniform over the rows, and its labels.

    ``torchrec_bench.py`` draws the same (its ids flattened), so rank ``r`` there trains on
    worker ``r``'s batches here.
    """
    ids = rng.integers(0, rows, size=(batch, BAG), dtype=np.int64)
    labels = (rng.random(batch) < 0.2).astype(np.float32)
    return ids, labels


def rows_bytes(unique_ids: np.ndarray, num_ps: int, row_bytes: int = DIM * 4) -> dict:
    """The bytes of one step's rows messages between one worker and the ps ranks.

    From the layout of ``mpisync.protocol.rowsmsg.pack_rows`` (a header of ``3 + parts``
    int64 words, int64 ids, values padded to 8 bytes), one table in ``num_ps`` ``"mod"``
    shards, one per ps rank: to each ps holding some of the batch's ``u`` unique ids, a
    lookup request (``u`` ids) and its reply (``u`` rows); with the push, a rows message
    (``u`` ids and their gradient rows; counted by ``opt.stats["bytes_per_ps"]``).
    """
    head = 8 * (3 + 1)
    per_ps = np.bincount(unique_ids % num_ps, minlength=num_ps)
    used = [int(u) for u in per_ps if u]
    return {"lookup_ids_sent": sum(head + 8 * u for u in used),
            "lookup_rows_received": sum(head + -(-u * row_bytes // 8) * 8 for u in used),
            "rows_pushed": sum(head + u * (8 + row_bytes) for u in per_ps.tolist())}


# ---------------------------------------------------------------- profile hooks

class Timer:
    """Seconds spent in wrapped calls, per name (this process's share of a step)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        """Time ``owner.attr`` (a function or method) from now on; absent: nothing."""
        inner = getattr(owner, attr, None)
        if inner is None:
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        setattr(owner, attr, timed)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    @staticmethod
    def per_step_ms(before: dict, after: dict, steps: int) -> dict:
        return {k: round((v - before.get(k, 0.0)) * 1e3 / steps, 2) for k, v in after.items()}


def cpu_s() -> float:
    """This process's CPU time (user and system), seconds."""
    return time.process_time()


def faults() -> int:
    """This process's minor page faults so far (fresh pages touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class StepCPU:
    """A ps rank's CPU time per step over the steps it applies after step ``first - 1``
    (the workers' timed steps; with no warm-up, after step 0)."""

    def __init__(self, first: int):
        self.first, self.start, self.last, self.steps = max(first - 1, 0), None, None, 0

    def after_apply(self, step: int) -> None:
        if step == self.first:
            self.start = (cpu_s(), faults())
        elif self.start is not None:
            self.last, self.steps = (cpu_s(), faults()), self.steps + 1

    def per_step(self) -> tuple[float | None, float | None]:
        """(CPU ms, minor page faults) per step."""
        if not self.steps:
            return None, None
        return (round((self.last[0] - self.start[0]) * 1e3 / self.steps, 2),
                round((self.last[1] - self.start[1]) / self.steps, 1))


def time_ps(timer: Timer, cpu: StepCPU | None = None) -> None:
    """On a ps rank: time the optimizer's steps, the reduction of row gradients and lookups.

    Wraps mpisync's ps-side methods by name for this benchmark only; a name that is not
    there (mpisync changed) is left out of the profile. ``cpu`` counts the CPU time of
    the steps applied after the warm-up. No step hooks: an optimizer with hooks is stepped
    by torch's own ``step()``, not the compiled kernels, so hooks would time a slower step.
    ``optimizer_step`` is the ps's call that reduces the dense gradients, steps them and
    completes the step.
    """
    from mpisync.ps import rows as ps_rows
    from mpisync.ps import shard

    advance = shard.ShardServer._advance

    def timed_advance(self):
        t0 = time.perf_counter()
        notice = advance(self)
        if notice is not None:                      # the call that completed a step
            timer.add("optimizer_step", time.perf_counter() - t0)
        return notice

    shard.ShardServer._advance = timed_advance
    timer.wrap(ps_rows.RowShards, "_on_rows", "receive_rows")          # each push's rows
    timer.wrap(ps_rows.RowShards, "set_grads", "reduce_row_gradients")  # the step's sums ...
    timer.wrap(getattr(ps_rows, "_Pending", None), "sum", "sum_rows")  # ... or made later
    timer.wrap(ps_rows, "apply_rows", "apply_rows")                     # the row update
    timer.wrap(ps_rows.RowShards, "_answer_lookup", "answer_lookups")
    timer.wrap(ps_rows.RowShards, "_answer_exchange", "answer_lookups")
    if cpu is not None:
        complete = shard.ShardServer._complete      # the end of a step's apply

        def counted(self, cur):
            notice = complete(self, cur)
            cpu.after_apply(cur.step)
            return notice

        shard.ShardServer._complete = counted


# ---------------------------------------------------------------- mpisync job

def train_mpisync(cluster, args) -> dict:
    """The worker loop; timings, bytes and unique ids on this worker."""
    import torch

    import mpisync
    from mpisync.worker import rows as worker_rows

    timer = Timer()
    timer.wrap(worker_rows.RowsChannel, "lookup", "lookup_round_trip")
    timer.wrap(worker_rows.RowsChannel, "exchange", "lookup_round_trip")
    torch.manual_seed(args.seed)
    pool_on_ps = {"auto": "auto", "on": True, "off": False}[args.pool_on_ps]
    emb = mpisync.EmbeddingBag(args.rows, DIM, mode="sum", partition_strategy="mod",
                               seed=args.seed, pool_on_ps=pool_on_ps)
    head = torch.nn.Linear(DIM, 1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    loss_fn = torch.nn.BCEWithLogitsLoss()
    rng = np.random.default_rng([args.seed, cluster.worker_index])
    sleepy_barrier(cluster.comm)     # every rank here: set-up timed from now
    start = time.perf_counter()
    opt = mpisync.SyncReplicasOptimizer(make_optimizer(args, model.parameters()),
                                        named_parameters=model.named_parameters(),
                                        cluster=cluster)
    phases = {k: [] for k in PHASES}
    # every batch drawn first (int32 ids where they fit): nothing between two steps but
    # the loop, so that work a step leaves to the ps ranks (the row updates, made while
    # the workers start the next step) lands in the next step's time, not in a gap
    small = np.int32 if args.rows < 2**31 else np.int64
    batches = [(ids.astype(small), labels) for ids, labels in
               (draw(rng, args.rows, args.batch) for _ in range(args.warmup + args.steps))]
    pooled = pools(pool_on_ps, batches, cluster.num_ps)
    before, profiled, cpu, faulted, ends = None, {}, 0.0, 0, []
    for i, (ids_np, labels_np) in enumerate(batches):
        if i == args.warmup:
            before = opt.stats if i else None    # a request to ps 0, untimed
            profiled = timer.snapshot()
        ids, labels = torch.from_numpy(ids_np.astype(np.int64)), torch.from_numpy(labels_np)
        cpu_at, faults_at = cpu_s(), faults()
        end = timed_step(opt, emb, head, loss_fn, ids, labels,
                         phases if i >= args.warmup else None)
        if i >= args.warmup:
            cpu += cpu_s() - cpu_at
            faulted += faults() - faults_at
            ends.append(end)
        if i == 0:
            first_step_s = end - start
    cpu_ms = round(cpu * 1e3 / args.steps, 2)
    after = opt.stats
    profile = Timer.per_step_ms(profiled, timer.snapshot(), args.steps)
    opt.close()
    # the rows path's bytes from each step's unique ids, from the last warm-up step on
    # (that one: for the check); pooled, the count of one step (the bytes are opt.stats')
    unique, moved = [], []
    for ids_np, _ in batches[max(args.warmup - 1, 0):][:1 if pooled else None]:
        u = np.unique(ids_np.astype(np.int64))
        unique.append(len(u))
        moved.append(rows_bytes(u, cluster.num_ps))
    moved_bytes = pooled_bytes(unique, [counted_bytes(s) for s in (before, after) if s]) \
        if pooled else worker_bytes(unique, moved, before, after)
    return {**summarise_phases(phases), "pool_on_ps": pool_on_ps, "pooled": pooled,
            **moved_bytes,
            # from the first timed step's end to the last one's, per step: every step
            # here holds the ps's work the step before it left (no gap between steps)
            "wall_ms_per_step": round((ends[-1] - ends[0]) * 1e3 / (len(ends) - 1), 2)
            if len(ends) > 1 else None,
            "token_wait_ms_mean": round((after["token_wait_s"] - (
                before["token_wait_s"] if before else 0.0)) * 1e3 / args.steps, 2),
            "profile_ms_per_step": profile, "cpu_ms_per_step": cpu_ms,
            "page_faults_per_step": round(faulted / args.steps, 1),
            "setup_s": round(first_step_s, 2), "global_step": after["global_step"]}


def pools(pool_on_ps, batches, num_ps: int) -> bool:
    """Whether the steps pool on the ps ranks: ``pool_on_ps``, or what ``"auto"`` picks.

    ``"auto"`` decides per forward (``mpisync.protocol.bags.pooling_pays``); the bytes are
    counted one way for every step, so a run whose batches it would split is refused.
    """
    if pool_on_ps != "auto":
        return pool_on_ps
    from mpisync.protocol.bags import pooling_pays
    picks = {pooling_pays(ids.size, len(np.unique(ids)), len(ids), DIM * 4, 0, num_ps)
             for ids, _ in batches}
    if len(picks) != 1:
        raise SystemExit("pool_on_ps='auto' pools some of these batches and not others: "
                         "pass --pool-on-ps on or off to count their bytes")
    return picks.pop()


def make_optimizer(args, params):
    """``--optimizer``: torch's Adagrad, or mpisync's RowWiseAdagrad (for every parameter)."""
    import torch

    if args.optimizer == "rowwise":
        import mpisync

        return mpisync.RowWiseAdagrad(params, lr=args.lr)
    return torch.optim.Adagrad(params, lr=args.lr)


def timed_step(opt, emb, head, loss_fn, ids, labels, phases: dict | None) -> float:
    """One training step; each phase's seconds appended to ``phases`` (if given).

    Returns the clock at the step's end.
    """
    t0 = time.perf_counter()
    opt.zero_grad()
    pooled = emb(ids)
    t1 = time.perf_counter()
    loss = loss_fn(head(pooled).squeeze(1), labels)
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    if phases is not None:
        for name, seconds in zip(PHASES, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[name].append(seconds)
    return t4


def summarise_phases(phases: dict) -> dict:
    """Median (p10, p90) of the step, the median of each phase, in ms."""
    step = phases["step"]
    return {"step_ms": ms(step), "step_ms_p10": ms(step, 10), "step_ms_p90": ms(step, 90),
            "phases_ms": {k: ms(v) for k, v in phases.items() if k != "step"}}


def worker_bytes(unique: list, moved: list, before, after) -> dict:
    """Bytes a worker moves per step (medians over the timed steps), and their check.

    ``opt.stats["bytes_per_ps"]`` holds the last push to each ps rank: the dense buffer
    and the rows message. The dense part is what the rows formula leaves of it. Checked:
    its change since the last warm-up step equals the formula's (the rows messages are
    counted, at 264 bytes an id); what is not counted there (the lookups, the pull)
    comes from the formula. ``pushed`` is what ``opt.stats`` says of a median step.
    """
    pushed = sum(after["bytes_per_ps"])
    dense_pushed = pushed - moved[-1]["rows_pushed"]
    check = None
    if before is not None:
        check = {"stats_change": pushed - sum(before["bytes_per_ps"]),
                 "formula_change": moved[-1]["rows_pushed"] - moved[0]["rows_pushed"]}
        moved, unique = moved[1:], unique[1:]
    med = {k: int(np.median([m[k] for m in moved])) for k in moved[0]}
    return {
        "unique_ids_per_step": int(np.median(unique)),
        "bytes_per_step": {
            "pushed": med["rows_pushed"] + dense_pushed, "pushed_opt_stats_last": pushed,
            "dense_pushed": dense_pushed, **med,
            "worker_sent": med["lookup_ids_sent"] + med["rows_pushed"] + dense_pushed,
            # the pull brings the dense parameters back: about the dense push's size
            "worker_received": med["lookup_rows_received"] + dense_pushed},
        "bytes_check": check,
    }


def counted_bytes(stats: dict) -> dict:
    """The bytes of the last step as ``opt.stats`` counts them (all ps ranks together)."""
    return {"pushed": sum(stats["bytes_per_ps"]),
            "lookup_sent": sum(stats["lookup_sent_per_ps"]),
            "lookup_received": sum(stats["lookup_received_per_ps"])}


def pooled_bytes(unique: list, counted: list[dict]) -> dict:
    """Bytes a worker moves per step with the bags pooled on the ps ranks (the median of
    the last warm-up step's and the last step's), all counted by ``opt.stats``: the push
    (dense buffer, rows message with
    the ids, bags and each bag's gradient), the lookup (ids and bags out, each ps rank's
    pooled sums back). The pull of the dense parameters is about the dense push's size."""
    med = {k: int(np.median([c[k] for c in counted])) for k in counted[0]}
    return {
        "unique_ids_per_step": int(np.median(unique)),
        "bytes_per_step": {
            **med, "worker_sent": med["pushed"] + med["lookup_sent"],
            "worker_received": med["lookup_received"]},
        "bytes_check": None,
    }


def run_mpisync(args) -> None:
    import torch

    import mpisync

    if args.threads:
        torch.set_num_threads(args.threads)
    cluster = mpisync.init()
    wall = time.perf_counter()
    # the first optimizer torch builds imports torch._dynamo (seconds): not the set-up's time
    torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1)
    mine, timer, cpu = None, Timer(), StepCPU(args.warmup)
    if cluster.is_ps:
        time_ps(timer, cpu)
        sleepy_barrier(cluster.comm)     # the workers have built their models
        cluster.serve()                  # until every worker has left the job
    else:
        mine = train_mpisync(cluster, args)
    world = cluster.comm                 # COMM_WORLD: close() frees only mpisync's own
    is_ps, num_workers, num_ps = cluster.is_ps, cluster.num_workers, cluster.num_ps
    cluster.close()
    sleepy_barrier(world)
    ranks = world.gather((is_ps, peak_rss_mb(), timer.snapshot(), timer.calls,
                          cpu.per_step()), root=0)
    if world.rank != 0:
        return
    ps = [(rss, seconds, calls) for p, rss, seconds, calls, _ in ranks if p]
    result = {
        "kind": "mpisync", "optimizer": args.optimizer, "rows": args.rows, "dim": DIM, "bag": BAG,
        "batch_per_worker": args.batch, "workers": num_workers, "ps": num_ps,
        "steps": args.steps, "warmup": args.warmup, **mine,
        # per ps rank over the whole run (warm-up included): ms per call of each part
        "ps_profile_ms_per_call": [{k: round(s[k] * 1e3 / c[k], 2) for k in s}
                                   for _, s, c in ps],
        "worker_peak_rss_mb": [r for p, r, _, _, _ in ranks if not p],
        # CPU time (user + system) per timed step: the workers', then each ps rank's
        "ps_cpu_ms_per_step": [c[0] for p, _, _, _, c in ranks if p],
        "ps_page_faults_per_step": [c[1] for p, _, _, _, c in ranks if p],
        "ps_peak_rss_mb": [r for r, _, _ in ps],
        "table_bytes": args.rows * DIM * 4,
        "wall_s": round(time.perf_counter() - wall, 2),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    emit(result, args.json_out)


# ---------------------------------------------------------------- one process

def run_local(args) -> None:
    """The same model in this process, on the combined batch of ``--workers`` workers."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    emb = torch.nn.EmbeddingBag(args.rows, DIM, mode="sum", sparse=True)
    head = torch.nn.Linear(DIM, 1)
    opt = make_optimizer(args, [*emb.parameters(), *head.parameters()])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    rngs = [np.random.default_rng([args.seed, w]) for w in range(args.workers)]
    phases = {k: [] for k in PHASES}
    for i in range(args.warmup + args.steps):
        drawn = [draw(rng, args.rows, args.batch) for rng in rngs]
        ids = torch.from_numpy(np.concatenate([d[0] for d in drawn]))
        labels = torch.from_numpy(np.concatenate([d[1] for d in drawn]))
        end = timed_step(opt, emb, head, loss_fn, ids, labels,
                         phases if i >= args.warmup else None)
        if i == 0:
            first_step_s = end - start
    result = {
        "kind": "local", "optimizer": args.optimizer, "rows": args.rows, "dim": DIM, "bag": BAG,
        "batch": args.batch * args.workers, "steps": args.steps, "warmup": args.warmup,
        **summarise_phases(phases), "peak_rss_mb": peak_rss_mb(), "setup_s": round(first_step_s, 2),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    emit(result, args.json_out)


def emit(result: dict, json_out: str | None) -> None:
    line = json.dumps(result)
    if json_out:
        with open(json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


# ---------------------------------------------------------------- the driver

def common_flags(args) -> list[str]:
    return ["--rows", str(args.rows), "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--lr", str(args.lr), "--seed", str(args.seed)]


def configurations(args) -> list[tuple[str, list[str]]]:
    """``(name, command line)`` of every job the driver runs, in order."""
    me, py, W = os.path.abspath(__file__), sys.executable, str(args.workers)
    mine = ["--optimizer", args.optimizer]          # TorchRec runs both of its own
    jobs = [(f"mpisync_{W}w{ps}p",
             [py, "-m", "mpisync.launch", "--workers", W, "--ps", str(ps),
              "--timeout", str(args.timeout), "--", py, me, "--kind", "mpisync",
              *common_flags(args), *mine, "--pool-on-ps", args.pool_on_ps]) for ps in (1, 2)]
    jobs += [(f"local_{t}t", [py, me, "--kind", "local", "--workers", W, "--threads", str(t),
                              *common_flags(args), *mine]) for t in (1, 2)]
    if args.peers == "auto" and os.path.exists(PEERS_PYTHON):
        peer = os.path.join(os.path.dirname(me), "torchrec_bench.py")
        jobs += [(f"torchrec_{o}",
                  [PEERS_PYTHON, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", W, peer, "--optimizer", o, *common_flags(args)])
                 for o in ("exact", "rowwise")]
    return jobs


def run_one(name: str, command: list[str], timeout: float) -> dict:
    """One job; the JSON object on the last line of its stdout, or why there is none.

    A job that fails is run once more (the first TorchRec job after an install has been
    seen to abort once in its set-up); the retry is recorded.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = []
    for _ in range(2):
        start = time.perf_counter()
        try:
            # check=False: a failed job is reported with its error, not raised
            proc = subprocess.run(command, env=env, capture_output=True, text=True,
                                  check=False, timeout=timeout + 30, cwd=ROOT)
        except subprocess.TimeoutExpired:
            failures.append(f"timed out after {timeout + 30} s")
            continue
        elapsed = round(time.perf_counter() - start, 1)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines and lines[-1].startswith("{"):
            out = {**json.loads(lines[-1]), "job_s": elapsed}
            if failures:
                out["failed_before"] = failures
            return out
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        failures.append({"error": f"exit {proc.returncode} after {elapsed} s",
                         "output_tail": tail})
    return {"name": name, "error": failures}


def summary(name: str, runs: list[dict]) -> dict:
    """One configuration over the rounds: step medians and the first run's other figures."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"name": name, "error": runs[0]["error"]}
    first, steps = ok[0], [r["step_ms"] for r in ok]
    row = {"name": name, "step_ms": round(float(np.median(steps)), 2), "step_ms_runs": steps,
           "step_ms_min": min(steps),
           "step_ms_p10_p90_first_round": [first["step_ms_p10"], first["step_ms_p90"]]}
    if first["kind"] == "mpisync":
        row.update(bytes_sent_per_worker=first["bytes_per_step"]["worker_sent"],
                   bytes_pushed=first["bytes_per_step"]["pushed"],
                   bytes_received_per_worker=first["bytes_per_step"]["worker_received"],
                   worker_peak_rss_mb=first["worker_peak_rss_mb"],
                   ps_peak_rss_mb=first["ps_peak_rss_mb"],
                   rank_rss_mb=first["worker_peak_rss_mb"] + first["ps_peak_rss_mb"])
    elif first["kind"] == "local":
        row.update(rank_rss_mb=[first["peak_rss_mb"]], threads=first["threads"])
    else:
        row.update(bytes_sent_per_rank_estimated=first["bytes_per_step_estimated"]["total"],
                   rank_rss_mb=first["peak_rss_mb"], optimizer=first["optimizer"])
    row["job_rss_mb"] = round(sum(row["rank_rss_mb"]), 1)
    return row


def ratios(mine: dict, other: dict, mine_runs: list[dict], other_runs: list[dict]) -> dict:
    """mpisync / ``other``: step time, largest rank's RSS, the job's RSS, bytes per rank.

    ``step_ms``: of the medians over the rounds; ``step_ms_in_round``: the median over the
    rounds of the two step times of one round (jobs run minutes apart, not at once).
    """
    in_round = [a["step_ms"] / b["step_ms"] for a, b in zip(mine_runs, other_runs)
                if "error" not in a and "error" not in b]
    out = {"step_ms": round(mine["step_ms"] / other["step_ms"], 2),
           "step_ms_in_round": round(float(np.median(in_round)), 2) if in_round else None,
           "max_rank_rss": round(max(mine["rank_rss_mb"]) / max(other["rank_rss_mb"]), 2),
           "worker_rss": round(max(mine["worker_peak_rss_mb"]) / max(other["rank_rss_mb"]), 2),
           "job_rss": round(mine["job_rss_mb"] / other["job_rss_mb"], 2)}
    if "bytes_sent_per_rank_estimated" in other:
        out["bytes_sent"] = round(mine["bytes_sent_per_worker"]
                                  / other["bytes_sent_per_rank_estimated"], 1)
    return out


def drive(args) -> None:
    """Every configuration as its own job, ``--repeat`` rounds back to back; one JSON."""
    jobs = configurations(args)
    runs: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    for round_ in range(args.repeat):
        for name, command in jobs:
            print(f"round {round_ + 1}/{args.repeat}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(run_one(name, command, args.timeout))
    rows = {name: summary(name, got) for name, got in runs.items()}
    compared = {}
    for name, row in rows.items():
        if not name.startswith("mpisync") or "error" in row:
            continue
        compared[name] = {f"over_{other}": ratios(row, rows[other], runs[name], runs[other])
                          for other in rows
                          if not other.startswith("mpisync") and "error" not in rows[other]}
    skipped = [] if any(n.startswith("torchrec") for n in rows) else [
        f"TorchRec: no {os.path.relpath(PEERS_PYTHON, ROOT)} (make venv-peers)"
        if args.peers == "auto" else "TorchRec: --peers off"]
    doc = {"machine": machine(), "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
           "rows": list(rows.values()), "mpisync_ratios": compared, "skipped": skipped,
           "runs": runs}
    text = json.dumps(doc, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    # the summary on one line last: the machine-readable result
    print(json.dumps({k: doc[k] for k in ("machine", "load_avg_after", "rows",
                                          "mpisync_ratios", "skipped")}), flush=True)


def main() -> None:
    args = parse_args()
    if args.all:
        drive(args)
    elif args.kind == "local":
        run_local(args)
    else:
        run_mpisync(args)


if __name__ == "__main__":
    main()
