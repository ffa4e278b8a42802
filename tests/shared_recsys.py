"""How the tests of the recommender-scale benchmark run it (test_recsys_bench*.py): a
command whose last line of output is its JSON summary."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], timeout: float) -> dict:
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1",
                                             MPISYNC_TIMEOUT="60"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


SMALL = ["--rows", "5000", "--batch", "64", "--steps", "3", "--warmup", "1"]
