"""One-process tests of the coordinator's messages: what it sends for each decision.

A recording stand-in for the communicator captures every message; the shard server on
the coordinator's rank is a list of control messages.
"""
from __future__ import annotations

import numpy as np
import torch

from mpisync.protocol.spec import Model, Options, build_spec
from mpisync.protocol.wire import (
    FLAG_SCHEDULED,
    NOTICE_WORDS,
    Control,
    Kind,
    NoticeField,
    Tag,
)
from mpisync.ps.coordinator import Coordinator
from mpisync.runtime.progress import Poller


class _Request:
    def __init__(self):
        self.done = False

    def Test(self):
        return self.done


class _Comm:
    """Records what is sent; requests arrive through ``requests``."""

    def __init__(self):
        self.sent, self.isent, self.requests, self.irecvs = [], [], [], []

    def Send(self, buf, dest, tag):
        self.sent.append((dest, tag, np.array(buf[0]).copy()))

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, obj))

    def isend(self, obj, dest, tag):
        self.isent.append((dest, tag, obj))
        return _Request()

    def improbe(self, source, tag, status=None):
        if not self.requests:
            return None
        source_rank, obj = self.requests.pop(0)
        status.source = source_rank
        return type("Msg", (), {"recv": staticmethod(lambda: obj)})()

    def Irecv(self, buf, source, tag):
        req = _Request()
        self.irecvs.append((buf[0], source, tag, req))
        return req

    def Recv_init(self, buf, source, tag):      # the other ps ranks' notices
        return type("Prequest", (_Request,), {"Start": lambda self: None})()


def coordinator(num_workers: int, num_ps: int = 1, **options):
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    spec, _ = build_spec(opt, Model(tuple(net.named_parameters())), Options(**options),
                         opt_id=0, num_workers=num_workers, num_ps=num_ps)
    comm, local = _Comm(), []
    workers = tuple(range(num_workers))
    ps = tuple(range(num_workers, num_workers + num_ps))
    coord = Coordinator(spec, workers, ps, comm, Poller(None, 5, "ps 0"),
                        "ps 0", lambda msg, obj: local.append((msg.copy(), obj)))
    return coord, comm, local, spec


def hyper(value: float, width: int):
    return (np.full(width, np.float64(value).view(np.int64)), np.ones(width, np.uint8))


def applied(step: int, ps: int = 0) -> tuple:
    """A ps rank's APPLIED notice for ``step``."""
    notice = np.zeros(NOTICE_WORDS, np.int64)
    notice[NoticeField.KIND], notice[NoticeField.STEP] = Kind.APPLIED, step
    notice[NoticeField.SENDER] = ps
    return Kind.APPLIED, notice


def tokens(comm) -> list[tuple[int, int, int]]:
    """(worker rank, kind, step) of every token sent."""
    return [(dest, int(msg[0]), int(msg[1])) for dest, tag, msg in comm.sent
            if tag == Tag.of(Tag.TOKEN, 0)]


def test_a_step_applies_the_hyper_parameters_of_the_lowest_index_worker_taken():
    coord, comm, local, spec = coordinator(3)
    width, control = spec.hyper.width, Control(3, spec.hyper.width)
    coord.start()
    assert [int(m[0]) for m, _ in local] == [Kind.REPLY]
    assert tokens(comm) == [(0, Kind.GO, 0), (1, Kind.GO, 0), (2, Kind.GO, 0)]
    for w, lr in ((2, 0.3), (1, 0.2), (0, 0.1)):
        coord.on_notice((Kind.PUSHED, w, 0, 0, *hyper(lr, width)))
    decide = local[-1][0]
    assert int(decide[0]) == Kind.DECIDE and control.taken(decide) == (1, 1, 1)
    words, _ = control.hyper(decide)
    assert words.view(np.float64)[0] == 0.1          # worker 0's, not the last arrival's
    # a state request while the step is applied is answered after it, at the new step
    comm.requests.append((1, (Kind.STATE,)))
    coord.poll(rare=True)
    assert int(local[-1][0][0]) == Kind.DECIDE
    coord.on_notice(applied(0))
    assert tokens(comm)[-3:] == [(0, Kind.GO, 1), (1, Kind.GO, 1), (2, Kind.GO, 1)]
    state = local[-1][0]
    assert (int(state[0]), int(state[1]), int(state[2])) == (Kind.STATE, 1, 1)


def test_async_asks_the_worker_for_its_schedule_at_the_step_that_applies_its_gradient():
    coord, comm, local, spec = coordinator(2, asynchronous=True)
    width = spec.hyper.width
    coord.start()
    coord.on_notice((Kind.PUSHED, 0, 0, FLAG_SCHEDULED, *hyper(0.1, width)))   # step 0
    coord.on_notice((Kind.PUSHED, 1, 0, FLAG_SCHEDULED, *hyper(0.1, width)))   # queued
    coord.on_notice(applied(0))
    # worker 1's gradient, computed at step 0, is applied at step 1: ask it first
    assert tokens(comm)[-1] == (1, Kind.HYPER, 1)
    assert int(local[-1][0][1]) == 0                   # no DECIDE for step 1 yet
    buf, source, tag, req = comm.irecvs[-1]
    assert (source, tag) == (1, Tag.of(Tag.HYPER, 0))
    buf[0] = 1
    buf[1:1 + width] = np.float64(0.0).view(np.int64)
    buf[1 + width:].view(np.uint8)[:width] = 1
    req.done = True
    coord.poll()
    decide = local[-1][0]
    assert (int(decide[0]), int(decide[1])) == (Kind.DECIDE, 1)
    assert Control(2, width).hyper(decide)[0].view(np.float64)[0] == 0.0


def test_async_without_a_schedule_uses_the_values_the_gradient_came_with():
    coord, comm, local, spec = coordinator(2, asynchronous=True)
    coord.start()
    coord.on_notice((Kind.PUSHED, 0, 0, 0, *hyper(0.1, spec.hyper.width)))
    coord.on_notice((Kind.PUSHED, 1, 0, 0, *hyper(0.2, spec.hyper.width)))
    coord.on_notice(applied(0))
    assert all(kind != Kind.HYPER for _, kind, _ in tokens(comm))
    decide = local[-1][0]
    assert int(decide[1]) == 1
    assert Control(2, spec.hyper.width).hyper(decide)[0].view(np.float64)[0] == 0.2


def test_load_waits_for_every_worker_then_every_worker_gets_the_loaded_step():
    coord, comm, local, _spec = coordinator(2)
    coord.start()
    pieces = [{"state": {}, "averages": {}, "param_groups": [], "global_step": 7}]
    comm.requests += [(1, (Kind.LOAD, None)), (0, (Kind.LOAD, (pieces, 7)))]
    coord.poll(rare=True)
    assert int(local[-1][0][0]) == Kind.REPLY        # only start()'s so far
    coord.poll(rare=True)
    load, reply = local[-2], local[-1]
    assert (int(load[0][0]), int(load[0][1]), load[1]) == (Kind.LOAD, 7, pieces[0])
    assert int(reply[0][0]) == Kind.REPLY
    assert tokens(comm)[-2:] == [(0, Kind.GO, 7), (1, Kind.GO, 7)]
    answers = [(dest, obj) for dest, tag, obj in comm.sent if tag == Tag.of(Tag.INFO, 0)]
    assert answers == [(0, None), (1, None)]


def test_the_last_close_sends_every_worker_the_final_statistics():
    coord, comm, local, _spec = coordinator(2)
    coord.start()
    coord.on_notice((Kind.CLOSED, 1, 0))
    assert not coord.finished
    coord.on_notice((Kind.CLOSED, 0, 0))
    assert coord.finished and int(local[-1][0][0]) == Kind.SHUTDOWN
    finals = [(dest, obj) for dest, tag, obj in comm.isent if tag == Tag.of(Tag.INFO, 0)]
    totals = {k: v for k, v in coord.stats().items() if k != "per_step"}
    assert [d for d, _ in finals] == [0, 1] and finals[0][1] == finals[1][1] == totals


def test_a_step_another_ps_applied_before_the_decision_gets_its_tokens_once_decided():
    """Strict sync: ps 1 applies a step as soon as every worker's push is in, which can be
    before ps 0 heard the last push; the tokens wait for the decision and every ps."""
    coord, comm, local, spec = coordinator(2, num_ps=2)
    coord.start()
    coord.on_notice((Kind.PUSHED, 0, 0, 0, *hyper(0.1, spec.hyper.width)))
    coord.on_notice(applied(0, ps=1))                 # ps 1 is done already
    assert tokens(comm)[-1] == (1, Kind.GO, 0)        # only start()'s so far
    coord.on_notice((Kind.PUSHED, 1, 0, 0, *hyper(0.1, spec.hyper.width)))
    assert int(local[-1][0][0]) == Kind.DECIDE and tokens(comm)[-1] == (1, Kind.GO, 0)
    coord.on_notice(applied(0, ps=0))
    assert tokens(comm)[-2:] == [(0, Kind.GO, 1), (1, Kind.GO, 1)]
    assert coord.acks == {}


def test_a_load_on_one_worker_while_the_other_waits_in_step_fails_both():
    from mpisync.errors import DeadlockError

    coord, comm, _local, spec = coordinator(2)
    coord.start()
    pieces = [{"state": {}, "averages": {}, "param_groups": [], "global_step": 0}]
    comm.requests.append((0, (Kind.LOAD, (pieces, 0))))
    coord.poll(rare=True)
    coord.on_notice((Kind.PUSHED, 1, 0, 0, *hyper(0.1, spec.hyper.width)))
    assert tokens(comm)[-1] == (1, Kind.FAIL, 0)       # worker 1, inside step()
    info = [(dest, obj) for dest, tag, obj in comm.sent if tag == Tag.of(Tag.INFO, 0)]
    (_, reason), (_, error) = sorted(info, key=lambda x: -x[0])
    assert [d for d, _ in sorted(info)] == [0, 1]
    assert isinstance(error, DeadlockError) and str(error) == reason   # worker 0's answer
    assert ("workers [0] wait in load_state_dict() for every open worker to call it, but "
            "workers [1] wait inside step() for global step 0") in reason
    assert "call load_state_dict() on every worker at the same point" in reason
