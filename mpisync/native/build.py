"""Compiled helpers built once per machine from mpisync's sources and loaded with ctypes."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import environ

__all__ = ["load"]


def cpu() -> str:
    """This machine's processor (``-march=native``: a shared cache dir may see others)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return platform.machine()


def _compile(command: list[str], target: Path) -> str | None:
    """Build the library into ``target`` with ``command`` (the output path comes where it
    holds None), atomically: ranks building at once all agree. None when built, else why
    not."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        subprocess.run([tmp if a is None else a for a in command], check=True,
                       capture_output=True, timeout=300)
        os.replace(tmp, target)
        return None
    except subprocess.CalledProcessError as exc:
        why = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"{command[0]} exited with status {exc.returncode}" + (f": {why[0]}" if why
                                                                        else "")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{command[0]}: {exc}"
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _open(path: Path, declare: Callable[[ctypes.CDLL], None], keep_gil: bool):
    try:
        lib = (ctypes.PyDLL if keep_gil else ctypes.CDLL)(str(path))
        declare(lib)
    except (OSError, AttributeError):        # not a library, or not this source's
        return None
    return lib


def load(name: str, source: Path | Sequence[Path], compiler: list[str], libraries: list[str],
         declare: Callable[[ctypes.CDLL], None], key: str = "",
         keep_gil: bool = False) -> tuple[ctypes.CDLL | None, str | None]:
    """The library ``name`` built from ``source`` (one file or several, compiled together;
    ``compiler``: the compiler and its flags; ``libraries``: what to link, after the
    sources): from the cache
    (``$MPISYNC_CACHE``, default ``~/.cache/mpisync``), else compiled into it, else (a
    cache that cannot be written) compiled into a private temporary directory. ``key``
    names what else the build depends on. ``keep_gil``: calls hold the GIL (PyDLL).

    Returns:
        (the library, None), or (None, why it could not be built).
    """
    sources = [source] if isinstance(source, Path) else list(source)
    command = [*compiler, "-o", None, *map(str, sources), *libraries]
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + " ".join(
        [*compiler, *libraries, key, cpu()]).encode())
    cache = Path(environ.text("MPISYNC_CACHE")).expanduser()
    target = cache / f"{name}-{digest.hexdigest()[:16]}.so"
    why = None
    if target.exists() or (why := _compile(command, target)) is None:
        lib = _open(target, declare, keep_gil)
        if lib is not None:
            return lib, None
    with tempfile.TemporaryDirectory(prefix=f"mpisync-{name}-") as private:
        built = Path(private) / target.name
        why = _compile(command, built)
        # loaded before the directory goes: the mapping outlives the file
        lib = _open(built, declare, keep_gil) if why is None else None
    return lib, (None if lib is not None else why or "not a loadable library")
