"""What init() finds out about the ranks' nodes and machine: node names, the ps layout, the
ranks per machine against its cores, and the wait spin."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
from mpi_helpers import _launcher, run_mpi

from mpisync.ps_ranks import RankLayout
from mpisync.runtime.nodes import (
    check_host_map,
    decode_host_map,
    encode_host_map,
    host_load,
    node_of,
    parse_hostfile,
    parse_hosts,
    rank_nodes,
)
from mpisync.runtime.progress import SPIN_DEDICATED, SPIN_SHARED

# --- a rank's node -----------------------------------------------------------------------


def test_a_ranks_node_comes_from_the_first_source_that_names_it():
    env = {"MPISYNC_NODE": "rack1", "SLURMD_NODENAME": "n2", "MPISYNC_HOSTMAP": "a:2,b:2"}
    assert node_of(3, 4, env, "vm") == ("rack1", "MPISYNC_NODE")
    del env["MPISYNC_NODE"]
    assert node_of(3, 4, env, "vm") == ("n2", "SLURMD_NODENAME")
    del env["SLURMD_NODENAME"]
    assert node_of(1, 4, env, "vm") == ("a", "MPISYNC_HOSTMAP")
    assert node_of(2, 4, env, "vm") == ("b", "MPISYNC_HOSTMAP")
    assert node_of(2, 5, env, "vm") == ("vm", "hostname")     # a map of another job
    assert node_of(0, 1, {"MPISYNC_NODE": ""}, "vm") == ("vm", "hostname")
    with pytest.raises(ValueError, match="MPISYNC_HOSTMAP='a:x'"):
        node_of(0, 1, {"MPISYNC_HOSTMAP": "a:x"}, "vm")


def test_host_lists_and_hostfiles_in_each_flavors_syntax():
    assert parse_hosts("a:2, b") == [("a", 2), ("b", 1)]
    assert parse_hostfile("# mpich\na:2\n\nb ifhn=10.0.0.2\n", "mpich") == [("a", 2), ("b", 1)]
    assert parse_hostfile("a slots=2 max_slots=4 # two\nb\n", "openmpi") == [("a", 2),
                                                                            ("b", None)]


# What MPICH 5 (Hydra) and Open MPI 5 (PRRTE) were seen to do: `mpiexec -hosts` / `mpirun
# -H` on the nodes n1 and n2 of a two-node Slurm cluster, each rank printing its node.
@pytest.mark.parametrize(
    "hosts, size, mpich, openmpi",
    [
        ("n1:2,n2:2", 4, "n1 n1 n2 n2", "n1 n1 n2 n2"),
        ("n1:1,n2:3", 4, "n1 n2 n2 n2", "n1 n2 n2 n2"),
        ("n1,n2", 4, "n1 n2 n1 n2", "n1 n1 n2 n2"),
        ("n1:2,n2:1", 5, "n1 n1 n2 n1 n1", "n1 n1 n1 n2 n2"),
        ("n1:3,n2:3", 4, "n1 n1 n1 n2", "n1 n1 n1 n2"),
        ("n1:1,n2:2,n1:1", 4, "n1 n2 n2 n1", "n1 n1 n2 n2"),  # Hydra: outside Slurm
        ("n1:1,n2:1", 5, "n1 n2 n1 n2 n1", "n1 n1 n1 n2 n2"),
        ("n1:2,n2:3", 7, "n1 n1 n2 n2 n2 n1 n1", "n1 n1 n1 n2 n2 n2 n2"),
        ("n2:1,n1:1", 3, "n2 n1 n2", "n2 n2 n1"),
    ],
)
def test_ranks_land_where_each_mpiexec_was_seen_to_put_them(hosts, size, mpich, openmpi):
    assert rank_nodes(parse_hosts(hosts), size, "mpich") == mpich.split()
    assert rank_nodes(parse_hosts(hosts), size, "openmpi") == openmpi.split()


def test_the_host_map_travels_as_runs():
    nodes = ["a", "a", "b", "a"]
    assert encode_host_map(nodes) == "a:2,b:1,a:1"
    assert decode_host_map("a:2,b:1,a:1") == nodes


def test_mpi_contradicting_the_map_is_noticed():
    mapped = ["MPISYNC_HOSTMAP"] * 4
    assert check_host_map(["a", "a", "b", "b"], mapped, [0, 0, 2, 2]) is None
    assert check_host_map(["a", "b", "a", "b"], mapped, [0, 0, 2, 2]) == (0, 1)
    assert check_host_map(["a", "b", "a", "b"], ["hostname"] * 4, [0, 0, 0, 0]) is None
    assert check_host_map(["a", "a", "b", "a"], mapped, [0, 1, 2, 3]) is None  # one name,
    #                                                        several MPI nodes: Hydra's way


def test_the_load_counts_the_machine_not_the_node():
    machines = ["m1", "m1", "m1", "m2"]
    affinities = [[0, 1], [0, 1], [1], [0]]
    assert host_load(2, machines, affinities) == (3, 2)
    assert host_load(3, machines, affinities) == (1, 1)


# --- the ps layout -------------------------------------------------------------------------


def test_several_nodes_get_one_ps_each_first_and_rank_0_stays_the_chief():
    nodes = ["n1", "n1", "n2", "n2"]
    layout = RankLayout.choose(nodes, 2, {})                  # several nodes: per_node
    assert layout.ps_ranks == (1, 3) and layout.chief_rank == 0
    assert layout.describe(nodes) == ("n1: worker 0 (rank 0), ps 0 (rank 1)\n"
                                      "n2: worker 1 (rank 2), ps 1 (rank 3)")
    assert RankLayout.choose(nodes, 2, {"MPISYNC_PS_LAYOUT": "last"}).ps_ranks == (2, 3)
    assert RankLayout.per_node(["a", "b", "b", "b"], 2).ps_ranks == (2, 3)  # never rank 0
    assert RankLayout.per_node(["a", "b", "a", "b"], 1).ps_ranks == (3,)    # last node first
    for size in (2, 5):                                       # one node: the last ranks
        for num_ps in range(1, size):
            assert (RankLayout.choose(["vm"] * size, num_ps, {})
                    == RankLayout.per_node(["vm"] * size, num_ps)
                    == RankLayout.last(size, num_ps))


# --- several ranks -------------------------------------------------------------------------


@pytest.fixture
def no_node_names(monkeypatch):
    """No node names from outside (a Slurm job, a map): the ranks find their own."""
    for name in ("MPISYNC_NODE", "SLURMD_NODENAME", "MPISYNC_HOSTMAP", "MPISYNC_PS_LAYOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_ranks_count_cores_of_their_host_and_pick_the_spin(monkeypatch, no_node_names):
    monkeypatch.delenv("MPISYNC_POLL_SPIN_US", raising=False)
    run = run_mpi("hostinfo.py", 2, 1)
    records = sorted(run.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1, 2]
    cores = set().union(*(r["affinity"] for r in records))
    for r in records:
        assert r["local_ranks"] == 3              # one host
        assert r["local_cores"] == len(cores)
        assert r["oversubscribed"] == (3 > len(cores))
        assert r["nodes"] == [socket.gethostname()] * 3 and r["ps_ranks"] == [2]
        if not torch.cuda.is_available():         # no GPU: every rank computes on the CPU
            assert (r["device"], r["cuda_aware"]) == ("cpu", False), r
    expected = SPIN_SHARED if len(cores) < 3 else SPIN_DEDICATED
    assert [r["spin"] for r in records[:2]] == [expected, expected]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity")
def test_two_names_of_this_machine_are_two_nodes_where_mpiexec_makes_them_so(no_node_names):
    run = run_mpi("hostinfo.py", 2, 2, hosts="localhost:2,127.0.0.1:2")
    records = sorted(run.results, key=lambda r: r["rank"])
    for r in records:
        assert r["local_ranks"] == 4              # one machine, whatever the node names
    if _launcher()[1] == "openmpi":               # mpirun merges names of one machine
        assert records[0]["nodes"] == [socket.gethostname()] * 4, run.describe()
        assert "MPISYNC_HOSTMAP puts ranks 0 and 2" in run.output, run.describe()
        assert records[0]["ps_ranks"] == [2, 3]
    else:                                         # Hydra starts one proxy per name
        assert records[0]["nodes"] == ["localhost"] * 2 + ["127.0.0.1"] * 2, run.describe()
        assert records[0]["ps_ranks"] == [1, 3]   # one ps on each
        assert [r["host"] for r in records] == records[0]["nodes"]


def test_a_finalize_that_waits_on_a_peer_ends_after_the_grace():
    """mpi4py's ``MPI.Finalize`` holds the GIL while it waits, so a timer thread could
    never end it; ``finalize_within`` calls it with the GIL let go: the rank exits with
    its code after the grace, and the job with it, long before the peer would come."""
    start = time.monotonic()
    run = run_mpi("finalize_grace.py", workers=1, ps=1, timeout=50, expect_ok=False)
    assert run.returncode != 0 and time.monotonic() - start < 40, run.describe()
    assert [r["role"] for r in run.results] == ["finalizing"], run.describe()

