"""Reading what a job recorded: the statistics log and, after a crash, the timeline.

``python -m mpisync.stats stats.jsonl`` prints a summary of a statistics log
(``MPISYNC_STATS``; ``--json``: as JSON) and with ``--png out.png`` draws the step time,
each worker's token wait and the dropped gradients over the run (matplotlib is needed for
the PNG only). The log's lines are described in ``mpisync/ps/steplog.py``.
``python -m mpisync.stats --timeline trace.json`` merges the ranks' timeline files
(``MPISYNC_TIMELINE``) that a job which did not end normally left behind.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .observe.timeline import merge

__all__ = ["plot", "read", "render", "summarize"]

PHASES = ("compute_ms", "push_ms", "wait_ms", "pull_ms")


def read(path: str) -> tuple[dict, list[dict]]:
    """The job's description and the step lines of a log (a line cut short is skipped).

    A log that attempts of a restarted job appended to (``python -m mpisync.launch
    --restarts``): the description is the first attempt's, with ``"attempts"``, every
    attempt's ``"job"`` line in order; each step line gets ``"attempt"``, the index of
    its attempt in that list.
    """
    job: dict = {}
    attempts: list[dict] = []
    lines: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                record = json.loads(text)
            except ValueError:
                continue           # the last line of a log that a crash cut short
            if "job" in record:
                attempts.append(record["job"])
            else:
                lines.append(dict(record, attempt=max(len(attempts) - 1, 0)))
    if attempts:
        job = dict(attempts[0], attempts=attempts)
    return job, lines


def _ms(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"median": round(float(np.median(a)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "max": round(float(a.max()), 3)}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.median(values)), 3) if values else None


def summarize(job: dict, lines: list[dict]) -> dict:
    """Totals and medians of a log, per worker and per ps, as plain data.

    ``taken_per_worker``/``gradients_applied`` count the gradients of applied steps and
    ``dropped_per_worker``/``gradients_dropped`` the rest, as ``opt.stats`` counts them.
    Of a restarted job (several attempts in one log): ``steps`` counts each global step
    once, ``steps_trained_again`` the steps an attempt trained again after the one before
    it stopped, ``seconds`` the attempts' training time without the time between them,
    ``attempts`` each attempt (``_attempts``); the other counts and medians are over every
    attempt's lines (the work done).
    """
    num_workers = job.get("num_workers") or 1 + max(
        (p["worker"] for line in lines for p in line["pushes"]), default=-1)
    num_ps = job.get("num_ps") or max((len(line["apply_ms"]) for line in lines), default=0)
    applied = [line for line in lines if line["applied"]]
    taken, dropped = [0] * num_workers, [0] * num_workers
    phases: list[dict[str, list[float | None]]] = [{k: [] for k in PHASES}
                                                   for _ in range(num_workers)]
    for line in lines:
        for p in line["pushes"]:
            counts = taken if p["taken"] and line["applied"] else dropped
            counts[p["worker"]] += 1
            for k in PHASES:
                phases[p["worker"]][k].append(p.get(k))
    runs = _attempts(job, lines)
    seconds = sum(run["seconds"] for run in runs)
    # a global step trained again after a restart counts once: the last attempt's
    distinct = len({line["step"] for line in applied})
    workers = [dict(worker=w, taken=taken[w], dropped=dropped[w],
                    **{k: _median(phases[w][k]) for k in PHASES}) for w in range(num_workers)]
    ps = [{"ps": j,
           "apply_ms": _median([line["apply_ms"][j] for line in applied]),
           "reduce_ms": _median([line["reduce_ms"][j] for line in applied]),
           "bytes_in_per_step": _median([line["bytes_in"][j] for line in applied]),
           "bytes_out_per_step": _median([line["bytes_out"][j] for line in applied])}
          for j in range(num_ps)]
    return {
        "opt": job.get("opt", 0), "num_workers": num_workers, "num_ps": num_ps,
        "replicas_to_aggregate": job.get("replicas_to_aggregate"),
        "steps": distinct, "not_applied": len(lines) - len(applied),
        "first_step": min(line["step"] for line in applied) if applied else None,
        "last_step": applied[-1]["step"] if applied else None,
        "seconds": round(seconds, 3),
        "steps_per_s": round(len(applied) / seconds, 3) if seconds > 0 else None,
        "steps_trained_again": len(applied) - distinct, "attempts": runs,
        "step_ms": _ms([line["step_ms"] for line in applied]),
        "decide_ms": _ms([line["decide_ms"] for line in applied]),
        "gradients_applied": sum(taken), "gradients_dropped": sum(dropped),
        "taken_per_worker": taken, "dropped_per_worker": dropped,
        "workers": workers, "ps": ps,
    }


def _attempts(job: dict, lines: list[dict]) -> list[dict]:
    """Per attempt of the job: the step it started from, its applied steps, its seconds
    (from its ps's start to its last applied step) and the seconds since the attempt
    before it applied its last step."""
    headers = job.get("attempts") or [job]
    runs, previous_end = [], None
    for index, header in enumerate(headers):
        applied = [line for line in lines if line.get("attempt", 0) == index
                   and line["applied"]]
        start = header.get("t", applied[0]["t"] if applied else 0.0)
        end = applied[-1]["t"] if applied else start
        runs.append({"attempt": header.get("attempt", index),
                     "from_step": header.get("global_step"), "steps": len(applied),
                     "first_step": applied[0]["step"] if applied else None,
                     "last_step": applied[-1]["step"] if applied else None,
                     "seconds": round(end - start, 3),
                     "down_s": None if previous_end is None else round(start - previous_end, 3)})
        previous_end = end
    return runs


def _fmt(x, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def render(path: str, s: dict) -> str:
    """The summary as text."""
    out = [(f"mpisync statistics log {path} (optimizer {s['opt']}): {s['num_workers']} "
            f"workers, {s['num_ps']} ps, replicas_to_aggregate {s['replicas_to_aggregate']}")]
    rate = "" if s["steps_per_s"] is None else f", {s['steps_per_s']:.2f} steps/s"
    out.append(f"global steps {s['first_step']}..{s['last_step']}: {s['steps']} applied "
               f"({s['not_applied']} more not applied) in {s['seconds']:.2f} s{rate}")
    if s["step_ms"]:
        st, de = s["step_ms"], s["decide_ms"] or {"median": float("nan")}
        out.append(f"step ms: median {st['median']:.2f}, p90 {st['p90']:.2f}, max "
                   f"{st['max']:.2f}; first push to decision ms: median {de['median']:.2f}")
    if len(s["attempts"]) > 1:
        out.append(f"{len(s['attempts'])} attempts (a restarted job); global steps trained "
                   f"again after a restart: {s['steps_trained_again']}")
        for run in s["attempts"]:
            down = "" if run["down_s"] is None else \
                f", started {run['down_s']:.2f} s after the last step before it"
            out.append(f"  attempt {run['attempt']}: from global step {run['from_step']}, "
                       f"steps {run['first_step']}..{run['last_step']} ({run['steps']} "
                       f"applied) in {run['seconds']:.2f} s{down}")
    out.append(f"gradients: {s['gradients_applied']} applied, {s['gradients_dropped']} dropped")
    out.append("worker   taken  dropped  compute ms  push ms  token wait ms  pull ms  (medians)")
    for w in s["workers"]:
        out.append(f"{w['worker']:>6} {w['taken']:>7} {w['dropped']:>8} "
                   f"{_fmt(w['compute_ms'], 11)} {_fmt(w['push_ms'], 8)} "
                   f"{_fmt(w['wait_ms'], 14)} {_fmt(w['pull_ms'], 8)}")
    out.append("ps  apply ms  reduce ms  in/step    out/step   (medians)")
    for p in s["ps"]:
        out.append(f"{p['ps']:>2} {_fmt(p['apply_ms'], 9)} {_fmt(p['reduce_ms'], 10)}  "
                   f"{_size(p['bytes_in_per_step']):>9}  {_size(p['bytes_out_per_step']):>9}")
    return "\n".join(out)


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def plot(job: dict, lines: list[dict], png: str) -> None:
    """Step time, each worker's token wait and the dropped gradients over time, as a PNG.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = job.get("t", lines[0]["t"] if lines else 0.0)
    num_workers = job.get("num_workers", 1)
    fig, (ax_step, ax_wait, ax_drop) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    applied = [line for line in lines if line["applied"] and line["step_ms"] is not None]
    ax_step.plot([line["t"] - start for line in applied], [line["step_ms"] for line in applied],
                 ".-", lw=0.8, ms=3)
    ax_step.set_ylabel("step time (ms)")
    ax_step.set_title(f"mpisync: {len(applied)} global steps, {num_workers} workers")
    for w in range(num_workers):
        points = [(line["t"] - start, p["wait_ms"]) for line in lines for p in line["pushes"]
                  if p["worker"] == w and p.get("wait_ms") is not None]
        if points:
            xs, ys = zip(*points)
            ax_wait.plot(xs, ys, ".", ms=3, label=f"worker {w}")
        drops = np.cumsum([sum(1 for p in line["pushes"]
                               if p["worker"] == w and not (p["taken"] and line["applied"]))
                           for line in lines])
        ax_drop.step([line["t"] - start for line in lines], drops, where="post",
                     label=f"worker {w}")
    ax_wait.set_ylabel("token wait (ms)")
    ax_wait.legend(loc="upper right", fontsize="small")
    ax_drop.set_ylabel("dropped gradients\n(cumulative)")
    ax_drop.set_xlabel("seconds since set-up (ps 0)")
    ax_drop.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Summarize an mpisync statistics log "
                                                 "(MPISYNC_STATS) and plot it.")
    parser.add_argument("path", help="the log, one JSON line per global step")
    parser.add_argument("--png", help="draw step time, token wait and drops into this PNG "
                                      "(needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--timeline", action="store_true",
                        help="PATH is an MPISYNC_TIMELINE path: merge the ranks' files "
                             "(PATH.rank<r>) that a job which did not end normally left")
    args = parser.parse_args(argv)
    if args.timeline:
        ranks = merge(args.path, remove=True)
        if not ranks:
            sys.exit(f"no {args.path}.rank0 found")
        print(f"merged the timelines of {ranks} ranks into {args.path}")
        return
    job, lines = read(args.path)
    summary = summarize(job, lines)
    print(json.dumps(summary) if args.json else render(args.path, summary), flush=True)
    if args.png:
        try:
            plot(job, lines, args.png)
        except ImportError as exc:
            sys.exit(f"--png needs matplotlib ({exc}): pip install matplotlib")


if __name__ == "__main__":
    main()
