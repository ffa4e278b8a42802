"""The main job (``make demo``) trains digits to >= 0.9 test accuracy and exits 0; the
click-through-rate example (``make demo-ctr``) beats the constant predictor."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, timeout: float) -> str:
    """``script`` on 2 workers and 1 ps under the launcher; exits 0; returns its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "mpisync.launch", "--workers", "2", "--ps", "1",
         "--timeout", str(timeout - 40), "--", sys.executable, str(ROOT / "examples" / script)],
        check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=dict(os.environ, MPISYNC_TIMEOUT="120", OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_digits_example_reaches_accuracy_and_prints_statistics():
    out = run_example("digits.py", 300)
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9, out
    assert "gradients_applied" in out, out
    averaged = float(re.search(r"test accuracy of the moving averages \(decay 0.99\): ([0-9.]+)",
                               out).group(1))
    assert averaged >= 0.9, out


def test_ctr_example_beats_the_constant_predictor():
    out = run_example("ctr.py", 320)
    got = re.search(r"test log-loss: ([0-9.]+) \(constant predictor: ([0-9.]+), "
                    r"true model: ([0-9.]+)\)", out)
    assert got, out
    model, constant, true = map(float, got.groups())
    assert model < 0.98 * constant and true < model, out
    assert float(re.search(r"test AUC: ([0-9.]+)", out).group(1)) > 0.65, out
