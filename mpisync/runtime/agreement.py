"""Every rank agrees, or every rank raises the same error: the one place this is decided.

Each rank brings what it found (a problem, or what the ranks must agree on); ``agree``
gathers every rank's in rank order and hands the same list to a judge on every rank. The
judge is a pure function of that list, so every rank reaches the same verdict: all go on,
or all raise the same exception (marked ``collective``: no rank needs to abort the job for
it, and a caller that catches it may try again with every other rank).

What the ranks agree on, and the judges mpisync uses:

- ``init()``: every rank's ``MPISYNC_*`` variables (``first_problem``), the version of
  mpisync and of its wire format (``ps_ranks``);
- a worker's set-up: the model, the optimizer, the placement (``protocol/compare.py``);
- the workers' collective helpers and ``update()`` registrations: the call and the shape
  of its values (``runtime/collectives.py``);
- a checkpoint the chief writes: whether it could (``checkpoint.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from ..errors import ConfigError

__all__ = ["Judge", "agree", "first_problem"]

#: Reads every rank's contribution (in rank order) and returns the exception every rank
#: raises, or None when they agree.
Judge = Callable[[list], "BaseException | None"]


def agree(comm: MPI.Comm, mine: Any, judge: Judge) -> list:
    """Every rank's ``mine`` in rank order, once ``judge`` found nothing wrong in them.

    Collective over ``comm``: one ``allgather``, then ``judge`` on the same list on every
    rank, so that either every rank returns or every rank raises what ``judge`` returned.
    """
    gathered = comm.allgather(mine)
    failure = judge(gathered)
    if failure is not None:
        raise failure
    return gathered


def first_problem(problems: Sequence[str | None], prefix: str = "",
                  name: Callable[[int], str] | None = None) -> ConfigError | None:
    """The first rank's problem as a collective ``ConfigError`` (``prefix``, then
    ``name(rank)``, then the problem), or None when no rank found one."""
    for r, problem in enumerate(problems):
        if problem is not None:
            where = "".join(f"{part}: " for part in (prefix, name and name(r)) if part)
            return ConfigError(f"{where}{problem}", collective=True)
    return None
