"""Several checkpoint programs in one job, one after the other (see test_checkpoint_jobs.py).

``checkpoint_jobs.py MODULE ARG... [-- MODULE ARG...]...``: each group names a program of
this folder (``resume``, ``tables_reshard``, ``checkpoint_errors``) and the arguments it
takes on its own command line; its ``cases(cluster, argv)`` yields ``(case, record)`` on
every worker, and each record is printed with its case. The ps ranks serve every
optimizer the groups create, in order, and report each one's global step.
"""
from __future__ import annotations

import importlib
import sys

from common import emit

import mpisync

PROGRAMS = ("resume", "tables_reshard", "checkpoint_errors")


def groups(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``[(module, its argv), ...]`` from ``MODULE ARG... -- MODULE ARG...``."""
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            out.append([])
        else:
            out[-1].append(arg)
    for group in out:
        if not group or group[0] not in PROGRAMS:
            raise SystemExit(f"checkpoint_jobs.py: each group starts with one of {PROGRAMS}, "
                             f"got {group[:1]}")
    return [(group[0], group[1:]) for group in out]


def main() -> None:
    todo = groups(sys.argv[1:])
    cluster = mpisync.init()
    if cluster.is_ps:
        served = cluster.serve()
        for stats in served if isinstance(served, list) else [served]:
            emit(role="ps", ps=cluster.ps_index, global_step=stats["global_step"])
        return
    for module, argv in todo:
        for case, record in importlib.import_module(module).cases(cluster, argv):
            emit(role="worker", worker=cluster.worker_index, case=case, **record)


if __name__ == "__main__":
    main()
