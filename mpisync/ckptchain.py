"""Incremental checkpoints: files that hold a table's changed rows over a base, and their chains.

An incremental checkpoint (``mpisync.Checkpointer`` with ``full_every`` above 1) is a
whole checkpoint file but for its resident tables (``mpisync.Embedding``,
``mpisync.EmbeddingBag``): each of those, marked ``"incremental": True``, holds per
saved shard only the rows that changed since the previous file of its chain::

    {"ids": global ids, "at": their places in the shard, "weight": their rows,
     "per_row": [names of the per-row state entries],
     "state": {per-row entry: those rows, other entry (a "step"): whole}}

and the file names that previous file, its base: ``"base": {"file": its file name in the
same directory, "id": its "file_id"}``. Every file has a ``"file_id"`` of its own, so that
a base replaced by another file of the same name is told from the real one. The first
file of a chain is full. A hash table's shard (``mpisync.HashEmbedding``) holds, by id, the
rows whose values, state or counts changed, as a full file holds its rows, with
``"per_row"`` and ``"removed"``: the ids evicted since the previous file (None: the shard is
whole in this file); its ``"candidates"`` (ids seen, not admitted yet) are whole in every
file.

Reading one merges its chain shard by shard (``merged_tables``): the base's shard, then
each later file's rows for it in order, its non-row state from the newest file. Nothing
holds more than one merged shard; the files' tensors are mapped (``torch.load(mmap=True)``)
and read as they are needed.
"""
from __future__ import annotations

import os
import re
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch

from . import ckptfile

__all__ = [
    "UNREADABLE",
    "base_path",
    "chain",
    "chain_complete",
    "changed_shard",
    "file_id",
    "latest",
    "listed",
    "merged_tables",
    "needed",
    "newest_loadable",
    "only_cut_short",
    "unusable",
]


def file_id() -> str:
    """A fresh id for a file that an incremental one may name as its base."""
    return uuid.uuid4().hex


def base_path(path: str, ck: dict) -> str | None:
    """The path of the base that the checkpoint ``ck`` read from ``path`` names, or None
    (a full file)."""
    base = ck.get("base")
    if base is None:
        return None
    if not isinstance(base, dict) or not isinstance(base.get("file"), str):
        raise ValueError(f"{path}: a malformed mpisync checkpoint (its 'base' entry is "  # noqa: TRY004
                         f"{base!r})")
    return os.path.join(os.path.dirname(path), base["file"])


def chain(path: str, ck: dict | None = None) -> list[tuple[str, dict]]:
    """The files an incremental checkpoint needs, oldest (full) first, each read (mapped).

    Raises:
        FileNotFoundError, ValueError: a base is missing, cut short, not the file the
            later one was written over, or not a checkpoint (the message names it).
    """
    files = [(path, ckptfile.read(path) if ck is None else ck)]
    while (base := base_path(*files[0])) is not None:
        later = files[0][0]
        if len(files) > 10_000 or any(os.path.abspath(base) == os.path.abspath(p)
                                      for p, _ in files):
            raise ValueError(f"{later}: a malformed mpisync checkpoint (its chain of bases "
                             f"loops at {base})")
        if later == path:
            whose = f"{path}: an incremental checkpoint whose base {base}"
        else:
            whose = (f"{path}: an incremental checkpoint whose chain of bases needs {base} "
                     f"(the base of {later}), which")
        if not os.path.exists(base):
            raise FileNotFoundError(f"{whose} is missing; load an older full checkpoint")
        if not ckptfile.complete(base):
            raise ValueError(f"{whose} is not complete (truncated); load an older full "
                             f"checkpoint")
        bck = ckptfile.read(base)
        if bck.get("file_id") != files[0][1]["base"].get("id"):
            raise ValueError(f"{whose} was replaced by another file of that name; load an "
                             f"older full checkpoint")
        files.insert(0, (base, bck))
    return files


def chain_complete(path: str) -> bool:
    """Whether the file at ``path`` and every base of its chain are there and complete (a
    complete file that is no checkpoint this mpisync reads counts: ``load`` says why). A
    file that torch cannot read back (damaged after it was written) is not, with a
    warning that says so."""
    why = unusable(path)
    if why is not None and why.startswith(UNREADABLE):
        warnings.warn(f"{why[len(UNREADABLE):]}: passed over for an older one",
                      RuntimeWarning, stacklevel=2)
    return why is None


#: What ``unusable`` says first of a file torch cannot read back.
UNREADABLE = "unreadable: "


def only_cut_short(path: str) -> bool:
    """Whether ``path`` is a checkpoint file cut short (empty, or the start of a torch
    file), nothing of which can be read; not a file of something else, not a directory."""
    if not os.path.isfile(path) or ckptfile.complete(path):
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    return b"PK\x03\x04".startswith(head)       # a zip file's first bytes, or none


def unusable(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded with its chain (cut short, a base
    missing, cut short or replaced, torch cannot read it back), or None where it can (a
    complete file that is no checkpoint this mpisync reads counts: ``load`` says why)."""
    if not ckptfile.complete(path):
        if only_cut_short(path):
            return f"{path}: cut short (not a complete checkpoint file)"
        return f"{path}: not a checkpoint file (a torch file starts otherwise)"
    try:
        ck = ckptfile.read(path)
    except ckptfile.UnreadableCheckpoint as exc:
        return f"{UNREADABLE}{exc}"
    except Exception:  # noqa: BLE001 (not for latest() to judge)
        return None
    try:
        chain(path, ck)
    except Exception as exc:  # noqa: BLE001 (any file of the chain that cannot be read)
        return str(exc)
    return None


def needed(path: str) -> list[str]:
    """The files of ``path``'s chain that are there, newest first (for removing old ones:
    a base missing or unreadable ends it)."""
    out = [path]
    while True:
        try:
            base = base_path(out[-1], ckptfile.read(out[-1]))
        except Exception:  # noqa: BLE001 (a file that cannot be read names no base)
            return out
        if base is None or not os.path.exists(base) or base in out:
            return out
        out.append(base)


# -- writing -------------------------------------------------------------------------------
def changed_shard(shard: dict, tensor) -> dict:
    """One shard's changed rows (``table_shards(changed=...)``) as an incremental file holds
    them, each tensor passed through ``tensor`` (the writer's)."""
    return {"ids": tensor(shard["ids"]), "at": tensor(shard["at"]),
            "weight": tensor(shard["weight"]), "per_row": list(shard["per_row"]),
            "state": {k: tensor(v) if torch.is_tensor(v) else v
                      for k, v in (shard.get("state") or {}).items()}}


# -- reading -------------------------------------------------------------------------------
def merged_tables(files: list[tuple[str, dict]]) -> dict:
    """The tables of the newest of ``files`` (a ``chain``) as a full checkpoint holds them,
    each incremental table's shards merged one at a time as they are read."""
    newest_path, newest = files[-1]
    out = {}
    for name, table in newest.get("tables", {}).items():
        if not table.get("incremental"):
            out[name] = table
            continue
        parts = []
        for path, ck in files:
            t = (ck.get("tables") or {}).get(name)
            if t is None:
                raise ValueError(f"{path}: a malformed mpisync checkpoint (no table {name!r}, "
                                 f"which {newest_path} holds the changed rows of)")
            if len(t["shards"]) != len(table["shards"]):
                raise ValueError(f"{path}: a malformed mpisync checkpoint (table {name!r} "
                                 f"has {len(t['shards'])} shards, {newest_path} "
                                 f"{len(table['shards'])})")
            if not parts and t.get("incremental"):
                raise ValueError(f"{path}: a malformed mpisync checkpoint (the first file of "
                                 f"its chain holds table {name!r} incrementally)")
            parts.append(t["shards"])
        out[name] = {k: v for k, v in table.items() if k != "incremental"} | {
            "shards": _MergedShards(parts, table.get("strategy") == "hash")}
    return out


class _MergedShards(Sequence):
    """The shards of one table merged over a chain (the last one merged is kept)."""

    def __init__(self, parts: list[list[dict]], hashed: bool = False):
        self.parts, self.hashed = parts, hashed
        self.last: tuple[int, Mapping] | None = None

    def __len__(self) -> int:
        return len(self.parts[0])

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        if s < 0:
            s += len(self)
        if not 0 <= s < len(self):
            raise IndexError(s)
        if self.last is None or self.last[0] != s:
            pieces = [p[s] for p in self.parts]
            self.last = (s, _MergedHashShard(pieces) if self.hashed else _MergedShard(pieces))
        return self.last[1]


class _MergedShard(Mapping):
    """Saved shard ``s`` of a chain: its ids from the full file; its rows and state merged
    when first asked for."""

    def __init__(self, pieces: list[dict]):
        self.pieces = pieces
        self.merged: dict | None = None

    def __getitem__(self, key):
        if key == "ids":
            return self.pieces[0]["ids"]
        if key not in ("weight", "state"):
            raise KeyError(key)
        if self.merged is None:
            self.merged = _merge(self.pieces)
        return self.merged[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("ids", "weight", "state"))

    def __len__(self) -> int:
        return 3

    def weight_shape(self) -> tuple[int, ...]:
        """The shape of the merged rows, without merging them (``reshard.check_table``)."""
        return tuple(self.pieces[0]["weight"].shape)

    def shard_entries(self) -> dict:
        """The merged state's entries that are not per row, without merging the rows: the
        newest file's (``reshard.check_table``)."""
        rows = len(self.pieces[0]["ids"])
        if self.merged is not None or len(self.pieces) == 1:
            state = self["state"]
        else:
            newest = self.pieces[-1]
            per_row = set(newest["per_row"])
            state = {k: v for k, v in (newest.get("state") or {}).items() if k not in per_row}
        return {k: v for k, v in state.items()
                if not (torch.is_tensor(v) and v.dim() and v.shape[0] == rows)}


def _merge(pieces: list[dict]) -> dict:
    """A full shard and the changed rows of the later files, in order: the newest rows and
    state, as the newest file's full shard would hold them."""
    base = pieces[0]
    rows = len(base["ids"])
    weight = base["weight"].clone()
    state = {k: v.clone() if torch.is_tensor(v) else v
             for k, v in (base.get("state") or {}).items()}
    for piece in pieces[1:]:
        at = piece["at"]
        if len(at) and (int(at.min()) < 0 or int(at.max()) >= rows):
            raise ValueError(f"changed rows at places outside the shard's {rows} rows")
        weight[at] = piece["weight"].to(weight.dtype)
        per_row = set(piece["per_row"])
        after = {}
        for key, value in (piece.get("state") or {}).items():
            if key not in per_row:
                after[key] = value.clone() if torch.is_tensor(value) else value
                continue
            have = state.get(key)
            if not (torch.is_tensor(have) and have.dim() and have.shape[0] == rows
                    and have.dtype == value.dtype):
                have = torch.zeros(rows, *value.shape[1:], dtype=value.dtype)
            have[at] = value
            after[key] = have
        state = after
    return {"weight": weight, "state": state}


class _MergedHashShard(Mapping):
    """Saved shard ``s`` of a hash table over a chain: the full shard, then each later
    file's rows by id (the ids it names as ``removed`` dropped, its ids' rows, state and
    counts replacing or joining the others; ``removed`` None: the file holds the whole
    shard), ids sorted as the newest file's full shard would hold them. ``ids`` and
    ``counters`` are merged when first asked for, ``weight`` and ``state`` (the most of it)
    when one of them is."""

    def __init__(self, pieces: list[dict]):
        start = max(i for i, p in enumerate(pieces) if i == 0 or p.get("removed") is None)
        self.pieces = pieces[start:]              # from the newest whole one
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cache: dict = {}

    def __iter__(self) -> Iterator[str]:
        keys = ("ids", "weight", "state", "counters")
        return iter((*keys, "candidates") if "candidates" in self.pieces[-1] else keys)

    def __len__(self) -> int:
        return len(tuple(iter(self)))

    def __getitem__(self, key):
        if key == "candidates" and key in self.pieces[-1]:
            return self.pieces[-1][key]           # whole in every file
        if key not in self.cache:
            if key in ("weight", "state"):
                self.cache.update(self._rows())
            elif key in ("ids", "counters"):
                self.cache.update(self._ids())
            else:
                raise KeyError(key)
        return self.cache[key]

    def _ids(self) -> dict:
        """The merged ids and counts; each later file's (kept rows, order) for ``_rows``."""
        base = self.pieces[0]
        ids, counters = base["ids"], dict(base.get("counters") or {})
        self.steps = []
        for piece in self.pieces[1:]:
            new, got = piece["ids"], piece.get("counters") or {}
            keep = ~torch.isin(ids, torch.cat([piece["removed"].to(ids.dtype), new]))
            order = torch.argsort(torch.cat([ids[keep], new]))
            self.steps.append((keep, order))
            for key in ("count", "last"):
                if key in got and key in counters:
                    counters[key] = _joined(counters[key], got[key], keep, order)
                elif key in got:
                    counters[key] = got[key]
            counters["clock"] = got.get("clock", counters.get("clock", 0))
            ids = _joined(ids, new, keep, order)
        return {"ids": ids, "counters": counters}

    def _rows(self) -> dict:
        if self.steps is None:
            self.cache.update(self._ids())
        base = self.pieces[0]
        weight, state = base["weight"], dict(base.get("state") or {})
        for piece, (keep, order) in zip(self.pieces[1:], self.steps):
            per_row = set(piece.get("per_row") or ())
            after = {}
            for key, value in (piece.get("state") or {}).items():
                have = state.get(key)
                if key not in per_row:
                    after[key] = value
                elif torch.is_tensor(have) and have.dim() and len(have) == len(keep):
                    after[key] = _joined(have, value, keep, order)
                else:
                    raise ValueError(f"changed rows of a hash shard with state {key!r} per "
                                     f"row that its base does not hold per row")
            weight, state = _joined(weight, piece["weight"], keep, order), after
        return {"weight": weight, "state": state}


def _joined(old: torch.Tensor, new: torch.Tensor, keep: torch.Tensor, order: torch.Tensor
            ) -> torch.Tensor:
    """The rows of ``old`` kept, then ``new``'s, in ``order``."""
    out = torch.empty(len(order), *old.shape[1:], dtype=old.dtype)
    kept = int(keep.sum())
    where = torch.empty(len(order), dtype=torch.int64)
    where[order] = torch.arange(len(order))          # the place of each joined row
    out[where[:kept]] = old[keep]
    out[where[kept:]] = new.to(old.dtype)
    return out


_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def listed(directory: str) -> list[tuple[int, str]]:
    """The checkpoints ``ckpt-<step>.pt`` in ``directory``, oldest first, with their steps."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n))
             for n in names if (m := _NAME.match(n))]
    return sorted(found)


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint ``ckpt-<step>.pt`` in ``directory``, or None.

    A file cut short (a job killed while the rename had not happened cannot leave one,
    but a copy or a full disk can) is passed over for the one before it, and so is an
    incremental checkpoint whose chain of bases is not all there and complete, and, with
    a warning, a whole file that torch cannot read back (damaged after it was written).
    """
    for _, path in reversed(listed(os.fspath(directory))):
        if chain_complete(path):
            return path
    return None


def newest_loadable(directory: str) -> tuple[str | None, str | None, bool]:
    """The newest checkpoint of ``directory`` that loads with its chain (``latest``); what
    newer files were passed over and why (None when none was); whether to refuse to start
    afresh: none loads, and one passed over is more than a file cut short."""
    found = latest(directory)
    files = [path for _, path in listed(directory)]
    newer = files[files.index(found) + 1:] if found in files else files
    reasons = [unusable(p) or f"{p}: not loadable" for p in reversed(newer)]
    reasons = [r.removeprefix(UNREADABLE) for r in reasons]
    refuse = found is None and any(not only_cut_short(p) for p in newer)
    return found, "; ".join(reasons) or None, refuse
