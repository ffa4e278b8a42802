"""Every python block of the README and of the guides that needs no MPI job runs here, in
one process, each in a fresh namespace and directory (docs/guides, docs/concepts,
docs/index.md).

A block preceded by ``<!-- not run: reason -->`` is a fragment and is skipped (the reason
says why). A block that calls ``mpisync.init()`` is a program for every rank: those run
in tests/mpi/test_docs_jobs.py.
"""
from __future__ import annotations

import pytest
from shared_docs import FENCE, NOT_RUN, PAGES, blocks


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
