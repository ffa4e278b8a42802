"""Which node each rank runs on: host lists, hostfiles, and the launcher's map of ranks.

Pure functions over names and counts (no MPI). The launcher uses them to tell the ranks
which host ``mpiexec`` puts each of them on; ``mpisync.init()`` uses them to name every
rank's node, from (first found): ``MPISYNC_NODE``, Slurm's ``SLURMD_NODENAME``, the
launcher's ``MPISYNC_HOSTMAP``, the host name. Two Slurm nodes, or two names given to
``--hosts``, on one machine are then two nodes, as they are to the MPI launcher.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from itertools import groupby

__all__ = [
    "HOSTMAP_ENV",
    "NODE_ENV",
    "SLURM_NODE_ENV",
    "check_host_map",
    "cpu_affinity",
    "decode_host_map",
    "encode_host_map",
    "host_load",
    "machine_id",
    "node_of",
    "parse_hostfile",
    "parse_hosts",
    "rank_nodes",
]

#: Names this rank's node, whatever else is known (set it per rank, e.g. in a wrapper).
NODE_ENV = "MPISYNC_NODE"
#: The node Slurm runs the task on (srun, and MPI launchers inside an allocation).
SLURM_NODE_ENV = "SLURMD_NODENAME"
#: The launcher's map: the node of each rank in rank order, as runs (``a:2,b:2``).
HOSTMAP_ENV = "MPISYNC_HOSTMAP"

#: The flavours whose mapping of ranks to hosts ``rank_nodes`` knows (checked by running
#: their ``mpiexec``: MPICH 5's Hydra and Open MPI 5's PRRTE).
MAPPED_FLAVORS = ("mpich", "openmpi")


def _positive(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{what}: expected a count >= 1, got {text!r}")
    return int(text)


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` as ``[("a", 2), ("b", 2)]``; a host without ``:N`` counts 1.

    That is what both ``mpiexec -hosts`` (MPICH) and ``mpirun -H`` (Open MPI) make of a
    host without a count.

    Raises:
        ValueError: an empty host name or a count that is not a positive integer.
    """
    entries = []
    for item in text.split(","):
        name, sep, count = item.strip().partition(":")
        if not name:
            raise ValueError(f"empty host name in {text!r}; write a:2,b:2 or a,b")
        entries.append((name, _positive(count, f"host {name!r} in {text!r}") if sep else 1))
    return entries


def parse_hostfile(text: str, flavor: str) -> list[tuple[str, int | None]]:
    """The hosts of a hostfile and their slots, read as ``flavor``'s ``mpiexec`` reads it.

    MPICH (Hydra): a line is ``host`` or ``host:N`` (1 slot without a count), lines
    starting with ``#`` are comments. Open MPI: ``host slots=N``, ``#`` starts a comment;
    without ``slots=`` the host offers as many slots as it has cores, which only
    ``mpirun`` learns: the count is then None.

    Raises:
        ValueError: a line in the other flavour's syntax (which that ``mpiexec`` refuses
            or misreads), or a bad count; the message names the line.
    """
    entries: list[tuple[str, int | None]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if flavor == "openmpi":
            line = line.split("#", 1)[0]
        tokens = line.split()
        if not tokens or tokens[0].startswith("#"):
            continue
        where = f"hostfile line {lineno} ({line.strip()!r})"
        host, options = tokens[0], dict(t.partition("=")[::2] for t in tokens[1:])
        if flavor == "openmpi":
            if ":" in host:
                raise ValueError(f"{where}: Open MPI's hostfiles write 'host slots=N', "
                                 f"not host:N")
            slots = options.get("slots")
            entries.append((host, None if slots is None else _positive(slots, where)))
        else:
            if "slots" in options:
                raise ValueError(f"{where}: MPICH's hostfiles write 'host:N', not slots=N")
            name, sep, count = host.partition(":")
            entries.append((name, _positive(count, where) if sep else 1))
    if not entries:
        raise ValueError("the hostfile names no host")
    return entries


def rank_nodes(hosts: Sequence[tuple[str, int | None]], size: int,
               flavor: str) -> list[str] | None:
    """The host of each of ``size`` ranks, as ``flavor``'s ``mpiexec`` places them.

    MPICH's Hydra goes round the host list, ``N`` ranks on a ``host:N`` at a time, as
    often as it takes (``a:2,b:1`` and 5 ranks: a a b a a; ``a,b``: a b a b). Open MPI
    first merges the entries of one host, then fills each host's slots in turn; ranks
    beyond all slots (``--oversubscribe``) are shared out evenly, one more to each of the
    first hosts while the remainder lasts (``a:1,b:1`` and 5 ranks: a a a b b).

    Returns:
        One host name per rank, or None where the placement is not known here: another
        flavour (Intel MPI places by cores per host), or a host whose slots only
        ``mpiexec`` knows (an Open MPI hostfile line without ``slots=``).
    """
    if flavor not in MAPPED_FLAVORS or not hosts or any(n is None for _, n in hosts):
        return None
    if flavor == "mpich":
        cycle = [name for name, count in hosts for _ in range(count)]
        return [cycle[rank % len(cycle)] for rank in range(size)]
    merged: dict[str, int] = {}
    for name, count in hosts:
        merged[name] = merged.get(name, 0) + count
    extra, remainder = divmod(max(size - sum(merged.values()), 0), len(merged))
    nodes: list[str] = []
    for i, (name, count) in enumerate(merged.items()):
        nodes += [name] * (count + extra + (i < remainder))
    return nodes[:size]


def encode_host_map(nodes: Sequence[str]) -> str:
    """The node of each rank as runs in rank order: ``["a", "a", "b"]`` is ``a:2,b:1``."""
    return ",".join(f"{name}:{len(list(run))}" for name, run in groupby(nodes))


def decode_host_map(text: str) -> list[str]:
    """The inverse of ``encode_host_map``. Raises ValueError on a malformed map."""
    try:
        return [name for name, count in parse_hosts(text) for _ in range(count)]
    except ValueError as exc:
        raise ValueError(f"{HOSTMAP_ENV}={text!r}: {exc}") from None


def node_of(rank: int, size: int, environ: Mapping[str, str],
            hostname: str) -> tuple[str, str]:
    """The node of world rank ``rank`` of ``size``, and where the name came from.

    In order: ``MPISYNC_NODE``; ``SLURMD_NODENAME`` (set by Slurm in each task, also under
    ``mpiexec``/``mpirun`` inside an allocation); the launcher's ``MPISYNC_HOSTMAP`` when it
    maps ``size`` ranks (a map of another job is ignored); else ``hostname``.

    Returns:
        ``(node, source)``, the source being the variable's name or ``"hostname"``.

    Raises:
        ValueError: a malformed ``MPISYNC_HOSTMAP``.
    """
    for name in (NODE_ENV, SLURM_NODE_ENV):
        if environ.get(name):
            return environ[name], name
    if environ.get(HOSTMAP_ENV):
        nodes = decode_host_map(environ[HOSTMAP_ENV])
        if len(nodes) == size:
            return nodes[rank], HOSTMAP_ENV
    return hostname, "hostname"


def check_host_map(nodes: Sequence[str], sources: Sequence[str],
                   shared_groups: Sequence[int]) -> tuple[int, int] | None:
    """Whether MPI agrees with the launcher's map: the first two ranks it contradicts.

    ``shared_groups[r]`` identifies rank ``r``'s shared-memory domain as MPI sees it (its
    node to the MPI launcher). Two ranks named from the map that MPI places on one node
    under two different names show that ``mpiexec`` placed them otherwise than the map
    assumed (a mapping policy set elsewhere, or Open MPI merging names of one machine).

    Returns:
        None when nothing contradicts the map, else the two ranks.
    """
    first: dict[int, int] = {}
    for rank, (node, source, group) in enumerate(zip(nodes, sources, shared_groups)):
        if source != HOSTMAP_ENV:
            continue
        other = first.setdefault(group, rank)
        if nodes[other] != node:
            return other, rank
    return None


def machine_id() -> str:
    """Names the machine (the running kernel), whatever its Slurm node or host names."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def host_load(rank: int, machines: Sequence[str],
              affinities: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(ranks on rank ``rank``'s machine, cores those ranks may run on together)."""
    mine = [r for r, m in enumerate(machines) if m == machines[rank]]
    return len(mine), len(set().union(*(affinities[r] for r in mine)))


def cpu_affinity() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
