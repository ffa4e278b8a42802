"""Each rank's heap: a step's large temporaries reused, not mapped anew each step.

torch's CPU tensors come from ``malloc``. glibc serves a block above its mmap threshold
(128 KiB to 32 MiB, raised as it sees large frees) with a fresh ``mmap`` and returns it to
the kernel on ``free``, and it gives the top of the heap back once more than its trim
threshold is free there. An optimizer that makes a bucket-sized temporary every step
(Adam's and AdamW's ``denom``, Adagrad's and RMSprop's square roots, a weight-decayed
gradient) then pays a page fault per 4 KiB page of it, every step (several times the
step's own time: the figures are in ``docs/benchmarks.md``, "Figures behind choices in
the code").

A ps rank runs nothing but mpisync's loop while it serves, so there mpisync tells glibc
to serve every block from the heap and to keep what was freed (``keep``; jemalloc and
tcmalloc behave so by default); when ``serve()`` returns, the freed memory goes back to
the kernel (``release``). The same setting serves the table shards' messages (a lookup,
a push, a reply: 1-3 MB each, every step).

A worker runs the user's program too, so it gets less, and only while an optimizer
trains on it (``keep_steps`` at its first step, ``let_go`` when the last closes): blocks
under 32 MiB from the heap and up to 256 MiB of freed memory kept at its top, so that a
step's temporaries (pooled sums, their gradients, the messages: about 1-4 MB each) find
their pages again; larger blocks are mapped and given back as glibc does. At its first
step a worker gives the heap's free pages back (``tidy``): what the program freed before
training is not kept. When the last optimizer closes, the heap takes glibc's first
thresholds.

``MPISYNC_KEEP_HEAP=0`` leaves glibc's defaults alone, and so do malloc settings of the
user's own (``MALLOC_*_`` variables, ``GLIBC_TUNABLES`` naming malloc). Other C libraries
are left as they are. This module is the one place that sets glibc's malloc options.
"""
from __future__ import annotations

import ctypes
import os

from .. import environ as env

__all__ = ["STEP_BLOCKS", "STEP_KEEP", "in_force", "keep", "keep_steps", "let_go", "release",
           "tidy", "wanted"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_KEEP_BYTES = (1 << 31) - 1      # the most mallopt takes: free memory kept at the heap's top
STEP_BLOCKS = 32 << 20           # a worker's blocks under this come from the heap (glibc's most)
STEP_KEEP = 256 << 20            # and this much freed memory stays in it
_FIRST = 128 << 10               # glibc's mmap and trim thresholds before any large free


# kept: keep() is in force; steps: the optimizers open on this worker under keep_steps()
_state: dict = {"kept": False, "steps": 0, "tidied": False}


def _glibc():
    """The process's glibc, or None (another C library, or none found)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (ValueError, OSError, AttributeError):
        return None


def wanted() -> bool:
    """Whether ``MPISYNC_KEEP_HEAP`` asks for the kept heap (unset, empty or ``1``: yes).

    Raises:
        ConfigError: any other value, naming the variable and this rank. ``mpisync.init()``
            reads it (as every variable) on every rank, so that every rank raises it
            alike, not the ps ranks alone once they serve while the workers wait for them.
    """
    return env.switch("MPISYNC_KEEP_HEAP")


def _users_own() -> bool:
    """Whether the environment sets malloc's options itself (they win over ours)."""
    return any(k.startswith("MALLOC_") for k in os.environ) or \
        "malloc" in os.environ.get("GLIBC_TUNABLES", "")


def _set(settings: tuple[tuple[int, int], ...]) -> bool:
    """glibc's ``mallopt`` with each ``(parameter, value)`` (unless ``MPISYNC_KEEP_HEAP=0``
    or the user's own malloc settings); whether every one took."""
    if not wanted() or _users_own():
        return False
    libc = _glibc()
    if libc is None:
        return False
    # mallopt answers 1 on success; a refused setting leaves glibc's as it was (each one
    # is tried, whatever the others answered)
    took = [bool(libc.mallopt(k, v)) for k, v in settings]
    return all(took)


def keep() -> bool:
    """Serve every block from the heap and keep freed memory there (glibc, unless
    ``MPISYNC_KEEP_HEAP=0`` or the user's own malloc settings); whether the setting is in
    force now."""
    if not _state["kept"]:
        _state["kept"] = _set(((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_BYTES)))
    return _state["kept"]


def keep_steps() -> bool:
    """A worker's optimizer takes its first step: from the first one's, blocks under
    ``STEP_BLOCKS`` come from the heap and up to ``STEP_KEEP`` of freed memory stays at
    its top (glibc, unless ``MPISYNC_KEEP_HEAP=0`` or the user's own malloc settings),
    until the last one closes (``let_go``); whether it is in force now (or ``keep()``'s)."""
    if _state["kept"]:
        return True
    if _state["steps"] or _set(((_M_MMAP_THRESHOLD, STEP_BLOCKS),
                                (_M_TRIM_THRESHOLD, STEP_KEEP))):
        _state["steps"] += 1
        return True
    return False


def let_go() -> None:
    """A worker's optimizer closed (after ``keep_steps``): when it was the last, the heap
    takes glibc's first thresholds (128 KiB: larger blocks mapped and given back when
    freed, more than that free at the top given back at the next free), so that what a
    program does after training (a checkpoint loaded shard by shard, an evaluation) holds
    what it uses, and reuses what training left in the heap."""
    if not _state["steps"]:
        return
    _state["steps"] -= 1
    libc = _glibc()
    if _state["steps"] == 0 and libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _FIRST)
        libc.mallopt(_M_TRIM_THRESHOLD, _FIRST)
        _state["tidied"] = False


def tidy() -> bool:
    """Under ``keep_steps``, at a worker's first step since: the heap's free pages back to
    the kernel (``malloc_trim``: every arena, the pages between live blocks too); whether
    it did. What the program freed before training (a dataset loaded in pieces, under
    32 MiB each, that glibc would have mapped and unmapped where no free of such a block
    had raised its threshold yet) is then not kept for the rest of the run. Later, the
    heap behaves as glibc's own once it has raised its threshold: it keeps what is freed
    between live blocks, and up to ``STEP_KEEP`` at its top."""
    if not _state["steps"] or _state["tidied"]:
        return False
    _state["tidied"] = True
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    return True


def in_force() -> str | None:
    """The setting in force: ``"kept"`` (``keep``), ``"steps"`` (``keep_steps``) or None."""
    return "kept" if _state["kept"] else "steps" if _state["steps"] else None


def release() -> None:
    """Give the heap's free memory back to the kernel (after ``keep()``); the settings
    stay, so that the next ``serve()`` finds its blocks again."""
    if _state["kept"]:
        libc = _glibc()
        if libc is not None:
            libc.malloc_trim(0)
