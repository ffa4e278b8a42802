"""The checkpoint file itself: torch's zip format written record by record, atomically,
and read back with the checks that every checkpoint passes.

``mpisync.checkpoint`` says what a checkpoint holds; here its tensors are written to the
file as they arrive (a table shard at a time), the whole written beside the path and
renamed into place, and a file read back (its tensors mapped, nothing read yet) is
refused when it is not a complete mpisync checkpoint of a format this mpisync reads.
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import re
import socket
import sys
import warnings
import zipfile

import torch
from torch.serialization import _open_zipfile_writer

__all__ = ["FORMAT", "VERSION", "UnreadableCheckpoint", "Writer", "atomic_write", "complete",
           "malformed",
           "mpisync_version", "read", "remove_stale_temporaries"]

FORMAT = "mpisync.checkpoint"


class UnreadableCheckpoint(ValueError):
    """A whole file that torch cannot read back (its bytes damaged after it was written)."""

VERSION = 2   # full files are written as version 1, incremental ones as 2


# -- writing a torch file whose big tensors arrive one at a time ---------------------------
class _Deferred:
    """A tensor already written to the file (record ``data/{key}``), pickled by reference."""

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]):
        self.key, self.dtype, self.shape = key, dtype, tuple(shape)

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= d
        return (torch._utils._rebuild_tensor_v2,
                (_StorageRef(self), 0, self.shape, tuple(reversed(stride)), False,
                 collections.OrderedDict()))


class _StorageRef:
    def __init__(self, tensor: _Deferred):
        self.tensor = tensor


def _storage_type(dtype: torch.dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class Writer:
    """torch's zip format, written record by record (``torch.load`` reads it as usual)."""

    def __init__(self, f):
        self._opener = _open_zipfile_writer(f)
        self.zf = self._opener.__enter__()
        self.count = 0

    def tensor(self, t: torch.Tensor) -> _Deferred:
        """Write ``t`` now; what the pickled object holds in its place."""
        t = t.detach().contiguous()
        key, self.count = str(self.count), self.count + 1
        storage = t.untyped_storage()
        if t.storage_offset() or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()                 # a view into a bigger storage: its own bytes only
            storage = t.untyped_storage()
        self.zf.write_record(f"data/{key}", storage, storage.nbytes())
        return _Deferred(key, t.dtype, tuple(t.shape))

    def abort(self) -> None:
        """End the archive after a failure (the file is thrown away; nothing may write later)."""
        with contextlib.suppress(Exception):   # the write already failed: that is raised
            self._opener.__exit__(None, None, None)
        self.zf = None

    def finish(self, obj) -> None:
        """Pickle ``obj`` (its remaining tensors are written after it, as torch.save does)."""
        storages: dict[str, torch.UntypedStorage] = {}
        ids: dict[int, str] = {}
        writer = self

        class Pickler(pickle.Pickler):
            def persistent_id(self, o):
                if isinstance(o, _StorageRef):
                    t = o.tensor
                    numel = 1
                    for d in t.shape:
                        numel *= d
                    return ("storage", _storage_type(t.dtype), t.key, "cpu", numel)
                if isinstance(o, torch.storage.TypedStorage):
                    st = o._untyped_storage
                    if st.device.type != "cpu":
                        st = st.cpu()
                    key = ids.get(st._cdata)
                    if key is None:
                        key = ids[st._cdata] = str(writer.count)
                        writer.count += 1
                        storages[key] = st
                    return ("storage", getattr(torch, o._pickle_storage_type()), key, "cpu",
                            o._size())
                return None

        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)     # TypedStorage is deprecated
            Pickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        self.zf.write_record("data.pkl", data, len(data))
        self.zf.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self.zf.write_record(".storage_alignment", alignment, len(alignment))
        self.zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, st in storages.items():
            self.zf.write_record(f"data/{key}", st, st.nbytes())
        self._opener.__exit__(None, None, None)


def atomic_write(path: str, fill) -> None:
    """``fill(file)`` into a temporary file beside ``path``, then fsync and rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{_HOST}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
_TEMPORARY = re.compile(r"^\..+\.tmp-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)$")


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files (``atomic_write``'s) that a writer on this host left in
    ``directory`` when it died mid-write (killed, out of memory, preempted): a file of a
    process that is gone. Another host's files and a live process's stay. The paths
    removed; nothing where ``directory`` does not exist."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        found = _TEMPORARY.match(name)
        if found is None or found["host"] != _HOST or _alive(int(found["pid"])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mpisync_version() -> str:
    """This mpisync's version, as a file records it and a refusal names it."""
    from . import __version__
    return __version__


# -- reading -------------------------------------------------------------------------------
def read(path: str) -> dict:
    """The checkpoint's dict, its tensors mapped from the file (nothing read yet).

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ValueError: the file is not a checkpoint this mpisync reads (the message names it).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a complete checkpoint (truncated, or not a file "
                         f"written by mpisync.save)")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 (torch raises several kinds for a broken file)
        raise UnreadableCheckpoint(f"{path}: not a readable checkpoint "
                                   f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
                                   ) from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(f"{path}: not an mpisync checkpoint (no format {FORMAT!r})")
    if ck.get("version", 0) > VERSION:
        raise ValueError(f"{path}: written in checkpoint format version {ck['version']} by "
                         f"mpisync {ck.get('mpisync_version', '?')}; this mpisync "
                         f"({mpisync_version()}) reads version {VERSION} and older: "
                         f"upgrade mpisync")
    problem = _missing_entry(ck)
    if problem:
        raise ValueError(f"{path}: a malformed mpisync checkpoint ({problem})")
    return ck


# the entries of a table in the file, as save writes them
_TABLE_ENTRIES = ("num_rows", "row_shape", "dtype", "strategy", "shards")


def _missing_entry(ck: dict) -> str | None:
    """Which entry that every checkpoint has is missing or not a dict, or None."""
    for key in ("model", "optimizer"):
        if key not in ck:
            return f"no {key!r} entry"
    for key in ("model", "optimizer", "tables"):        # no tables: nothing to place
        if not isinstance(ck.get(key, {}), dict):
            return f"its {key!r} entry is a {type(ck[key]).__name__}, not a dict"
    for name, table in ck.get("tables", {}).items():
        if not isinstance(table, dict):
            return f"table {name!r} is a {type(table).__name__}, not a dict"
        missing = [key for key in _TABLE_ENTRIES if key not in table]
        if missing:
            return f"table {name!r} has no {' or '.join(map(repr, missing))} entry"
    return None


def malformed(path: str, exc: Exception) -> str:
    """What ``mpisync.load`` says of the file at ``path`` when reading or checking it
    raised ``exc``."""
    said = str(exc).splitlines()
    return (f"{path}: a malformed mpisync checkpoint ({type(exc).__name__}"
            f"{': ' + said[0] if said else ''})")


def complete(path: str) -> bool:
    """Whether the file at ``path`` is a whole zip archive with its pickle in it."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
