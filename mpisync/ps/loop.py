"""The ps serve loop: a shard server per optimizer and, on ps 0, its coordinator."""
from __future__ import annotations

import sys
import time

from mpi4py import MPI

from ..errors import StallError
from ..progress import SETUP_TIMEOUT, STALL_WARNING, Poller, spin_seconds
from ..spec import decode
from ..wire import Kind, Tag
from .coordinator import Coordinator
from .shard import ShardServer

__all__ = ["Job", "serve"]


class Job:
    """One optimizer as served by one ps rank."""

    def __init__(self, cluster, spec, piece, poller: Poller):
        layout = cluster.layout
        self.spec = spec
        self.comm = cluster.p2p_comm
        self.coordinator_rank = layout.coordinator_rank
        self.notice_tag = Tag.of(Tag.NOTICE, spec.opt_id)
        on_coordinator = cluster.ps_index == 0
        self.shard = ShardServer(spec, cluster.ps_index, layout.worker_ranks,
                                 layout.coordinator_rank, self.comm, poller, cluster.label,
                                 with_hyper=on_coordinator)
        self.shard.receive_initial(layout.chief_rank, piece)
        self.coord = None
        if on_coordinator:
            self.coord = Coordinator(spec, layout.worker_ranks, layout.ps_ranks, self.comm,
                                     poller, cluster.label, self.shard.enqueue)
            self.coord.start()

    def turn(self) -> bool:
        """Receive, decide, apply what can be; True if anything happened."""
        progressed, notices = self.shard.poll()
        if self.coord is not None:
            for notice in notices:
                self.coord.on_notice(notice)
            progressed |= self.coord.poll()
        queued = len(self.shard.queue)
        for notice in self.shard.progress():
            if self.coord is not None:
                self.coord.on_notice((Kind.APPLIED,))
            else:
                self.comm.Send([notice, MPI.BYTE], dest=self.coordinator_rank,
                               tag=self.notice_tag)
        return progressed or len(self.shard.queue) != queued

    @property
    def done(self) -> bool:
        return self.shard.done and (self.coord is None or self.coord.finished)

    def finish(self) -> dict:
        self.shard.finish()
        if self.coord is not None:
            self.coord.finish()
            return self.coord.stats()
        return {"global_step": self.shard.global_step}

    def describe_wait(self) -> str:
        if self.coord is not None:
            return self.coord.describe_wait()
        if self.shard.queue:
            return f"waiting for gradients to apply step {int(self.shard.queue[0][0][1])}"
        return "waiting for the coordinator (ps 0)"


def _setup(cluster, poller: Poller, message) -> Job:
    """A job from the chief's set-up message; raise its error on this rank if it sent one."""
    if message[0] == "error":
        exc_type, text = message[1]
        raise exc_type(f"{cluster.label}: setup failed: {text}", collective=True)
    _, data, pieces = message
    return Job(cluster, decode(data), pieces[cluster.ps_index], poller)


def serve(cluster) -> dict | list[dict]:
    """Serve until every optimizer the workers set up has been closed by all of them."""
    poller = Poller(cluster.p2p_comm, cluster.timeout, cluster.label,
                    spin_seconds(cluster.oversubscribed))
    chief = cluster.layout.chief_rank
    first = poller.wait_message(chief, Tag.SETUP, lambda: "the chief's model setup",
                                timeout=max(SETUP_TIMEOUT, cluster.timeout))
    job = _setup(cluster, poller, first)
    jobs = {job.spec.opt_id: job}
    results: list[tuple[int, dict]] = []
    last_progress = time.monotonic()
    next_warning = STALL_WARNING
    while jobs:
        progressed = False
        msg = cluster.p2p_comm.improbe(source=chief, tag=Tag.SETUP)
        if msg is not None:
            job = _setup(cluster, poller, msg.recv())
            jobs[job.spec.opt_id] = job
            progressed = True
        for opt_id, job in list(jobs.items()):
            progressed |= job.turn()
            if job.done:
                results.append((opt_id, job.finish()))
                del jobs[opt_id]
        if progressed:
            poller.busy()
            last_progress, next_warning = time.monotonic(), STALL_WARNING
            continue
        poller.idle()
        idle_s = time.monotonic() - last_progress
        if idle_s > poller.timeout:
            raise StallError(f"{cluster.label}: no message for {poller.timeout:g} s "
                             f"(MPISYNC_TIMEOUT); {_describe(jobs)}")
        if idle_s > next_warning:
            next_warning += STALL_WARNING
            print(f"[mpisync] {cluster.label}: nothing arrived for {idle_s:.0f} s; "
                  f"{_describe(jobs)}", file=sys.stderr, flush=True)
    stats = [s for _, s in sorted(results, key=lambda r: r[0])]
    return stats[0] if len(stats) == 1 else stats


def _describe(jobs: dict) -> str:
    return "; ".join(job.describe_wait() for job in jobs.values())
