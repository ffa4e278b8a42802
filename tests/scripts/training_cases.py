"""Several cases in one job: ``--case NAME:OPTIONS``, each run with a program's own options.

A program that trains one way given its options (train.py, async_train.py, backup.py,
schedule_lag.py, observe.py) runs many cases in one job when given ``--case`` several
times: a fresh model and optimizer per case, one after another, and a RESULT record per
case and worker (``case=NAME``). The ps ranks serve the optimizers in the order the
cases are given, so their records are matched to the cases by position (``ps_by_case``).
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["case", "environment", "ps_by_case", "split_cases"]


def case(name: str, *options) -> str:
    """The ``--case`` value that runs ``name`` with these options (on a test's side)."""
    return f"{name}:{shlex.join(map(str, options))}"


def split_cases(specs: list[str], parse: Callable) -> list[tuple[str, object]]:
    """``[(name, parse(options))]`` of the ``--case`` values, in order."""
    out = []
    for spec in specs:
        name, sep, options = spec.partition(":")
        if not sep or not name:
            raise ValueError(f"--case {spec!r}: expected NAME:OPTIONS")
        out.append((name, parse(shlex.split(options))))
    return out


@contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """This process's environment with ``values`` set (None: unset) while it lasts: for
    what mpisync reads when an optimizer is built on this rank (``MPISYNC_STAGE_CPU``,
    ``MPISYNC_SHARED_MEMORY``, ``MPISYNC_PROGRESS``)."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            _put(k, v)
        yield
    finally:
        for k, v in saved.items():
            _put(k, v)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def ps_by_case(ps_records: list[dict], names: list[str]) -> dict[str, list[dict]]:
    """``{case: [each ps rank's record]}``: every ps rank reports the optimizers it served
    in creation order, one per case."""
    by_ps: dict[int, list[dict]] = {}
    for r in ps_records:
        by_ps.setdefault(r.get("ps", 0), []).append(r)
    for j, records in by_ps.items():
        assert len(records) == len(names), (f"ps {j} served {len(records)} optimizers for "
                                            f"{len(names)} cases")
    return {name: [by_ps[j][i] for j in sorted(by_ps)] for i, name in enumerate(names)}
