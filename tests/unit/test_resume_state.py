"""What a checkpoint carries for an exact resume, in one process: a WorkerSampler's
position, the random number generators' states as plain values, and a save and resume
through a real SyncReplicasOptimizer whose ps 0 is this process too (``test_refusals.OneRank``)
that goes on bitwise as a run never stopped (parameters, learning rate, random draws,
sampled indices).
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from test_refusals import OneRank

import mpisync
from mpisync import resumestate
from mpisync.data import WorkerSampler, live_samplers


# -- WorkerSampler ---------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_a_loaded_sampler_goes_on_where_the_saved_one_stood(shuffle, drop_last):
    dataset = range(23)
    saved = WorkerSampler(dataset, 3, 0, shuffle=shuffle, seed=5, drop_last=drop_last)
    saved.set_epoch(4)
    whole = list(saved)
    assert len(whole) == len(saved) == (7 if drop_last else 8)
    it = iter(saved)
    first = [next(it) for _ in range(3)]
    state = saved.state_dict()
    assert state == {"epoch": 4, "seed": 5, "position": 3}
    assert first == whole[:3]

    loaded = WorkerSampler(dataset, 3, 0, shuffle=shuffle, seed=0, drop_last=drop_last)
    loaded.load_state_dict(state)
    assert loaded.state_dict() == state          # saved again before iterating: the same
    loaded.set_epoch(4)                          # the same epoch: the position stays
    assert list(loaded) == whole[3:]
    assert loaded.state_dict()["position"] == len(whole)
    assert list(loaded) == whole                 # the next pass of the epoch: all of it

    loaded.load_state_dict(state)
    loaded.set_epoch(5)                          # another epoch starts at its beginning
    assert loaded.state_dict() == {"epoch": 5, "seed": 5, "position": 0}
    fresh = WorkerSampler(dataset, 3, 0, shuffle=shuffle, seed=5, drop_last=drop_last)
    fresh.set_epoch(5)
    assert list(loaded) == list(fresh)


def test_drop_last_shares_are_skipped_within_their_own_length():
    sampler = WorkerSampler(range(10), 3, 0, shuffle=False, drop_last=True)
    assert list(sampler) == [0, 3, 6]
    sampler.load_state_dict({"epoch": 0, "seed": 0, "position": 2})
    assert list(sampler) == [6]
    sampler.load_state_dict({"epoch": 0, "seed": 0, "position": 9})     # past the end
    assert list(sampler) == []


def test_a_sampler_state_with_a_bad_entry_is_refused_naming_it():
    sampler = WorkerSampler(range(4), 1, 0)
    with pytest.raises(ValueError, match="'position' must be an int >= 0, got -1"):
        sampler.load_state_dict({"epoch": 0, "seed": 0, "position": -1})
    with pytest.raises(ValueError, match="'seed' must be an int >= 0, got None"):
        sampler.load_state_dict({"epoch": 0, "position": 0})


def test_live_samplers_are_found_in_creation_order_and_forgotten_when_gone():
    before = live_samplers()
    a, b = WorkerSampler(range(4), 1, 0), WorkerSampler(range(5), 1, 0)
    assert live_samplers() == [*before, a, b]
    del a
    assert live_samplers() == [*before, b]


# -- generators' states as plain values ------------------------------------------------------
def test_numpy_and_random_states_round_trip_as_plain_values():
    np.random.seed(3)
    np.random.standard_normal()                  # a cached gaussian in the state
    state = resumestate.encode_numpy(np.random.get_state())
    assert isinstance(state["key"], list) and all(type(k) is int for k in state["key"])
    expected = np.random.random_sample(4)
    np.random.set_state(resumestate.decode_numpy(state))
    assert np.array_equal(np.random.random_sample(4), expected)

    random.seed(7)
    random.gauss(0, 1)
    state = resumestate.encode_random(random.getstate())
    assert state["version"] == 3 and all(type(v) is int for v in state["internal"])
    assert resumestate.decode_random(state) == random.getstate()


def test_captured_generators_survive_weights_only_load(tmp_path):
    state = resumestate.capture_worker(0)
    torch.save(state, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    expected = (torch.rand(3), np.random.random_sample(3), random.random())
    resumestate.restore_rng(back["rng"])
    again = (torch.rand(3), np.random.random_sample(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]


# -- save and resume through a real optimizer ------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


DATA = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))


def _build(rank: OneRank):
    torch.manual_seed(11)
    net = Net()
    opt = rank.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = WorkerSampler(DATA, 1, 0, shuffle=True, seed=4)
    return net, opt, sched, sampler


def _train(net, opt, sched, sampler, steps: int, it) -> list:
    """``steps`` steps on batches of 4 from ``it``; what each drew and where it ended."""
    seen = []
    for _ in range(steps):
        batch = [next(it) for _ in range(4)]
        extra = (torch.rand(1).item(), float(np.random.random_sample()), random.random())
        opt.zero_grad()
        net(DATA[batch]).pow(2).mean().backward()
        opt.step()
        sched.step()
        seen.append((batch, extra, opt.param_groups[0]["lr"],
                     [p.detach().clone() for p in net.parameters()]))
    return seen


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (batch, extra, lr, params), (batch2, extra2, lr2, params2) in zip(a, b):
        assert batch == batch2 and extra == extra2 and lr == lr2
        assert all(torch.equal(p, q) for p, q in zip(params, params2))


def test_a_resumed_run_draws_and_trains_bitwise_as_one_never_stopped(tmp_path):
    rank = OneRank()
    rank.cluster.worker_comm = rank.worker_comm      # what save and load talk over
    try:
        torch.manual_seed(1)
        np.random.seed(1)
        random.seed(1)
        net, opt, sched, sampler = _build(rank)
        sampler.set_epoch(0)
        it = iter(sampler)
        _train(net, opt, sched, sampler, 3, it)
        ckpt = mpisync.Checkpointer(tmp_path, net, opt)
        path = ckpt.save()
        recorded = _train(net, opt, sched, sampler, 3, it)
        opt.close()
        del net, opt, sched, sampler, it

        torch.manual_seed(99)                        # every generator moved elsewhere
        np.random.seed(99)
        random.seed(99)
        net, opt, sched, sampler = _build(rank)
        assert len(live_samplers()) == 1
        ckpt = mpisync.Checkpointer(tmp_path, net, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.resume()
        assert opt.global_step == 3 and sampler.state_dict()["position"] == 12
        sampler.set_epoch(0)
        resumed = _train(net, opt, sched, sampler, 3, iter(sampler))
        _same(resumed, recorded)

        saved = torch.load(path, weights_only=True)
        assert [s["class"] for s in saved["schedulers"]] == ["StepLR"]
        assert saved["worker_states"][0]["samplers"] == [
            {"epoch": 0, "seed": 4, "position": 12}]
        assert saved["worker_states"][0]["rng"]["torch"].dtype == torch.uint8
    finally:
        rank.end()


@pytest.mark.filterwarnings("ignore:.*were written after the last step")
def test_another_number_of_workers_restores_the_schedulers_and_warns(tmp_path):
    rank = OneRank()
    rank.cluster.worker_comm = rank.worker_comm
    try:
        net, opt, sched, sampler = _build(rank)
        _train(net, opt, sched, sampler, 3, iter(sampler))
        path = mpisync.save(tmp_path / "c.pt", net, opt)
        last_epoch = sched.last_epoch
        ck = torch.load(path, weights_only=True)
        ck["worker_states"].append(ck["worker_states"][0])      # as if saved by 2 workers
        ck["workers"] = 2
        torch.save(ck, path)
        opt.close()
        del net, opt, sched, sampler

        net, opt, sched, sampler = _build(rank)
        with pytest.warns(UserWarning, match=f"{path} was saved by 2 workers, this job "
                          f"has 1: the schedulers are restored, the per-worker states"):
            mpisync.load(path, net, opt)
        assert sched.last_epoch == last_epoch and sampler.state_dict()["position"] == 0

        del ck["worker_states"], ck["schedulers"]                # a file written before
        torch.save(ck, path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mpisync.load(path, net, opt)
    finally:
        rank.end()


@pytest.mark.parametrize("resumes", ["nothing", "checkpointer", "load", "not-restarted",
                                     "later-attempt", "checkpointer-never-resumed"])
def test_under_restarts_a_job_that_nothing_resumes_warns_once_at_its_first_step(
        tmp_path, monkeypatch, resumes):
    """``python -m mpisync.launch --restarts`` sets MPISYNC_ATTEMPT: a chief that made no
    Checkpointer and loaded no checkpoint before its first step says, once, in its first
    attempt, at the program's line that stepped, that a restarted attempt would begin from
    step 0; with either, not under the launcher's restarts, or in a later attempt (said
    already), nothing is said."""
    if resumes == "not-restarted":
        monkeypatch.delenv("MPISYNC_ATTEMPT", raising=False)
    else:
        monkeypatch.setenv("MPISYNC_ATTEMPT", "1" if resumes == "later-attempt" else "0")
    rank = OneRank()
    rank.cluster.worker_comm = rank.worker_comm
    try:
        net, opt, sched, sampler = _build(rank)
        if resumes == "checkpointer":
            mpisync.Checkpointer(tmp_path, net, opt, every_steps=10).resume()
        elif resumes == "checkpointer-never-resumed":
            mpisync.Checkpointer(tmp_path, net, opt, every_steps=10)
        elif resumes == "load":
            mpisync.load(mpisync.save(tmp_path / "c.pt", net, opt), net, opt)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _train(net, opt, sched, sampler, 3, iter(sampler))
        said = [str(w.message) for w in seen if "--restarts" in str(w.message)]
        text = {"nothing": resumestate.START_OVER_WARNING,
                "checkpointer-never-resumed": resumestate.START_OVER_NO_RESUME}.get(resumes)
        expected = [f"{opt.cluster.label}: " + text.format(attempt="0")] if text else []
        assert said == expected, said
        assert all(w.filename == __file__ for w in seen if "--restarts" in str(w.message))
        opt.close()
    finally:
        rank.end()


def test_a_polite_stop_leaves_the_launchers_record_of_it(tmp_path, monkeypatch):
    """SIGUSR1, then ``maybe_save()``: a checkpoint, ``SystemExit(75)``, and, under the
    launcher's ``--restarts`` (MPISYNC_FAILURE_DIR), the chief's record of the stop at that
    step, which makes the launcher start the job again at once."""
    import signal

    from mpisync.environ import PREEMPTED_EXIT
    from mpisync.runtime import failures, stopping

    monkeypatch.setenv("MPISYNC_FAILURE_DIR", str(tmp_path / "records"))
    (tmp_path / "records").mkdir()
    before = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    rank = OneRank()
    rank.cluster.worker_comm = rank.worker_comm
    try:
        net, opt, sched, sampler = _build(rank)
        ckpt = mpisync.Checkpointer(tmp_path / "ckpt", net, opt, every_steps=100)
        _train(net, opt, sched, sampler, 2, iter(sampler))
        assert failures.read_stop(tmp_path / "records") is None
        signal.raise_signal(signal.SIGUSR1)
        with pytest.raises(SystemExit) as stopped:
            ckpt.maybe_save()
        assert stopped.value.code == PREEMPTED_EXIT
        assert failures.read_stop(tmp_path / "records") == 2
        assert (tmp_path / "ckpt" / "ckpt-000000002.pt").exists()
    finally:
        rank.end()
        while stopping.installed():
            stopping.release()
        for s, handler in before.items():
            signal.signal(s, handler)
