"""Which rank does what, and where: the rank layout, the split into roles, each rank's node.

``RankLayout`` is a pure function of the ranks' nodes and the number of ps ranks (every
rank computes it alike, with no messages); ``comm_split`` and ``locate`` are collective
over the communicator they are given, which ``mpisync.init()`` passes in.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpi4py import MPI

from .. import environ as env
from .nodes import HOSTMAP_ENV, check_host_map, cpu_affinity, host_load, machine_id, node_of

__all__ = ["LAYOUTS", "Placement", "RankLayout", "comm_split", "locate"]

#: Ways to pick the ps ranks (``MPISYNC_PS_LAYOUT``, whose registry entry lists them).
#: Without it: ``per_node`` when the ranks span several nodes, else ``last`` (on one node
#: the two are the same).
LAYOUTS = env.VARIABLES["MPISYNC_PS_LAYOUT"].choices


@dataclass(frozen=True)
class RankLayout:
    """Which world ranks are workers and which are ps ranks, built once.

    Workers are numbered by rank (worker 0, the chief, is the lowest worker rank); ps
    ranks likewise, and ps 0 is the coordinator, which runs the token barrier.
    """

    worker_ranks: tuple[int, ...]
    ps_ranks: tuple[int, ...]

    @staticmethod
    def last(size: int, num_ps: int) -> RankLayout:
        """The last ``num_ps`` ranks serve; the others are workers (rank 0 the chief)."""
        return RankLayout(tuple(range(size - num_ps)), tuple(range(size - num_ps, size)))

    @staticmethod
    def per_node(hosts: Sequence[str], num_ps: int) -> RankLayout:
        """One ps per node first: each node's highest rank in turn, the last node first.

        ``hosts[r]`` names the node of rank ``r``; nodes are ordered by their lowest rank
        and taken from the last one back. With more ps ranks than nodes the choice goes
        round again (each node's next-highest rank). Rank 0 is never taken: it stays
        worker 0, the chief. On one node this is ``last``.
        """
        if not 1 <= num_ps < len(hosts):
            raise ValueError(f"num_ps={num_ps} needs 1 <= num_ps < {len(hosts)} ranks")
        nodes: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            nodes.setdefault(host, []).append(rank)
        stacks = [[r for r in ranks if r] for ranks in reversed(nodes.values())]
        chosen: list[int] = []
        while len(chosen) < num_ps:
            for stack in stacks:
                if stack and len(chosen) < num_ps:
                    chosen.append(stack.pop())
        ps = tuple(sorted(chosen))
        return RankLayout(tuple(r for r in range(len(hosts)) if r not in ps), ps)

    @staticmethod
    def choose(hosts: Sequence[str], num_ps: int, environ: Mapping[str, str]) -> RankLayout:
        """The layout ``MPISYNC_PS_LAYOUT`` asks for (``last`` or ``per_node``).

        Without it: ``per_node`` when ``hosts`` name more than one node, else ``last``.

        Raises:
            ConfigError: another value (a ``ValueError``), naming it and this rank.
        """
        default = "per_node" if len(set(hosts)) > 1 else "last"
        how = env.choice("MPISYNC_PS_LAYOUT", environ) or default
        if how == "per_node":
            return RankLayout.per_node(hosts, num_ps)
        return RankLayout.last(len(hosts), num_ps)

    def describe(self, hosts: Sequence[str]) -> str:
        """The roles on each node, one line a node (``hosts[r]``: the node of rank ``r``).

        ``n2: worker 1 (rank 2), ps 1 (rank 3)``; nodes in the order of their lowest rank.
        """
        nodes: dict[str, list[str]] = {}
        for rank, host in enumerate(hosts):
            role, index = self.role(rank)
            nodes.setdefault(host, []).append(f"{role} {index} (rank {rank})")
        return "\n".join(f"{host}: {', '.join(roles)}" for host, roles in nodes.items())

    @property
    def num_workers(self) -> int:
        """The number of worker ranks."""
        return len(self.worker_ranks)

    @property
    def num_ps(self) -> int:
        """The number of ps ranks."""
        return len(self.ps_ranks)

    @property
    def chief_rank(self) -> int:
        """The world rank of worker 0, the chief (it logs, evaluates, writes checkpoints)."""
        return self.worker_ranks[0]

    @property
    def coordinator_rank(self) -> int:
        """The rank that runs the token barrier: ps 0, always in its serve loop."""
        return self.ps_ranks[0]

    def role(self, rank: int) -> tuple[str, int]:
        """``("worker", index)`` or ``("ps", index)`` of world rank ``rank``."""
        if rank in self.ps_ranks:
            return "ps", self.ps_ranks.index(rank)
        return "worker", self.worker_ranks.index(rank)


def comm_split(comm: MPI.Comm, layout: RankLayout) -> tuple[MPI.Comm, MPI.Comm]:
    """Split ``comm`` into (worker_comm, ps_comm) by role, each ordered by index.

    Call on every rank of ``comm``. On a worker the ps communicator is ``MPI.COMM_NULL``
    and on a ps rank the worker communicator is; the caller frees what it gets.
    """
    role, index = layout.role(comm.Get_rank())
    part = comm.Split(1 if role == "ps" else 0, index)
    if role == "ps":
        return MPI.COMM_NULL, part
    return part, MPI.COMM_NULL


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a communicator run, found out once by ``locate``.

    ``nodes[r]`` is rank ``r``'s node (see ``node_of``); ``local_ranks`` and
    ``local_cores`` count this rank's machine (the running kernel, however many Slurm
    nodes or host names it has): its ranks, and the cores they may run on together.
    """

    nodes: tuple[str, ...]
    local_ranks: int
    local_cores: int
    note: str = ""


def locate(comm: MPI.Comm, environ: Mapping[str, str] | None = None) -> Placement:
    """Name every rank's node and count this machine's load. Call on every rank of ``comm``.

    A node named by the launcher's map (``MPISYNC_HOSTMAP``) is checked against MPI's own
    idea of the node (its shared-memory domain): if MPI contradicts the map, every rank
    uses its host name instead, and ``note`` says why.
    """
    environ = os.environ if environ is None else environ
    hostname = socket.gethostname()
    node, source = node_of(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), environ,
                           hostname)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        group = local.bcast(comm.Get_rank(), root=0)    # the domain's lowest rank names it
    finally:
        local.Free()
    ranks = comm.allgather((node, source, hostname, group, machine_id(), cpu_affinity()))
    nodes, sources, hostnames, groups, machines, affinities = zip(*ranks)
    note = ""
    contradicted = check_host_map(nodes, sources, groups)
    if contradicted is not None:
        a, b = contradicted
        note = (f"{HOSTMAP_ENV} puts ranks {a} and {b} on {nodes[a]} and {nodes[b]}, but MPI "
                f"runs them on one node: mpiexec placed the ranks otherwise; using host "
                f"names")
        nodes = tuple(h if s == HOSTMAP_ENV else n
                      for n, s, h in zip(nodes, sources, hostnames))
    local_ranks, local_cores = host_load(comm.Get_rank(), machines, affinities)
    return Placement(tuple(nodes), local_ranks, local_cores, note)
