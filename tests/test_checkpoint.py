"""Checkpoint files: kill and resume bitwise, plain torch reads them, bad files refused.

tests/scripts/resume.py trains a model with an ``mpisync.Embedding`` table, Adam, a
StepLR schedule and (``--ema``) moving averages in deterministic mode, saving every 3
global steps. A run killed with SIGKILL right after the checkpoint of step 6 and resumed
from it, with another number of ps ranks, must end bitwise equal to a run never stopped.
"""
from __future__ import annotations

import re
import sys
import zipfile

import pytest
import torch
from mpi_helpers import SCRIPTS, failing, run_mpi

sys.path.insert(0, str(SCRIPTS))
from resume import KILL_AT, STEPS, WORKERS, Net, batch

import mpisync


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted runs (with and without moving averages), 2 ps ranks."""
    out = {}
    for ema in (False, True):
        d = tmp_path_factory.mktemp(f"full-ema{int(ema)}")
        run = run_mpi("resume.py", WORKERS, 2, ["full", str(d)] + (["--ema"] if ema else []),
                      timeout=180)
        out[ema] = (run.by_worker(), d)
    return out


@pytest.mark.parametrize("ema, ps_before, ps_after", [(True, 2, 1), (False, 1, 3)])
def test_killed_and_resumed_ends_bitwise_equal(full, tmp_path, ema, ps_before, ps_after):
    flag = ["--ema"] if ema else []
    failing("resume.py", WORKERS, ps_before, ["kill", str(tmp_path)] + flag, timeout=180)
    assert mpisync.latest(tmp_path).endswith(f"ckpt-{KILL_AT:09d}.pt")
    run = run_mpi("resume.py", WORKERS, ps_after, ["resume", str(tmp_path)] + flag, timeout=180)
    want, _ = full[ema]
    for w, got in run.by_worker().items():
        assert got["resumed_from"] == KILL_AT and got["global_step"] == STEPS
        for key in want[w]:
            if key in ("resumed_from", "files"):
                continue
            assert got[key] == want[w][key], (w, key)       # bitwise: the floats' reprs
        assert "averages" in got if ema else "averages" not in got


def test_a_job_with_more_workers_and_ps_ranks_resumes_it(full, tmp_path):
    """The consolidated state is placed anew: 3 workers and 3 ps ranks go on from step 9."""
    _, d = full[True]
    (tmp_path / "ckpt-000000006.pt").write_bytes((d / "ckpt-000000006.pt").read_bytes())
    run = run_mpi("resume.py", 3, 3, ["resume", str(tmp_path), "--ema"], timeout=180)
    got = run.by_worker()
    assert sorted(got) == [0, 1, 2]
    assert {g["resumed_from"] for g in got.values()} == {6}
    assert {g["global_step"] for g in got.values()} == {STEPS}
    assert got[0]["table"] == got[2]["table"] and got[0]["averages"] == got[1]["averages"]


def test_keep_leaves_the_newest_files(full):
    by_worker, d = full[False]
    assert by_worker[0]["files"] == ["ckpt-000000006.pt", "ckpt-000000009.pt"]
    assert sorted(p.name for p in d.iterdir()) == ["ckpt-000000006.pt", "ckpt-000000009.pt"]


def test_plain_torch_reads_it_and_one_process_continues_it(full):
    """torch.load(weights_only=True), then the documented recipe, trained to the end."""
    by_worker, d = full[True]
    path = d / "ckpt-000000006.pt"
    ck = torch.load(path, weights_only=True)
    assert ck["format"] == "mpisync.checkpoint" and ck["global_step"] == 6
    assert ck["extra"]["note"] == "hi" and ck["workers"] == WORKERS and ck["ps"] == 2
    assert set(ck["optimizer"]["mpisync"]["averages"]) >= {"body.weight", "head.bias"}
    m = Net(plain=True)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    model_state, opt_state = mpisync.plain_state(path)
    m.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    sched.load_state_dict(ck["extra"]["scheduler"])
    for t in range(6, STEPS):
        x, ids, y = batch(t, -1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x, ids), y).backward()
        opt.step()
        sched.step()
    want = by_worker[0]
    for n, p in m.named_parameters():
        ref = torch.tensor(want["table"] if n == "emb.weight" else want[n])
        assert torch.allclose(p.detach(), ref, atol=1e-5), n
    assert opt.param_groups[0]["lr"] == pytest.approx(want["lr"])


def _truncated(src, dst) -> None:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) * 2 // 3])


def _newer(src, dst) -> None:
    ck = torch.load(src, weights_only=True)
    ck["version"] = 99
    torch.save(ck, dst)


@pytest.mark.parametrize("how, cause", [
    ("truncated", (r"not a complete checkpoint \(truncated, or not a file written by "
                  r"mpisync\.save\)")),
    ("newer", (r"written in checkpoint format version 99 by mpisync .*; this mpisync "
              r"\(.*\) reads version 1 and older")),
    ("other_model", r"the model does not match the checkpoint's"),
])
def test_a_bad_file_is_refused_on_every_worker_and_nothing_is_loaded(full, tmp_path, how,
                                                                      cause):
    _, d = full[False]
    src = d / "ckpt-000000006.pt"
    bad = tmp_path / "bad.pt"
    if how == "truncated":
        _truncated(src, bad)
    elif how == "newer":
        _newer(src, bad)
    else:
        ck = torch.load(src, weights_only=True)
        ck["model"]["body.weight"] = torch.zeros(3, 3)
        torch.save(ck, bad)
    run = run_mpi("checkpoint_errors.py", WORKERS, 1, ["load_bad", str(bad)], timeout=120)
    for w, got in run.by_worker().items():
        assert re.search(rf"worker {w} .*mpisync\.load\(\): .*bad\.pt: .*{cause}",
                         got["error"]), got["error"]
        assert got["unchanged"], w


def test_an_interrupted_write_leaves_the_previous_checkpoint(tmp_path):
    run = run_mpi("checkpoint_errors.py", WORKERS, 1, ["interrupted", str(tmp_path)],
                  timeout=120)
    for got in run.by_worker().values():
        assert "mpisync.save" in got["error"] and "failed on the chief" in got["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000002.pt"]
    assert zipfile.is_zipfile(tmp_path / "ckpt-000000002.pt")
    assert mpisync.latest(tmp_path) == str(tmp_path / "ckpt-000000002.pt")


def test_latest_passes_over_a_cut_file(tmp_path):
    (tmp_path / "ckpt-000000010.pt").write_bytes(b"PK\x03\x04 cut short")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert mpisync.latest(tmp_path) is None
    torch.save({"x": 1}, tmp_path / "ckpt-000000004.pt")
    assert mpisync.latest(tmp_path) == str(tmp_path / "ckpt-000000004.pt")
    assert mpisync.latest(tmp_path / "missing") is None
