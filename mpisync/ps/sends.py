"""A ps rank's parameter sends: per worker, a persistent send of each bucket and the header."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..protocol.wire import PARAM_HEADER_BYTES, Bucket
from ..runtime import shm
from ..runtime.progress import Poller
from ..runtime.survival import Losses, settle

__all__ = ["ParameterSends"]


class ParameterSends:
    """Per worker, a persistent send of each bucket's parameters, then the header (a
    worker of this machine copies them from shared memory: ``shm.Publication``).

    A send is started again only once its last start is done; a bucket's parameters are
    converted to the wire's dtypes (``to_wire``) only once its last sends are done, as
    they are the send buffer. Workers in ``lost`` (the server's set, shared) get nothing.
    """

    def __init__(self, comm: MPI.Comm, worker_ranks: tuple[int, ...], tag: int,
                 send_buf: np.ndarray, wbuckets: tuple[Bucket, ...], to_wire: list,
                 segment, shared: dict, poller: Poller, losses: Losses | None,
                 lost: set[int]):
        self.poller, self.losses, self.lost = poller, losses, lost
        self.to_wire = to_wire
        pb, base = send_buf, PARAM_HEADER_BYTES
        flags = {w: segment.flags(i) for w, i in shared.items()}
        self.bucket_sends = [
            [shm.Publication(*flags[w], b.index) if w in flags else
             comm.Send_init([pb[base + b.offset:base + b.offset + b.nbytes], MPI.BYTE],
                            dest=r, tag=tag) for w, r in enumerate(worker_ranks)]
            for b in wbuckets]
        self.head_sends = [shm.Nothing() if w in flags else
                           comm.Send_init([pb[:base], MPI.BYTE], dest=r, tag=tag)
                           for w, r in enumerate(worker_ranks)]
        self.active: dict[int, MPI.Request] = {}     # id -> a send in flight

    def bucket(self, k: int, workers) -> None:
        """Bucket ``k``'s parameters to ``workers`` (on the wire's dtypes first)."""
        if self.to_wire[k]:
            self.wait(self.bucket_sends[k])
            for dst, src in self.to_wire[k]:
                dst.copy_(src)
        for w in workers:
            if w not in self.lost:
                self._start(self.bucket_sends[k][w])

    def heads(self, workers) -> None:
        """The header (version) to ``workers``: it ends what they get of a step."""
        for w in workers:
            if w not in self.lost:
                self._start(self.head_sends[w])

    def _start(self, req: MPI.Request) -> None:
        if id(req) in self.active:
            self.wait([req])
        req.Start()
        self.active[id(req)] = req

    def wait_bucket(self, k: int) -> None:
        """Bucket ``k``'s sends still in flight are done (its parameters may change)."""
        self.wait(self.bucket_sends[k])

    def wait_heads(self) -> None:
        """The header's sends still in flight are done (the version may change)."""
        self.wait(self.head_sends)

    def wait_all(self) -> None:
        """Every send still in flight is done."""
        self.wait(list(self.active.values()))

    def wait(self, reqs) -> None:
        """The sends among ``reqs`` still in flight are done (their buffer may change)."""
        active = [r for r in reqs if id(r) in self.active]
        if not active:
            return
        mpi = [r for r in active if isinstance(r, MPI.Request)]
        if self.losses is None:
            if mpi:
                self.poller.wait_all(mpi, lambda: "parameter sends to workers")
        else:
            for req in mpi:         # one by one: a send to a worker that died fails
                try:
                    self.poller.wait_all([req], lambda: "parameter sends to workers")
                except MPI.Exception as exc:
                    if not self.losses.note(exc):
                        raise
        if len(mpi) < len(active):
            shared = [r for r in active if not isinstance(r, MPI.Request)]
            self.poller.wait_until(lambda: all(r.Test() for r in shared),
                                   lambda: "workers copying parameters from shared memory")
        for r in active:
            del self.active[id(r)]

    def lose(self, w: int) -> None:
        """Worker ``w`` died: its sends are forgotten, cancelled where pending."""
        sends = [self.head_sends[w], *(b[w] for b in self.bucket_sends)]
        for req in sends:
            self.active.pop(id(req), None)
        settle([r for r in sends if isinstance(r, MPI.Request)], self.losses)

    def requests(self) -> list[MPI.Prequest]:
        """Every persistent send over MPI (to free them at the end)."""
        reqs = [r for sends in self.bucket_sends for r in sends if isinstance(r, MPI.Request)]
        return reqs + [r for r in self.head_sends if isinstance(r, MPI.Request)]
