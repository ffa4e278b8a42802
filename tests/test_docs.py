"""Every python block of the README and of the guides runs (docs/guides, docs/index.md).

A block preceded by ``<!-- not run: reason -->`` is a fragment and is skipped (the reason
says why). A block that calls ``mpisync.init()`` is a program for every rank: all of them
run in ONE MPI job (2 workers, 1 ps; tests/scripts/doc_blocks.py), one after another. The
others run here, in one process, each in a fresh namespace and directory.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from mpi_helpers import run_mpi

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md")),
         *sorted((ROOT / "docs" / "concepts").glob("*.md")),
         ROOT / "docs" / "index.md"]
FENCE = re.compile(r"(?P<before>[^\n]*)\n```python[^\S\n]*(?P<info>[^\n]*)\n(?P<code>.*?)\n```",
                   re.DOTALL)
NOT_RUN = re.compile(r"<!-- not run: .+ -->")


def blocks() -> list[tuple[str, str, bool]]:
    """``(name, code, multi_rank)`` of every block that runs; fragments left out."""
    found = []
    for page in PAGES:
        if not page.exists():
            continue
        text = "\n" + page.read_text()
        for m in FENCE.finditer(text):
            if NOT_RUN.search(m["before"]) or m["info"].strip():
                continue
            line = text.count("\n", 0, m.start("code"))
            name = f"{page.relative_to(ROOT)}:{line}"
            found.append((name, m["code"], "mpisync.init(" in m["code"]))
    return found


def fragments() -> list[str]:
    """Every block marked as not run, with its reason."""
    out = []
    for page in PAGES:
        if page.exists():
            for m in FENCE.finditer("\n" + page.read_text()):
                if NOT_RUN.search(m["before"]) or m["info"].strip():
                    out.append(f"{page.name}: {m['before'].strip() or m['info']}")
    return out


def test_the_pages_have_blocks_and_few_fragments():
    assert len(blocks()) >= 6, blocks()
    assert len(fragments()) <= 12, fragments()     # the few that cannot run: keep them few


@pytest.mark.parametrize("name, code", [(n, c) for n, c, multi in blocks() if not multi])
def test_one_process_block(name, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102 (the docs' own code)


def test_multi_rank_blocks_in_one_job(tmp_path):
    multi = [{"name": n, "code": c} for n, c, m in blocks() if m]
    assert multi, "no block calls mpisync.init()"
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(multi))
    run = run_mpi("doc_blocks.py", workers=2, ps=1, args=[spec], timeout=240,
                  env={"PYTHONPATH": os.pathsep.join(
                      filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    done = [r["name"] for r in run.results if r.get("role") == "block"]
    assert done == [b["name"] for b in multi], run.describe()
