"""``make bench``: mpisync's dense step against its peers, as JSON and a PNG plot.

Runs ``benchmarks/suite.py`` (one MPI job: W workers and 2 ps ranks; every figure on the
same worker ranks) and, where ``.venv-openmpi`` has Horovod (``make horovod``), Horovod's
allreduce in a second job on W ranks under Open MPI. Then it works out, for every
mpisync figure, its ratio to ``MPI_Allreduce`` and to DDP of the same bytes and its
effective bandwidth against the ping-pong figure, and draws them::

    .venv/bin/python benchmarks/bench.py                    # MPICH, shared memory
    .venv/bin/python benchmarks/bench.py --no-shm           # MPICH over loopback TCP
    .venv/bin/python benchmarks/bench.py --mpi openmpi      # Open MPI (.venv-openmpi)
    .venv/bin/python benchmarks/bench.py --code /tmp/base   # another checkout of mpisync

``--no-shm`` takes shared memory out (``NO_SHM``): every message between ranks crosses the
loopback network, the closest one machine comes to two nodes (MPICH:
``MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp``; Open MPI:
``OMPI_MCA_btl=self,tcp``; mpisync: ``MPISYNC_SHARED_MEMORY=0``). The JSON goes to ``--json-out`` (default
``bench.json``), the plot to ``--png`` (default ``bench.png``, beside the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, nargs="+", default=[1, 2],
                        help="ps counts, one suite job each (the first also times many tensors)")
    parser.add_argument("--mpi", choices=["mpich", "openmpi"], default=None,
                        help="which virtualenv's MPI runs the suite (default: mpich, .venv; "
                             "openmpi: .venv-openmpi)")
    parser.add_argument("--no-shm", action="store_true",
                        help="no shared memory between ranks: every message over loopback "
                             "TCP, mpisync's own shared memory off (NO_SHM)")
    parser.add_argument("--code", default=None,
                        help="run another checkout of mpisync (put first on PYTHONPATH)")
    parser.add_argument("--no-horovod", action="store_true", help="leave Horovod out")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json-out", default="bench.json")
    parser.add_argument("--png", default=None, help="default: the JSON's path with .png")
    parser.add_argument("suite_args", nargs="*",
                        help="passed to suite.py after --, e.g. -- --mb 4 --steps 100")
    return parser.parse_args(argv)


def venv_python(name: str) -> Path:
    return ROOT / name / "bin" / "python"


def run_job(python: Path, script: str, workers: int, ps: int, args: list[str], env: dict,
            timeout: float) -> dict:
    """One ``mpisync.launch`` job of ``script``; its JSON (the last line of stdout)."""
    out = Path(tempfile.mkstemp(prefix="mpisync-bench-", suffix=".json")[1])
    cmd = [str(python), "-m", "mpisync.launch", "--workers", str(workers), "--ps", str(ps),
           "--timeout", str(int(timeout)), "--", str(python),
           str(ROOT / "benchmarks" / script), *args, "--json-out", str(out)]
    print("bench:", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd),
          file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **env), cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                 f"{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def horovod(args, suite_args: list[str]) -> dict:
    """Horovod's allreduce (and Open MPI's MPI_Allreduce) on the workers, or why not."""
    python = venv_python(".venv-openmpi")
    if args.no_horovod:
        return {"skipped": "--no-horovod"}
    if not python.exists() or subprocess.run(
            [str(python), "-c", "import horovod.torch"], capture_output=True,
            check=False).returncode != 0:
        return {"skipped": "no Horovod in .venv-openmpi (make horovod builds it)"}
    keep = []
    it = iter(suite_args)
    for a in it:              # the sizes and step counts apply; the rest is the suite's
        if a in ("--mb", "--steps", "--warmup", "--tensors"):
            keep.append(a)
            for v in it:
                if v.startswith("--"):
                    break
                keep.append(v)
    env = dict(NO_SHM["openmpi"]) if args.no_shm else {}
    # horovod runs on every rank of its job: W workers and no ps (mpisync.launch needs one
    # ps, so the job is W ranks through --ps 1 and W - 1 workers)
    return run_job(python, "suite.py", args.workers - 1, 1, keep + ["--only", "horovod"],
                   env, args.timeout)


def derive(result: dict) -> None:
    """Ratios and bandwidths of every mpisync figure, in place.

    Per size and ps count: ``step_over_allreduce`` and ``train_over_ddp`` (medians of the
    same run, the same workers); ``ps_link_gbs``: the bytes through each ps rank's link per
    step (M*W/P in and as much out) over the step's median, and its ratio to the ping-pong
    figure; ``allreduce_bus_gbs``: 2(W-1)/W*M per rank over the allreduce's median.
    """
    W = result["workers"]
    hv = result.get("horovod", {})
    for key, fig in result.items():
        if not isinstance(fig, dict) or "bytes" not in fig:
            continue
        M, gbs = fig["bytes"], fig.get("pingpong_gbs")
        if key in hv:
            fig["horovod"] = hv[key]
            fig["horovod"]["over_openmpi_allreduce"] = round(
                hv[key]["horovod_ms"]["median"] / hv[key]["allreduce_ms"]["median"], 3)
        for pkey, sync in fig.get("mpisync", {}).items():
            P = int(pkey[1:])
            step, ar = sync["step_ms"]["median"], sync["allreduce_ms"]["median"]
            sync["step_over_allreduce"] = round(step / ar, 3)
            sync["allreduce_bus_gbs"] = round(2 * (W - 1) / W * M / (ar * 1e-3) / GB, 3)
            if "train_ms" in sync and "ddp_ms" in sync:
                sync["train_over_ddp"] = round(sync["train_ms"]["median"]
                                               / sync["ddp_ms"]["median"], 3)
            sync["ps_link_gbs"] = round(2 * M * W / P / (step * 1e-3) / GB, 3)
            if gbs:
                sync["ps_link_over_pingpong"] = round(sync["ps_link_gbs"] / gbs, 3)
    many = result.get("many_tensors")
    if many:
        many["many_over_one"] = round(many["many_ms"]["median"] / many["one_ms"]["median"], 3)
    for pkey, mlp in result.get("mlp", {}).items():
        if isinstance(mlp, dict) and "ddp_ms" in mlp:
            mlp["mpisync_over_ddp"] = round(mlp["mpisync_ms"]["median"]
                                            / mlp["ddp_ms"]["median"], 3)


def plot(result: dict, path: Path) -> None:
    """One panel per model size (every figure of P=1 and P=2), one for the MLP and the
    many-tensor model; bars are medians, whiskers p10-p90."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [k for k, v in result.items() if isinstance(v, dict) and "bytes" in v]
    panels = len(sizes) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.6))
    names = {"allreduce_ms": "MPI_Allreduce", "gloo_ms": "gloo allreduce",
             "ddp_ms": "DDP step", "step_ms": "mpisync opt.step()",
             "train_ms": "mpisync step (fwd+bwd)"}
    for ax, key in zip(axes, sizes):
        f, bars = result[key], []
        if "horovod" in f:
            bars.append(("Horovod allreduce (Open MPI)", f["horovod"]["horovod_ms"]))
        for pkey, sync in f.get("mpisync", {}).items():
            bars += [(f"{pkey} {names[k]}", v) for k, v in sync.items() if k in names]
        _bars(ax, bars, f"{key} MiB, W={result['workers']}")
        if f.get("pingpong_gbs"):    # P=1: the ps moves 2 W M at the ping-pong rate
            floor = 2 * f["bytes"] * result["workers"] / (f["pingpong_gbs"] * GB) * 1e3
            ax.axvline(floor, color="k", ls=":", lw=1)
            ax.text(floor, len(bars) - 0.4, " P1 ps link floor", fontsize=7)
    bars = []
    for pkey, mlp in result.get("mlp", {}).items():
        if isinstance(mlp, dict):
            bars += [(f"MLP {pkey} DDP", mlp["ddp_ms"]), (f"MLP {pkey} mpisync", mlp["mpisync_ms"])]
    many = result.get("many_tensors")
    if many:
        bars += [("4 MiB, 1 tensor mpisync", many["one_ms"]),
                 (f"4 MiB, {many['tensors']} tensors mpisync", many["many_ms"])]
    _bars(axes[-1], bars, f"training step (MLP, {result['mlp'].get('params', 0) / 1e6:.1f} M)"
          f" and many tensors")
    fig.suptitle(f"{result.get('mpi', '')}, {result.get('transport', '')}, "
                 f"{result.get('date', '')}: median ms (p10-p90)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _bars(ax, bars, title) -> None:
    names = [n for n, _ in bars]
    med = [v["median"] for _, v in bars]
    lo = [v["median"] - v["p10"] for _, v in bars]
    hi = [v["p90"] - v["median"] for _, v in bars]
    colors = ["tab:blue" if "mpisync" in n else "tab:gray" for n in names]
    ax.barh(range(len(bars)), med, xerr=[lo, hi], color=colors, capsize=2)
    ax.set_yticks(range(len(bars)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)


def merge(jobs: list[dict]) -> dict:
    """One result from the suite's jobs (one per ps count): their figures side by side."""
    result = jobs[0]
    for job in jobs[1:]:
        for key, fig in job.items():
            if isinstance(fig, dict) and "bytes" in fig:
                mine = result.setdefault(key, fig)
                if mine is not fig:
                    mine["mpisync"].update(fig["mpisync"])
                    mine["pingpong_runs_gbs"] += fig["pingpong_runs_gbs"]
        result["mlp"].update({k: v for k, v in job["mlp"].items() if isinstance(v, dict)})
        result.setdefault("many_tensors", job.get("many_tensors"))
    for fig in result.values():
        if isinstance(fig, dict) and "pingpong_runs_gbs" in fig:
            runs = sorted(fig["pingpong_runs_gbs"])
            fig["pingpong_gbs"] = runs[len(runs) // 2]
    result["ps"] = [job["ps"] for job in jobs]
    result["wall_s"] = sum(job["wall_s"] for job in jobs)
    return result


#: What takes shared memory out of each MPI (ranks then talk over loopback TCP: checked
#: with ``ss -tnp`` during a run, benchmarks/README.md), and out of mpisync.
NO_SHM = {"mpich": {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi",
                    "FI_PROVIDER": "tcp", "MPISYNC_SHARED_MEMORY": "0"},
          "openmpi": {"OMPI_MCA_btl": "self,tcp", "MPISYNC_SHARED_MEMORY": "0"}}


def main(argv=None) -> None:
    args = parse_args(argv)
    mpi = args.mpi or "mpich"
    python = venv_python(".venv" if mpi == "mpich" else ".venv-openmpi")
    env = dict(NO_SHM[mpi]) if args.no_shm else {}
    if args.code:
        env["PYTHONPATH"] = os.path.abspath(args.code)
    jobs = [run_job(python, "suite.py", args.workers, ps,
                    args.suite_args + ([] if k == 0 else ["--skip", "many"]), env, args.timeout)
            for k, ps in enumerate(args.ps)]
    result = merge(jobs)
    result["transport"] = ("loopback TCP (" + " ".join(f"{k}={v}" for k, v in env.items()
                                                    if k != "PYTHONPATH") + ")"
                           if args.no_shm else "shared memory")
    result["horovod"] = horovod(args, args.suite_args)
    derive(result)
    out = Path(args.json_out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(result, png)
    print(json.dumps(result))
    print(f"bench: wrote {out} and {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
