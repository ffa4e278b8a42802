"""The main job (``make demo``) trains digits to >= 0.9 test accuracy and exits 0."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_digits_example_reaches_accuracy_and_prints_statistics():
    proc = subprocess.run(
        [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
         "--timeout", "240", "--", sys.executable, str(ROOT / "examples" / "digits.py")],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, MPISYNC_TIMEOUT="60", OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9, out
    assert "gradients_applied" in out, out
    averaged = float(re.search(r"test accuracy of the moving averages \(decay 0.99\): ([0-9.]+)",
                               out).group(1))
    assert averaged >= 0.9, out
