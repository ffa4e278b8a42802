"""The ps serve loop: a shard server per optimizer and, on ps 0, its coordinator."""
from __future__ import annotations

import signal
import sys
import time

from mpi4py import MPI

from ..errors import ConfigError, StallError
from ..native import rowthreads
from ..observe import timeline
from ..protocol.compare import versions
from ..protocol.spec import decode
from ..protocol.wire import ControlField, Kind, Tag
from ..runtime import heap, stopping
from ..runtime.progress import SETUP_TIMEOUT, STALL_WARNING, Pace, Poller, spin_seconds
from ..runtime.survival import improbe
from .coordinator import Coordinator
from .shard import ShardServer
from .steplog import StepLog

__all__ = ["Job", "serve"]


class Job:
    """One optimizer as served by one ps rank."""

    def __init__(self, cluster, spec, piece, poller: Poller, stats_log: str | None = None):
        layout = cluster.layout
        self.spec = spec
        self.comm = cluster.p2p_comm
        self.coordinator_rank = layout.coordinator_rank
        self.notice_tag = Tag.of(Tag.NOTICE, spec.opt_id)
        on_coordinator = cluster.ps_index == 0
        self.shard = ShardServer(spec, cluster.ps_index, layout.worker_ranks,
                                 layout.coordinator_rank, self.comm, poller, cluster.label,
                                 with_hyper=on_coordinator, losses=cluster.losses)
        self.shard.receive_initial(layout.chief_rank, piece)
        self.shard.timings.enabled = stats_log is not None or timeline.current is not None
        self.applied = False                # the last turn applied a step
        self.coord = None
        if on_coordinator:
            log = None if stats_log is None else StepLog(
                stats_log, opt_id=spec.opt_id, num_workers=spec.num_workers,
                num_ps=spec.num_ps, replicas_to_aggregate=spec.replicas_to_aggregate,
                asynchronous=spec.asynchronous, global_step=spec.global_step)
            self.coord = Coordinator(spec, layout.worker_ranks, layout.ps_ranks, self.comm,
                                     poller, cluster.label, self.shard.enqueue, log,
                                     cluster.losses)
            self.coord.start()
            # the last step's row updates wait until its tokens are out (all ps applied)
            self.shard.rows.may_settle = lambda: not self.coord.acks

    def turn(self, rare: bool = False) -> bool:
        """Receive, decide, apply what can be; True if anything happened.

        ``rare``: also look for the messages that do not come every step (assignments,
        requests); the loop asks for them when a turn found nothing else to do.
        """
        progressed, notices = self.shard.poll(rare)
        if self.coord is not None:
            for notice in notices:
                self.coord.on_notice(notice)
            progressed |= self.coord.poll(rare)
        queued = len(self.shard.queue)
        self.shard.moved = False
        notices = self.shard.progress()
        self.applied = bool(notices)
        for notice in notices:
            if self.coord is not None:
                self.coord.on_notice((Kind.APPLIED, notice))
            else:
                self.comm.Send([notice, MPI.BYTE], dest=self.coordinator_rank,
                               tag=self.notice_tag)
        return progressed or self.shard.moved or len(self.shard.queue) != queued

    def depart(self, w: int) -> None:
        """Worker ``w`` left the job (it closed first): it joins no collective again."""
        if self.coord is not None:
            self.coord.depart(w)

    def lose(self, w: int, host: str) -> None:
        """Worker ``w`` died (on ``host``): absent from now on, as if it had closed."""
        self.shard.lose(w)
        if self.coord is not None:
            self.coord.lose(w, host)

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
            ctl, _ = self.shard.queue[0]
            return f"waiting for gradients to apply step {int(ctl[ControlField.STEP])}"
        return "waiting for the coordinator (ps 0)"


def _setup(cluster, poller: Poller, message) -> Job | None:
    """A job from the chief's set-up message; None when the workers' set-up failed.

    The workers raise that error themselves; a worker that catches it may create the
    optimizer again, so this rank says what failed and serves on.
    """
    if message[0] == "error":
        exc_type, text = message[1]
        print(f"[mpisync] {cluster.label}: {exc_type.__name__}: setup failed on the workers: "
              f"{text} (serving on until the workers leave or set up again)",
              file=sys.stderr, flush=True)
        return None
    _, data, pieces, options = message     # options: what only the ps ranks need
    if options.get("mpisync") != versions():
        raise ConfigError(f"{cluster.label}: the workers run mpisync {options.get('mpisync')} "
                          f"and this ps rank mpisync {versions()}: every rank must run the "
                          f"same mpisync")
    try:
        spec = decode(data)
    except (AttributeError, ImportError) as exc:    # a class the ps ranks do not define
        raise ConfigError(f"{cluster.label}: cannot rebuild the workers' optimizer here: "
                          f"{exc}. Define the optimizer class where every rank runs it (at "
                          f"module level, not only in the workers' branch)") from exc
    with poller.patience(SETUP_TIMEOUT):       # the chief's initial values may take a while
        return Job(cluster, spec, pieces[cluster.ps_index], poller, options.get("stats_log"))


class _Serving:
    """What one ps rank serves: the open jobs, the finished ones, the workers still there."""

    def __init__(self, cluster, poller: Poller):
        self.cluster, self.poller = cluster, poller
        self.jobs: dict[int, Job] = {}
        self.applied = False                  # the last turn applied a step
        self.results: list[tuple[int, dict]] = []
        self.left: set[int] = set()           # workers that left the job (DONE) or died
        self.losses = cluster.losses

    @property
    def over(self) -> bool:
        return not self.jobs and len(self.left) == self.cluster.num_workers

    def turn(self) -> bool:
        """Turn every open job; when that finds nothing, look for the rare messages too."""
        if self.losses is not None and self.losses.pending:
            self._on_losses(self.losses.take())
        return self._turn_jobs(rare=False) or self._rare_turn()

    def _on_losses(self, ranks: list[int]) -> None:
        """Dead workers are absent from now on (named once, by ps 0); a dead ps ends it all."""
        cluster = self.cluster
        layout = cluster.layout
        vital = [r for r in ranks if r in layout.ps_ranks or r == layout.chief_rank]
        if vital:
            raise RuntimeError(f"{cluster.label}: {cluster.describe_lost(vital)} lost: the job "
                               f"cannot go on without its ps ranks (they hold the parameters) "
                               f"or its chief (worker 0: it sets up, evaluates and saves)")
        for rank in ranks:
            w = layout.worker_ranks.index(rank)
            self.left.add(w)
            if cluster.ps_index == 0 and not self.jobs:
                print(f"[mpisync] {cluster.label}: lost {cluster.describe_lost([rank])} "
                      f"outside training", file=sys.stderr, flush=True)
            for job in self.jobs.values():
                job.lose(w, cluster.nodes[rank])

    def _turn_jobs(self, rare: bool) -> bool:
        progressed = self.applied = False
        for opt_id, job in list(self.jobs.items()):
            progressed |= job.turn(rare)
            self.applied |= job.applied
            if job.done:
                self.results.append((opt_id, job.finish()))
                del self.jobs[opt_id]
        return progressed

    def _rare_turn(self) -> bool:
        """Set up new optimizers, note workers that left, look for requests."""
        comm, layout, progressed = self.cluster.p2p_comm, self.cluster.layout, False
        status = MPI.Status()
        msg = comm.improbe(source=layout.chief_rank, tag=Tag.SETUP)
        if msg is not None:
            job = _setup(self.cluster, self.poller, msg.recv())
            if job is not None:
                self.jobs[job.spec.opt_id] = job
            progressed = True
        msg = improbe(comm, self.losses, MPI.ANY_SOURCE, Tag.DONE, status)
        if msg is not None:
            msg.recv()
            w = layout.worker_ranks.index(status.Get_source())
            self.left.add(w)
            for job in self.jobs.values():
                job.depart(w)
            progressed = True
        return self._turn_jobs(rare=True) or progressed

    def check_idle(self, idle_s: float, warned_at: float) -> float:
        """Warn about a wait, or end it with a StallError; the next warning's time."""
        label = self.cluster.label
        if not self.jobs:
            missing = sorted(set(range(self.cluster.num_workers)) - self.left)
            what = (f"no optimizer is open, workers {missing} have not left the job "
                    f"(cluster.close() or their end) and workers {sorted(self.left)} have; every "
                    f"worker must create the same optimizers, in the same order")
            limit = max(SETUP_TIMEOUT, self.poller.timeout)
            if idle_s > limit:
                raise StallError(f"{label}: nothing for {limit:g} s (MPISYNC_SETUP_TIMEOUT): "
                                 f"{what}")
            if idle_s > warned_at:
                print(f"[mpisync] {label}: nothing arrived for {idle_s:.0f} s; {what}",
                      file=sys.stderr, flush=True)
                return warned_at + STALL_WARNING
            return warned_at
        if idle_s > self.poller.timeout:
            raise StallError(f"{label}: no message for {self.poller.timeout:g} s "
                             f"(MPISYNC_TIMEOUT); {_describe(self.jobs)}")
        if idle_s > warned_at:
            print(f"[mpisync] {label}: nothing arrived for {idle_s:.0f} s; "
                  f"{_describe(self.jobs)}", file=sys.stderr, flush=True)
            return warned_at + STALL_WARNING
        return warned_at


def serve(cluster) -> dict | list[dict]:
    """Serve every optimizer the workers set up, until every worker left the job."""
    poller = Poller(cluster.p2p_comm, cluster.timeout, cluster.label,
                    spin_seconds(cluster.oversubscribed), cluster.losses)
    timeline.start(cluster, thread="shard server")
    serving = _Serving(cluster, poller)
    last_progress, warned_at = time.monotonic(), STALL_WARNING
    between_steps = Pace()          # from a step applied to the next push arriving
    heap.keep()                     # the optimizer's temporaries: no page faults each step
    # the row kernels' threads (MPISYNC_PS_THREADS, init() checked it on every rank)
    here = sum(cluster.nodes[r] == cluster.host for r in cluster.layout.ps_ranks)
    rowthreads.start(rowthreads.threads_for(cluster.local_cores, here))
    noticed = 0.0                   # when this rank noticed a signal (0: none yet)
    flagging = stopping.install()   # SIGTERM, SIGUSR1, SIGUSR2: the workers stop, then this
    try:
        while not serving.over:
            if serving.turn():
                poller.busy()
                if serving.applied:
                    poller.expect(between_steps)     # the workers compute the next step now
                last_progress, warned_at = time.monotonic(), STALL_WARNING
                continue
            poller.idle()
            idle_s = time.monotonic() - last_progress
            if stopping.received() is not None:
                noticed = noticed or time.monotonic()
                _check_stopped(cluster.label, time.monotonic() - max(last_progress, noticed))
            warned_at = serving.check_idle(idle_s, warned_at)
    finally:
        if flagging:
            if stopping.received() is not None:     # the job stops: a second signal must
                stopping.ignore_from_now()          # not end this rank while it exits
            stopping.release()
        rowthreads.close()
        heap.release()
    stats = [s for _, s in sorted(serving.results, key=lambda r: r[0])]
    return stats[0] if len(stats) == 1 else stats


def _check_stopped(label: str, quiet_s: float) -> None:
    """After a signal, the workers stop politely (``mpisync.Checkpointer``) and leave; when
    nothing comes from them for ``MPISYNC_STALL_WARNING`` seconds since (``quiet_s``) they
    are not doing so (a program without a Checkpointer dies of the signal): end the job."""
    signum = stopping.received()
    if signum is not None and quiet_s > STALL_WARNING:
        raise RuntimeError(
            f"{label}: sent {signal.Signals(signum).name}, and nothing came from the workers "
            f"for {STALL_WARNING:g} s (MPISYNC_STALL_WARNING) since: they are not stopping "
            f"politely (only a program with an mpisync.Checkpointer does); ending the job")


def _describe(jobs: dict) -> str:
    text = "; ".join(job.describe_wait() for job in jobs.values())
    if any(job.spec.dense == "allreduce" for job in jobs.values()):
        text += (" (dense='allreduce': a worker that computes this long may wait in an "
                 "allreduce that another worker never joined: every worker must run as many "
                 "backward passes between two steps, and stop at the same step)")
    return text
