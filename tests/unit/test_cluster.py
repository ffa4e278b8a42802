"""What init() finds out about the ranks' nodes and machine, in one process: node names,
host lists and maps, the load of a machine, the ps layout (the jobs that start ranks on
this machine: tests/mpi/test_cluster_jobs.py)."""
from __future__ import annotations

import pytest

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
