"""In-process tests with MPI but without a launch: init(), rank layouts, the guarded
communicator, the poller, and the whole step protocol played by one process on COMM_SELF
(worker 0, ps 0 and the coordinator at once, the ps side in a thread)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpisync
from mpisync.errors import PeerError, StallError
from mpisync.protocol.layouts import layouts_of
from mpisync.protocol.spec import Model, Options, build_spec
from mpisync.protocol.wire import Kind, Tag
from mpisync.ps.loop import Job
from mpisync.ps_ranks import RankLayout
from mpisync.runtime.progress import SPIN_DEDICATED, SPIN_SHARED, Poller, spin_seconds
from mpisync.worker.channels import DenseChannel
from mpisync.worker.replicated import ReplicatedChannel


# -- init and the rank layout -------------------------------------------------------------
@pytest.mark.parametrize("num_ps", [1, 2, 0, -1])
def test_init_refuses_a_world_too_small(num_ps):
    with pytest.raises(mpisync.WorldTooSmallError, match=rf"rank 0: num_ps={num_ps} needs "
                                                         r"1 <= num_ps < world size; found 1 "
                                                         r"MPI ranks"):
        mpisync.init(num_ps=num_ps, comm=MPI.COMM_SELF, abort_on_error=False)


def test_init_refuses_a_num_ps_that_is_not_an_int():
    with pytest.raises(TypeError, match="num_ps must be an int, got str"):
        mpisync.init(num_ps="2", comm=MPI.COMM_SELF, abort_on_error=False)


def test_the_last_ranks_serve_by_default():
    layout = RankLayout.last(5, 2)
    assert layout.worker_ranks == (0, 1, 2) and layout.ps_ranks == (3, 4)
    assert layout.chief_rank == 0 and layout.coordinator_rank == 3
    assert layout.role(4) == ("ps", 1) and layout.role(2) == ("worker", 2)


def test_one_ps_per_node_first():
    hosts = ["a", "a", "a", "b", "b", "b", "c", "c"]
    layout = RankLayout.per_node(hosts, 2)
    assert layout.ps_ranks == (5, 7)              # each node's highest, the last node first
    assert layout.worker_ranks == (0, 1, 2, 3, 4, 6)
    assert RankLayout.per_node(hosts, 4).ps_ranks == (2, 5, 6, 7)   # round again
    assert RankLayout.choose(hosts, 2, {}) == layout                # several nodes
    assert RankLayout.choose(hosts, 2, {"MPISYNC_PS_LAYOUT": "last"}) == RankLayout.last(8, 2)
    with pytest.raises(ValueError, match="MPISYNC_PS_LAYOUT='ring'"):
        RankLayout.choose(hosts, 2, {"MPISYNC_PS_LAYOUT": "ring"})


# -- the guarded communicator -------------------------------------------------------------
def test_guarded_collectives_meet_first_and_so_do_communicators_made_from_them():
    from mpisync.runtime.guard import GuardedComm

    asked = []
    meet = MPI.COMM_SELF.Dup()
    comm = GuardedComm(MPI.COMM_SELF, lambda name, m: asked.append((name, m)), meet,
                       owned=True)
    assert comm.allreduce(3) == 3 and comm.Get_rank() == 0
    comm.Barrier()
    assert asked == [("allreduce", meet), ("Barrier", meet)]
    for make in (comm.Dup, comm.Clone, lambda: comm.Split(0, 0), lambda: comm.Idup()[0]):
        asked.clear()
        new = make()
        assert isinstance(new, GuardedComm) and new.Get_size() == 1
        new.bcast(1)
        assert asked[-1][0] == "bcast" and asked[-1][1] is new._meet is not meet
        new.Free()                               # the user's own: freed with its meeting

    def refuse(name, m):
        raise RuntimeError(f"no {name} now")

    with pytest.raises(RuntimeError, match="no gather now"):
        GuardedComm(MPI.COMM_SELF, refuse, meet).gather(1)
    with pytest.raises(RuntimeError, match="call cluster.close"):
        comm.Free()
    meet.Free()


# -- the poller ---------------------------------------------------------------------------
def test_waits_end_with_a_stall_error_naming_what_was_awaited():
    comm = MPI.COMM_SELF.Dup()
    try:
        poller = Poller(comm, 0.2, "worker 0 (rank 0)")
        buf = np.zeros(1)
        req = comm.Irecv(buf, source=0, tag=5)
        start = time.monotonic()
        with pytest.raises(StallError, match=r"worker 0 \(rank 0\): the answer did not arrive "
                                             r"within 0.2 s"):
            poller.wait_all([req], lambda: "the answer")
        assert time.monotonic() - start < 5
        comm.Send(np.ones(1), dest=0, tag=5)     # complete it, then it waits no more
        poller.wait_all([req], lambda: "the answer")
    finally:
        comm.Free()


def test_a_failure_notice_from_another_rank_stops_a_wait():
    comm = MPI.COMM_SELF.Dup()
    try:
        poller = Poller(comm, 30, "ps 0 (rank 0)")
        # the request is kept: it holds the pickled message until it is delivered
        notice = comm.isend("worker 3 (rank 3 on x) failed: ValueError: boom", dest=0,
                            tag=Tag.ERROR)
        req = comm.Irecv(np.zeros(1), source=0, tag=6)
        with pytest.raises(PeerError, match=r"ps 0 \(rank 0\): stopping because worker 3 "
                                            r"\(rank 3 on x\) failed: ValueError: boom"):
            poller.wait_all([req], lambda: "nothing")
        notice.wait()
        req.Cancel()
        req.Wait()
    finally:
        comm.Free()


def test_spin_depends_on_the_host_and_can_be_set(monkeypatch):
    monkeypatch.delenv("MPISYNC_POLL_SPIN_US", raising=False)
    assert spin_seconds(False) == SPIN_DEDICATED and spin_seconds(True) == SPIN_SHARED
    monkeypatch.setenv("MPISYNC_POLL_SPIN_US", "250")
    assert spin_seconds(True) == pytest.approx(250e-6)


# -- the protocol, one process playing every role ------------------------------------------
class _Self:
    """Rank 0 of a private COMM_SELF is worker 0, the chief, ps 0 and the coordinator."""

    def __init__(self, comm):
        self.p2p_comm = comm
        self.layout = RankLayout((0,), (0,))
        self.label = "self (rank 0)"
        self.ps_index = self.worker_index = 0
        self.coordinator_rank = 0
        self.losses = None               # a job that does not survive lost workers

    def ps_rank(self, j: int) -> int:
        return 0


class _PsThread(threading.Thread):
    def __init__(self, make_job):
        super().__init__(daemon=True)
        self.make_job, self.error = make_job, None

    def run(self) -> None:
        try:
            self.job = self.make_job()       # takes the chief's initial parameters
            while not self.job.done:
                if not (self.job.turn() or self.job.turn(rare=True)):
                    time.sleep(1e-4)
            self.stats = self.job.finish()
        except BaseException as exc:  # noqa: BLE001 (the test reports it)
            self.error = exc


def test_one_process_plays_worker_ps_and_coordinator():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    spec, _ = build_spec(opt, Model(tuple(net.named_parameters()), tuple(net.named_buffers())),
                         Options(shared_memory=False), opt_id=0, num_workers=1, num_ps=1)
    comm = MPI.COMM_SELF.Dup()
    me = _Self(comm)
    poller = Poller(comm, 20, me.label)
    channel = DenseChannel(spec, layouts_of(spec), me, dict(net.named_parameters()),
                           dict(net.named_buffers()), poller)
    ps = _PsThread(lambda: Job(me, spec, None, Poller(comm, 20, "ps")))
    ps.start()
    try:
        channel.send_initial()
        assert channel.pull(None)[:3] == (Kind.GO, 0, False)
        x = torch.randn(8, 4)
        for step in range(3):
            for m, o in ((net, None), (ref, ref_opt)):
                (o or channel).zero_grad(True)
                m(x).pow(2).mean().backward()
            if step == 1:
                net[0].bias.grad = None               # skipped by torch: by the ps too
                ref[0].bias.grad = None
            spec.hyper.encode(opt.param_groups, *channel.hyper_out)
            channel.gather()
            channel.push(step, 0, step + 1, 0, [])
            assert channel.pull(None)[:3] == (Kind.GO, step + 1, True)
            ref_opt.step()
            for (name, p), q in zip(net.named_parameters(), ref.parameters()):
                assert torch.allclose(p, q, atol=1e-6), (step, name)
            for b, c in zip(net.buffers(), ref.buffers()):  # the chief's, via the ps
                assert torch.equal(b, c)
        comm.send((Kind.STATE,), dest=0, tag=Tag.of(Tag.REQ, 0))
        state, averages, groups, values, version = poller.wait_message(
            0, Tag.of(Tag.INFO, 0), lambda: "state")
        assert torch.equal(values["0.weight"], net[0].weight.detach()) and version == 3
        assert sorted(state) == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert torch.allclose(state["0.weight"]["momentum_buffer"],
                              ref_opt.state[ref[0].weight]["momentum_buffer"], atol=1e-6)
        assert groups[0]["lr"] == 0.1 and averages == {}
        channel.close(3, 0)
        stats = channel.final_stats()
        ps.join(10)
        assert ps.error is None and not ps.is_alive()
        assert stats["global_step"] == 3 and stats["gradients_applied"] == 3
        assert {k: v for k, v in ps.stats.items() if k != "per_step"} == stats
    finally:
        ps.join(10)
        comm.Free()


class _Noted(torch.nn.Parameter):
    """A parameter subclass with a ``__torch_function__`` of its own."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_gradients_are_read_past_torch_function_only_where_no_parameter_has_one():
    from mpisync.worker.adoption import grads_read_plainly
    from mpisync.worker.tracking import TrackedParameter
    plain = [torch.nn.Parameter(torch.zeros(2)), torch.zeros(2),
             TrackedParameter(torch.zeros(2))]
    assert grads_read_plainly(plain)
    assert not grads_read_plainly([*plain, _Noted(torch.zeros(2))])


def test_tensors_of_any_dtype_and_shape_broadcast_from_the_chief():
    """bfloat16 and 0-dim parameters (a logit scale) go through the set-up broadcast."""
    tensors = [torch.ones(3, dtype=torch.bfloat16), torch.tensor(0.5), torch.ones(2, 3).t()]
    ReplicatedChannel(MPI.COMM_SELF, tensors).setup()
    assert tensors[0].dtype == torch.bfloat16 and tensors[1].item() == 0.5
