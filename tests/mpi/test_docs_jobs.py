"""The python blocks of the README and of the guides that call ``mpisync.init()``: programs
for every rank, all run in ONE MPI job (2 workers, 1 ps; tests/scripts/doc_blocks.py), one
after another. The other blocks run in one process (tests/unit/test_docs.py).
"""
from __future__ import annotations

import json
import os

from mpi_helpers import run_mpi
from shared_docs import ROOT, blocks


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
