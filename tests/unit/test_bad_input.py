"""Bad input, case by case, where one process can decide it: init and the world, the
environment variables, a ps rank given a malformed message; a clear error naming what
was wrong and the rank.

The cases that need a second rank (refused on every rank, refused at step(), ending a
job) run in the jobs of tests/mpi/test_bad_input_jobs.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpisync
from mpisync import environ
from mpisync.protocol.wire import WIRE_VERSION, Kind, Tag
from mpisync.runtime import progress
from mpisync.worker import devices


# -- init and the world --------------------------------------------------------------------
def test_a_world_of_one_rank_is_refused_with_how_to_start_more():
    assert MPI.COMM_WORLD.Get_size() == 1            # pytest runs as an MPI singleton
    with pytest.raises(mpisync.WorldTooSmallError,
                       match=r"rank 0: num_ps=1 needs 1 <= num_ps < world size; found 1 MPI "
                             r"ranks .* start the job with at least 2 ranks \(mpiexec -n 2"):
        mpisync.init(abort_on_error=False)


@pytest.mark.parametrize("num_ps", [True, 1.0, 1.5])
def test_num_ps_that_is_not_an_int_is_refused(num_ps):
    with pytest.raises(TypeError, match=r"rank 0: num_ps must be an int, got "):
        mpisync.init(num_ps=num_ps, comm=MPI.COMM_SELF, abort_on_error=False)


@pytest.mark.parametrize("value", ["two", "1.5", "0", "-1", " "])
def test_an_unparsable_mpisync_num_ps_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("MPISYNC_NUM_PS", value)
    if not value.strip():            # empty: as if unset (1 ps rank: too many for 1 rank)
        with pytest.raises(mpisync.WorldTooSmallError):
            mpisync.init(comm=MPI.COMM_SELF, abort_on_error=False)
        return
    with pytest.raises(mpisync.ConfigError,
                       match=rf"rank 0: MPISYNC_NUM_PS='{re.escape(value)}' is not a number of "
                             r"ps ranks >= 1"):
        mpisync.init(comm=MPI.COMM_SELF, abort_on_error=False)


@pytest.mark.parametrize("asked, launched, expected", [
    (None, None, 1),          # neither: one ps rank
    (3, None, 3),             # no launcher's count: the argument
    (None, "2", 2),           # no argument: the launcher's count
    (2, "2", 2),              # both, equal
    (2, " ", 2),              # empty: as if unset
])
def test_num_ps_comes_from_the_argument_or_the_launcher(asked, launched, expected):
    env = {} if launched is None else {"MPISYNC_NUM_PS": launched}
    assert environ.num_ps(asked, env, 0) == expected


@pytest.mark.parametrize("asked, launched", [(1, "2"), (3, "1")])
def test_num_ps_beside_a_launcher_count_that_differs_is_refused_naming_both(asked, launched):
    # a pure function of the argument and the environment: every rank of a job gets the
    # same ones, so every rank raises alike (collective) before any message
    with pytest.raises(mpisync.ConfigError) as caught:
        environ.num_ps(asked, {"MPISYNC_NUM_PS": launched}, 3)
    assert str(caught.value) == (
        f"rank 3: init(num_ps={asked}) but MPISYNC_NUM_PS={launched}: the job was launched "
        f"for {launched} ps ranks; pass num_ps={launched} or leave it out (the launcher's "
        f"count is used), or launch with --ps {asked}")
    assert caught.value.collective


def test_init_refuses_num_ps_beside_a_launcher_count_that_differs(monkeypatch):
    monkeypatch.setenv("MPISYNC_NUM_PS", "2")
    with pytest.raises(mpisync.ConfigError, match=r"rank 0: init\(num_ps=1\) but "
                                                  r"MPISYNC_NUM_PS=2"):
        mpisync.init(num_ps=1, comm=MPI.COMM_SELF, abort_on_error=False)


def test_a_malformed_launcher_count_is_refused_even_beside_an_argument(monkeypatch):
    monkeypatch.setenv("MPISYNC_NUM_PS", "two")
    with pytest.raises(mpisync.ConfigError, match=r"MPISYNC_NUM_PS='two' is not a number"):
        environ.num_ps(1, None, 0)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_cuda_aware_that_is_not_auto_true_or_false_is_refused(value):
    with pytest.raises(mpisync.ConfigError, match=r"rank 0: cuda_aware must be 'auto', True "
                                                  r"or False, got "):
        devices.resolve_cuda_aware(value, MPI.COMM_SELF, "rank 0")


def test_a_parameter_moved_to_another_device_after_set_up_is_refused_naming_both():
    """The tracker's device check (a real move needs a GPU: tests/mpi/test_gpu.py): the
    parameter was on cuda:0 when the optimizer was built and is on the CPU now."""
    from mpisync.worker.tracking import WriteTracker
    p = torch.nn.Parameter(torch.ones(3))
    tracker = WriteTracker(["w"], [p], [p.detach()], "worker 0 (rank 0)")
    assert tracker.written() == []
    tracker.devices = [torch.device("cuda", 0)]
    p.data = p.detach().clone()          # what model.to(device) does to each parameter
    with pytest.raises(TypeError, match=r"worker 0 \(rank 0\): parameter 'w' moved from "
                                        r"cuda:0 to cpu after the SyncReplicasOptimizer was "
                                        r"created; move the model to its device"):
        tracker.written()
    tracker.release()


# -- environment variables read at import, each through the function that reads it ---------
@pytest.mark.parametrize("name", ["MPISYNC_TIMEOUT", "MPISYNC_SETUP_TIMEOUT",
                                  "MPISYNC_STALL_WARNING", "MPISYNC_POLL_MAX_SLEEP"])
@pytest.mark.parametrize("value", ["soon", "nan", "-5", "inf"])
def test_a_timeout_variable_that_is_not_seconds_is_refused(name, value):
    with pytest.raises(mpisync.ConfigError, match=rf"rank \S+: {name}='{value}' is not a "
                                                  r"number of seconds"):
        progress.timeouts({name: value})


def test_the_timeouts_are_read_as_numbers_of_seconds():
    assert progress.timeouts({"MPISYNC_TIMEOUT": "2.5", "MPISYNC_POLL_MAX_SLEEP": "0"}) == (
        2.5, 3600.0, 60.0, 0.0)


@pytest.mark.parametrize("name, value, check", [
    ("MPISYNC_POLL_SPIN_US", "fast", lambda: progress.spin_seconds(True)),
    ("MPISYNC_TIMELINE_MAX_MB", "-1", lambda: environ.number(
        "MPISYNC_TIMELINE_MAX_MB", 0, inclusive=True, what="MiB (0: no limit)")),
    ("MPISYNC_PROGRESS", "sometimes", lambda: mpisync.observe.watch._env_setting(100, True)),
    ("MPISYNC_ROW_KERNELS", "false", lambda: mpisync.native.rowslib._build()),
    ("MPISYNC_BULK", "yes", lambda: mpisync.native.bulk._build()),
])
def test_other_variables_refuse_what_they_cannot_read(monkeypatch, name, value, check):
    monkeypatch.setenv(name, value)
    with pytest.raises(mpisync.ConfigError, match=rf"rank \S+: {name}='{value}' is not "):
        check()


def test_a_bad_variable_stops_the_import_with_its_name_not_a_traceback_deep_inside():
    # ``import mpisync`` alone imports nothing: the package is imported, and the variables
    # read, at the first use of a public name
    proc = subprocess.run([sys.executable, "-c", "import mpisync; mpisync.init"], check=False,
                          capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, MPISYNC_TIMEOUT="30s"))
    assert proc.returncode != 0
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "mpisync.errors.ConfigError: rank 0: MPISYNC_TIMEOUT='30s' is not a number of seconds "
        "> 0; set it to a number of seconds > 0 or unset it"), proc.stderr


# -- the ps side ---------------------------------------------------------------------------
def _server():
    """A shard server for worker 0 on a private COMM_SELF: it receives what rank 0 sends."""
    from mpisync.protocol.spec import Model, Options, build_spec
    from mpisync.ps.shard import ShardServer
    from mpisync.runtime.progress import Poller

    net = torch.nn.Linear(3, 2)
    spec, _ = build_spec(torch.optim.SGD(net.parameters(), lr=0.1),
                         Model(tuple(net.named_parameters())), Options(shared_memory=False),
                         opt_id=0, num_workers=1, num_ps=1)
    comm = MPI.COMM_SELF.Dup()
    return ShardServer(spec, 0, (0,), 0, comm, Poller(comm, 5, "ps 0"), "ps 0",
                       with_hyper=True), comm


@pytest.mark.parametrize("delta, kind, match", [
    (-8, 1, r"worker 0 sent kind 1 with \d+ bytes, expected a gradient header of \d+"),
    (0, 99, r"worker 0 sent kind 99 with \d+ bytes, expected a gradient"),
    (8, 1, r"worker 0 sent a message larger than a gradient header of \d+ bytes"),
])
def test_a_ps_rank_refuses_a_message_of_the_wrong_size_or_kind(delta, kind, match):
    server, comm = _server()
    try:
        msg = np.zeros(server.header.nbytes + delta, np.uint8)
        msg[:8].view(np.int64)[0] = kind
        comm.Send([msg, MPI.BYTE], dest=0, tag=Tag.of(Tag.GRAD, 0))
        with pytest.raises(mpisync.ProtocolError, match=match):
            server.poll()
    finally:
        comm.Free()


def test_a_ps_rank_refuses_a_bucket_larger_than_the_bucket():
    """A push's header, then its bucket in a message 8 bytes too long: never written past
    the bucket's buffer, a ProtocolError naming the worker and the bucket."""
    server, comm = _server()
    try:
        head = np.zeros(server.header.nbytes, np.uint8)
        fields, words, codes, _ = server.header.views(head)
        fields[0], fields[1] = Kind.GRAD, 0
        server.spec.hyper.encode(server.optimizer.param_groups, words, codes)
        comm.Send([head, MPI.BYTE], dest=0, tag=Tag.of(Tag.GRAD, 0))
        data = np.zeros(server.wbuckets[0].nbytes + 8, np.uint8)
        comm.Send([data, MPI.BYTE], dest=0, tag=Tag.of(Tag.DATA, 0))
        with pytest.raises(mpisync.ProtocolError,
                           match=r"worker 0 sent bucket 0 of a push in a message larger than "
                                 r"the bucket"):
            for _ in range(100):
                server.poll()
                server.progress()
    finally:
        comm.Free()


def test_a_ps_rank_refuses_a_set_up_from_another_mpisync():
    from mpisync.ps.loop import _setup
    from mpisync.runtime.progress import Poller

    class Rank:
        label = "ps 0 (rank 1 on here)"

    with pytest.raises(mpisync.ConfigError, match=rf"ps 0 \(rank 1 on here\): the workers run "
                                                  rf"mpisync 0\.0\.1 \(wire format {WIRE_VERSION}\) "
                                                  rf"and this ps rank mpisync \S+ \(wire format "
                                                  rf"{WIRE_VERSION}\)"):
        _setup(Rank(), Poller(None, 5, "ps 0"),
               ("spec", b"", [None], {"mpisync": f"0.0.1 (wire format {WIRE_VERSION})"}))
