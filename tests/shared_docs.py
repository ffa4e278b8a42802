"""The python blocks of the README and of the guides: where they are and how they are read
(tests/unit/test_docs.py runs those of one process, tests/mpi/test_docs_jobs.py the rest)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
