"""Checkpoint files: kill and resume bitwise, plain torch reads them, bad files refused.

tests/scripts/resume.py trains a model with an ``mpisync.Embedding`` table, Adam, a
StepLR schedule and (``--ema``) moving averages in deterministic mode, saving every 3
global steps. A run killed with SIGKILL right after the checkpoint of step 6 and resumed
from it, with another number of ps ranks, must end bitwise equal to a run never stopped.

The runs that end normally share one job per layout (tests/scripts/checkpoint_jobs.py runs
several programs in turn): 1 ps rank resumes the run killed at 2 ps, saves the tables of
each reshard case, loads every bad file and interrupts a write; 2 ps ranks run the
uninterrupted runs, resume the run killed at 2 ps from its incremental chain (a full file
of step 3 and the changed rows of step 6) and load the tables; 3 ps ranks resume the run
killed at 1 ps and load the tables. The killed runs and the job of 3 workers have their own. What makes a bad file
bad is decided by the chief from the file alone: each message is checked here, in one
process, and the job proves that every worker refuses it and goes on. What needs no job
(the verdict's fallbacks, what a file names, tables re-cut) is tests/unit/test_checkpoint.py's.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import zipfile

import pytest
import torch
from mpi_helpers import SCRIPTS, failing, run_mpi
from shared_checkpoint import BAD_CAUSES

sys.path.insert(0, str(SCRIPTS))
import tables_reshard as rs
from checkpoint_errors import BAD_KINDS, UNEVEN, bad_files
from resume import KILL_AT, STEPS, WORKERS, Net, batch

import mpisync
from mpisync import ckptfile, ckptfit

assert rs.WORKERS == WORKERS                   # the reshard cases share the jobs' layouts

# (moving averages, ps ranks of the killed run, ps ranks of the job that resumes it); the
# run with moving averages writes incremental checkpoints (every FULL_EVERY-th file full)
KILLED_AND_RESUMED = [(True, 2, 1), (False, 1, 3)]
FULL_EVERY = 3


def _groups(*groups: list[str]) -> list[str]:
    """checkpoint_jobs.py's arguments: each group ``[program, its arguments...]``."""
    return [arg for i, group in enumerate(groups) for arg in (["--"] if i else []) + group]


def _timeout(cases: int) -> int:
    """A merged job's limit: 60 s of start-up (15 s seen, 45 s at a load average of 22) and
    25 s a case (whole merged jobs took 50-70 s at that load)."""
    return 60 + 25 * cases


def _flag(ema: bool) -> list[str]:
    return ["--ema"] if ema else []


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """``{ema: (dir, its newest checkpoint right after, a copy of that one)}``: each run
    killed by SIGKILL after the checkpoint of step KILL_AT (the jobs that resume it add
    more files and remove older ones); ``"chain"``: a copy of the files of the run with
    moving averages (an incremental chain)."""
    out = {}
    for ema, ps_before, _ in KILLED_AND_RESUMED:
        d = tmp_path_factory.mktemp(f"killed-ema{int(ema)}")
        incremental = ["--full-every", str(FULL_EVERY)] if ema else []
        failing("resume.py", WORKERS, ps_before, ["kill", str(d)] + _flag(ema) + incremental,
                timeout=180)
        kept = tmp_path_factory.mktemp(f"kept-ema{int(ema)}") / f"ckpt-{KILL_AT:09d}.pt"
        shutil.copyfile(d / kept.name, kept)
        out[ema] = (d, mpisync.latest(d), kept)
        if ema:
            out["chain"] = tmp_path_factory.mktemp("chain")
            shutil.copytree(d, out["chain"], dirs_exist_ok=True)
    return out


@pytest.fixture(scope="module")
def bad(killed, tmp_path_factory):
    """``{kind: path}``: the bad files, made from the checkpoint of step 6 without
    moving averages (``missing``: a path with no file)."""
    return bad_files(killed[False][2], tmp_path_factory.mktemp("bad"))


@pytest.fixture(scope="module")
def at_one_ps(killed, bad, tmp_path_factory):
    """The job of 2 workers and 1 ps rank: the run killed at 2 ps resumed; every reshard
    case saved; every bad file loaded in turn; a write interrupted.
    ``({case: {worker: record}}, reshard dir, dir of the interrupted write)``."""
    tables, interrupted = tmp_path_factory.mktemp("reshard"), tmp_path_factory.mktemp("cut")
    run = run_mpi("checkpoint_jobs.py", WORKERS, 1, _groups(
        ["resume", "resume", str(killed[True][0]), "--ema"],
        ["tables_reshard", "save", str(tables), *rs.BY_NAME],
        ["checkpoint_errors", "load_bad", *bad.values()],
        ["checkpoint_errors", "interrupted", str(interrupted)],
        ["checkpoint_errors", "uneven", str(tmp_path_factory.mktemp("uneven"))]),
        timeout=_timeout(1 + len(rs.BY_NAME) + len(bad) + 2))
    steps = ({"resume-ema": STEPS} | {name: rs.K for name in rs.BY_NAME}
             | {f"load_bad:{kind}": 3 + i for i, kind in enumerate(bad)} | {"interrupted": None}
             | {"uneven": 2 + min(UNEVEN)})
    return run.assert_every_case_ran(steps, WORKERS, steps.get), tables, interrupted


@pytest.fixture(scope="module")
def at_two_ps(killed, at_one_ps, tmp_path_factory):
    """The job of 2 workers and 2 ps ranks: the uninterrupted runs, without and with moving
    averages, the run killed at 2 ps resumed from its incremental chain, then every reshard
    case loaded. ``({case: {worker: record}}, {ema: dir})``."""
    _, tables, _ = at_one_ps
    dirs = {ema: tmp_path_factory.mktemp(f"full-ema{int(ema)}") for ema in (False, True)}
    run = run_mpi("checkpoint_jobs.py", WORKERS, 2, _groups(
        *(["resume", "full", str(d)] + _flag(ema) for ema, d in dirs.items()),
        ["resume", "resume", str(killed["chain"]), "--ema", "--full-every", str(FULL_EVERY)],
        ["tables_reshard", "load", str(tables), *rs.BY_NAME]),
        timeout=_timeout(len(dirs) + 1 + 2 * len(rs.BY_NAME)))  # a load case trains twice
    steps = ({"full": STEPS, "full-ema": STEPS, "resume-ema-incr": STEPS}
             | {name: rs.K + rs.M for name in rs.BY_NAME})
    return run.assert_every_case_ran(steps, WORKERS, steps.get), dirs


@pytest.fixture(scope="module")
def full(at_two_ps):
    """The uninterrupted runs (with and without moving averages), 2 ps ranks:
    ``{ema: ({worker: record}, dir)}``."""
    by_case, dirs = at_two_ps
    return {ema: (by_case["full-ema" if ema else "full"], d) for ema, d in dirs.items()}


@pytest.fixture(scope="module")
def at_three_ps(killed, at_one_ps):
    """The job of 2 workers and 3 ps ranks: the run killed at 1 ps resumed, then every
    reshard case loaded, and a table of another shape. ``{case: {worker: record}}``."""
    _, tables, _ = at_one_ps
    shape = ["shape:adagrad-mod"]
    run = run_mpi("checkpoint_jobs.py", WORKERS, 3, _groups(
        ["resume", "resume", str(killed[False][0])],
        ["tables_reshard", "load", str(tables), *rs.BY_NAME, *shape]),
        timeout=_timeout(1 + 2 * len(rs.BY_NAME) + len(shape)))
    steps = ({"resume": STEPS} | {name: rs.K + rs.M for name in rs.BY_NAME}
             | {s: 0 for s in shape})
    return run.assert_every_case_ran(steps, WORKERS, steps.get)


# -- bad files -------------------------------------------------------------------------------
def _refusal(path: str) -> str:
    """What the chief finds wrong with the file at ``path``, as ``mpisync.load`` says it
    after ``"worker W (rank R on HOST): mpisync.load(): "``: the file read, then checked
    against the model (the tables of this file and model agree); what a check raises is
    the refusal of a malformed file."""
    try:
        ck = ckptfile.read(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    try:
        return f"{path}: {ckptfit._model(ck, Net())}"
    except Exception as exc:  # noqa: BLE001 (as the chief's verdict)
        return ckptfile.malformed(path, exc)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_file_is_refused_by_the_check_of_the_file(bad, kind):
    """The chief's verdict, in one process: the exact message of each kind."""
    path = bad[kind]
    exact = {
        "truncated": (f"{path}: not a complete checkpoint (truncated, or not a file written "
                      f"by mpisync.save)"),
        "newer": (f"{path}: written in checkpoint format version 99 by mpisync "
                  f"{mpisync.__version__}; this mpisync ({mpisync.__version__}) reads version "
                  f"2 and older: upgrade mpisync"),
        "other_model": (f"{path}: the model does not match the checkpoint's: 'body.weight' "
                        f"has shape [16, 13], the checkpoint's [3, 3]"),
        "not_a_checkpoint": f"{path}: not an mpisync checkpoint (no format 'mpisync.checkpoint')",
        "missing": f"{path}: no such file",
        "no_model": f"{path}: a malformed mpisync checkpoint (no 'model' entry)",
        "no_optimizer": f"{path}: a malformed mpisync checkpoint (no 'optimizer' entry)",
        "no_strategy": (f"{path}: a malformed mpisync checkpoint (table 'emb.weight' has no "
                        f"'strategy' entry)"),
        "not_a_tensor": (f"{path}: a malformed mpisync checkpoint (AttributeError: 'str' "
                         f"object has no attribute 'shape')"),
    }
    got = _refusal(path)
    if kind in exact:
        assert got == exact[kind]
    else:
        assert re.fullmatch(re.escape(path) + r": not a readable checkpoint \(RuntimeError: "
                            r"[^\n]*\)", got), got
    assert re.fullmatch(rf".*bad\.pt: {BAD_CAUSES[kind]}.*", got), got


@pytest.mark.parametrize("how", BAD_KINDS)
def test_a_bad_file_is_refused_on_every_worker_and_nothing_is_loaded(at_one_ps, bad, how):
    """One job loads every bad file in turn: each worker is refused, naming the file and
    the chief's verdict; nothing changed; it trains a step and goes on to the next."""
    by_case = at_one_ps[0]
    cause = BAD_CAUSES[how]
    for w, got in by_case[f"load_bad:{how}"].items():
        assert re.search(rf"worker {w} .*mpisync\.load\(\): .*bad\.pt: .*{cause}",
                         got["error"]), got["error"]
        assert re.fullmatch(rf"worker {w} \(rank {w} on [^)]*\): mpisync\.load\(\): "
                            + re.escape(_refusal(bad[how])), got["error"]), got["error"]
        assert got["unchanged"], w
        assert got["step_at_load"] == 2 + BAD_KINDS.index(how), got


def test_uneven_data_ends_a_loop_of_steps_and_saves_without_waiting_for_a_closed_worker(
        at_one_ps):
    """Worker 1 closes first; worker 0's later steps and maybe_save() calls are no-ops
    (``opt.stopped``), not a collective that worker 1 can never join."""
    got = at_one_ps[0]["uneven"]
    saved = [f"ckpt-{3 + i:09d}.pt" for i in range(min(UNEVEN))]
    assert got[1] == dict(got[1], saved=saved, stopped=False), got
    assert got[0] == dict(got[0], stopped=True,
                          saved=saved + [None] * (UNEVEN[0] - UNEVEN[1])), got
    assert sorted(os.listdir(got[0]["dir"])) == saved


def test_an_interrupted_write_leaves_the_previous_checkpoint(at_one_ps):
    by_case, _, d = at_one_ps
    for got in by_case["interrupted"].values():
        assert "mpisync.save" in got["error"] and "failed on the chief" in got["error"]
    assert sorted(p.name for p in d.iterdir()) == ["ckpt-000000002.pt"]
    assert zipfile.is_zipfile(d / "ckpt-000000002.pt")
    assert mpisync.latest(d) == str(d / "ckpt-000000002.pt")


# -- kill, resume, and the files ------------------------------------------------------------
@pytest.mark.parametrize("ema, ps_before, ps_after", KILLED_AND_RESUMED)
def test_killed_and_resumed_ends_bitwise_equal(full, killed, request, ema, ps_before,
                                               ps_after):
    _, newest, _ = killed[ema]
    assert newest.endswith(f"ckpt-{KILL_AT:09d}.pt")
    resumed = (request.getfixturevalue("at_one_ps")[0] if ps_after == 1 else
               request.getfixturevalue("at_three_ps"))["resume-ema" if ema else "resume"]
    want, _ = full[ema]
    for w, got in resumed.items():
        assert got["resumed_from"] == KILL_AT and got["global_step"] == STEPS
        for key in want[w]:
            if key in ("resumed_from", "files", "case"):
                continue
            assert got[key] == want[w][key], (w, key)       # bitwise: the floats' reprs
        assert "averages" in got if ema else "averages" not in got


def test_a_two_ps_job_resumes_bitwise_from_an_incremental_chain(full, killed, at_two_ps):
    """The run killed at 2 ps wrote a full file at step 3 and the changed rows of step 6
    over it; a job of 2 ps ranks resumes from the chain and ends as the unbroken run."""
    ck = torch.load(killed["chain"] / f"ckpt-{KILL_AT:09d}.pt", weights_only=True)
    assert ck["base"]["file"] == f"ckpt-{KILL_AT - 3:09d}.pt"
    assert ck["tables"]["emb.weight"]["incremental"] is True
    want, _ = full[True]
    for w, got in at_two_ps[0]["resume-ema-incr"].items():
        assert got["resumed_from"] == KILL_AT and got["global_step"] == STEPS
        for key in want[w]:
            if key not in ("resumed_from", "files", "case"):
                assert got[key] == want[w][key], (w, key)       # bitwise: the floats' reprs


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


# -- tables and their optimizer state into another partitioning ------------------------------
# shards of each case's table at save (1 ps rank) and at load with 2 and 3 ps ranks
RESHARD_SHARDS = {"adagrad-mod": (1, 2, 3), "adagrad-fixed-div": (2, 5, 5),
                  "sparse-adam-div-mod": (3, 2, 3), "bag-adam-axis-size": (1, 4, 4),
                  "sparse-embedding-adagrad": (2, 3, 3), "adagrad-missed-step": (2, 2, 3)}


def _loaded_at(request, ps: int) -> dict:
    """``{case: {worker: record}}`` of the job at ``ps`` ps ranks that loads the tables."""
    if ps == 2:
        return request.getfixturevalue("at_two_ps")[0]
    return request.getfixturevalue("at_three_ps")


@pytest.mark.parametrize("ps", [2, 3])
@pytest.mark.parametrize("name", list(rs.BY_NAME))
def test_tables_reshard_and_train_on_bitwise_as_an_unbroken_run(at_one_ps, request, ps, name):
    saved = at_one_ps[0]
    shards = RESHARD_SHARDS[name]
    assert {r["shards"] for r in saved[name].values()} == {shards[0]}
    if name == "adagrad-missed-step":       # a shard given no rows at a step counts it too
        assert [sc["step"] for sc in saved[name][0]["scalars"]] == [rs.K, rs.K]
    for w, got in _loaded_at(request, ps)[name].items():
        assert got["loaded_at"] == rs.K, (name, w)
        unbroken, restored = got["unbroken"], got["restored"]
        assert unbroken["shards"] == restored["shards"] == shards[ps - 1], (name, w)
        assert sorted(restored) == sorted(unbroken)
        assert restored["table_state"], (name, w)          # there is state that moved
        for key in unbroken:
            assert restored[key] == unbroken[key], (name, ps, w, key)   # floats exactly


def test_a_table_of_another_shape_is_refused_on_every_worker(at_three_ps):
    for w, got in at_three_ps["shape:adagrad-mod"].items():
        for what, mine in (("rows", "25 rows of \\[4\\]"), ("dim", "24 rows of \\[5\\]")):
            assert re.search(rf"worker {w} \(rank {w}[^)]*\): mpisync\.load\(\): "
                             rf".*adagrad-mod\.pt: table 'emb\.weight' was saved with 24 rows "
                             rf"of \[4\], this one has {mine}", got[what]), got[what]
            assert got[f"{what}_step"] == 0, (w, what)


@pytest.mark.slow
def test_save_and_load_hold_a_few_shards_not_the_table(tmp_path):
    """2e6 rows x 16 with Adagrad (244 MiB with its state) in 16 shards, loaded into 32."""
    run = run_mpi("tables_reshard_memory.py", 2, 2, [str(tmp_path), 2_000_000, 16, 32],
                  timeout=300)
    chief = run.by_worker()[0]
    save_anon, load_anon = chief["save_rise_mb"][0], chief["load_rise_mb"][0]
    # a few shards (4 at the peak, 61 MiB; the allocator's arenas have added up to 50 MiB
    # more on a loaded machine), well below the table with its state that a gather would add
    assert save_anon < min(10 * chief["saved_shard_mb"], 0.6 * chief["table_mb"]), chief
    assert load_anon < min(5 * chief["loaded_shard_mb"], chief["table_mb"] / 4), chief
