"""What failed in an attempt at a job: one JSON record per failing rank, written where
``MPISYNC_FAILURE_DIR`` says, read by ``python -m mpisync.launch --restarts`` (no MPI).

A rank whose uncaught exception ends the job writes ``<dir>/rank-<rank>.json``::

    {"rank": 0, "label": "worker 0 (rank 0 on h)", "error": "RuntimeError: boom",
     "global_step": 7, "peer": false}

``error`` is the exception's type and the first line of its message; ``global_step`` the
global step of the rank's open ``SyncReplicasOptimizer`` (null without one); ``peer``
says the rank stopped because another rank failed (a ``PeerError``, or a rank lost). The
launcher takes the first record that is not a peer's, by rank, as where the attempt
failed (``origin``), and stops restarting a job that failed the same way twice
(``same_failure``): a bug, not a fault.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

__all__ = ["FAILURE_DIR_ENV", "describe", "error_text", "origin", "read_failures",
           "read_stop", "same_failure", "write_failure", "write_stop"]

#: Where each rank that fails writes its record (set by the launcher, one per attempt).
FAILURE_DIR_ENV = "MPISYNC_FAILURE_DIR"


def write_failure(directory: str | os.PathLike, rank: int, label: str, error: str,
                  global_step: int | None, peer: bool) -> str | None:
    """Write this rank's record into ``directory``; its path, or None where it could not
    be written. Never raises: it runs while a rank fails."""
    try:
        record = {"rank": int(rank), "label": str(label), "error": str(error),
                  "global_step": None if global_step is None else int(global_step),
                  "peer": bool(peer)}
        return _write(directory, f"rank-{int(rank)}.json", record)
    except Exception:  # noqa: BLE001 (best effort while the rank fails)
        return None


def _write(directory: str | os.PathLike, name: str, record: dict) -> str:
    """``record`` as JSON into ``directory/name``, whole or not at all for a reader."""
    path = os.path.join(os.fspath(directory), name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def write_stop(directory: str | os.PathLike, global_step: int) -> None:
    """The chief's word that the attempt stopped politely after a signal, its checkpoint
    written at ``global_step`` (``<dir>/stopped.json``): the launcher starts such an
    attempt again at once. Never raises."""
    with contextlib.suppress(Exception):   # without it the exit counts as a failure
        _write(directory, "stopped.json", {"global_step": int(global_step)})


def read_stop(directory: str | os.PathLike) -> int | None:
    """The global step of the attempt's polite stop (``write_stop``), or None."""
    try:
        step = json.loads((Path(directory) / "stopped.json").read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def error_text(exc_type: type, exc: object) -> str:
    """``"<Type>: <first line of the message>"`` (the type alone for an empty message)."""
    lines = str(exc).strip().splitlines()
    return f"{exc_type.__name__}: {lines[0]}" if lines else exc_type.__name__


def read_failures(directory: str | os.PathLike) -> list[dict]:
    """The records in ``directory``, by rank; files that are not whole records are skipped
    (a missing directory has none)."""
    records = []
    try:
        paths = sorted(Path(directory).glob("rank-*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int) \
                and isinstance(record.get("error"), str):
            records.append(record)
    return sorted(records, key=lambda r: r["rank"])


def origin(records: list[dict]) -> dict | None:
    """Where an attempt failed: the record of the lowest rank that is not a peer's, or None
    (no record: a rank killed, out of memory, or only peers that saw it)."""
    for record in sorted(records, key=lambda r: r["rank"]):
        if not record.get("peer"):
            return record
    return None


def same_failure(first: dict | None, second: dict | None) -> bool:
    """Two attempts' origins failed the same way: the same error text at the same global
    step. A failure with no record is never the same as another."""
    if first is None or second is None:
        return False
    return (first["error"], first.get("global_step")) == \
        (second["error"], second.get("global_step"))


def describe(record: dict | None) -> str:
    """A record in words, ``worker 0 (rank 0 on h): RuntimeError: boom, at global step 7``;
    ``no rank recorded an error`` for None."""
    if record is None:
        return ("no rank recorded an error (an error before mpisync.init(): see the output "
                "above; or a rank killed, out of memory, a crash)")
    label = record.get("label") or f"rank {record['rank']}"
    step = record.get("global_step")
    where = f", at global step {step}" if step is not None else ""
    return f"{label}: {record['error']}{where}"
