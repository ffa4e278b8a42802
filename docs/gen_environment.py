"""MkDocs hook: the table of ``MPISYNC_*`` variables, generated from ``mpisync.environ``."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

MARKER = "{{ mpisync_environment_table }}"
ROOT = str(Path(__file__).resolve().parent.parent)


def _registry():
    """``VARIABLES`` of this checkout's ``mpisync/environ.py`` (importing it imports
    neither torch nor MPI)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return importlib.import_module("mpisync.environ").VARIABLES


def table() -> str:
    rows = ["| variable | kind | accepts | default | meaning |", "|---|---|---|---|---|"]
    for var in sorted(_registry().values(), key=lambda v: v.name):
        rows.append(f"| `{var.name}` | {var.kind} | {var.accepts()} | {var.shown_default()} "
                    f"| {var.meaning} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, table())
    return markdown
