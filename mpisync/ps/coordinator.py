"""The coordinator on ps 0: the step decisions of ``accumulate`` turned into messages."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..accumulate import Action, StepCoordinator
from ..errors import ConfigError, DeadlockError, ProtocolError
from ..observe import timeline
from ..protocol.spec import JobSpec
from ..protocol.updates import problem as update_problem
from ..protocol.wire import (
    FLAG_SCHEDULED,
    NOTICE_SKIPPED,
    NOTICE_WORDS,
    TOKEN_STATS,
    TOKEN_WORDS,
    Control,
    HyperField,
    Kind,
    NoticeField,
    Tag,
    TokenField,
    hyper_views,
    hyper_words,
    still_question,
)
from ..runtime.progress import Poller
from ..runtime.survival import Losses, improbe
from .steplog import StepLog

__all__ = ["Coordinator"]


class Coordinator:
    """Decides which gradients each step takes and hands out the tokens.

    It hears of every push and close from the shard server on its own rank (every
    worker pushes to every ps, so ps 0 sees every push), of applied steps from every ps,
    and of requests from the workers. Its decisions go to every shard server as control
    messages in one order (to its own through ``local``, a queue it never waits on) and
    to the workers as tokens. A step's hyper-parameters travel in its DECIDE: those of
    the lowest-index worker taken; in asynchronous mode, when that worker's schedule
    follows the global step and its gradient is applied at a later step than it saw,
    the worker is asked for the values at the step of application first.

    With ``log`` (the statistics log) it records every push, decision and apply there,
    and its tokens ask the workers for their step timings; with the timeline on, its
    decisions and drops are instant events on a track of their own.
    """

    def __init__(self, spec: JobSpec, worker_ranks: tuple[int, ...],
                 ps_ranks: tuple[int, ...], comm: MPI.Comm, poller: Poller, label: str,
                 local: Callable[[np.ndarray, object], None], log: StepLog | None = None,
                 losses: Losses | None = None):
        self.spec = spec
        self.losses = losses
        self.lost: dict[int, dict] = {}     # dead workers: rank, host, last step
        self.skipped: list[int] = []        # steps whose gradient was not finite
        self.worker_ranks = worker_ranks
        self.ps_ranks = ps_ranks
        self.comm = comm
        self.poller = poller
        self.label = label
        self.local = local
        self.W = spec.num_workers
        self.steps = StepCoordinator(self.W, spec.replicas_to_aggregate, spec.num_tokens,
                                     spec.global_step, spec.asynchronous, spec.max_staleness)
        self.control = Control(self.W, spec.hyper.width)
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.TOKEN, Tag.CTL, Tag.CTL_OBJ,
                                                           Tag.NOTICE, Tag.REQ, Tag.INFO,
                                                           Tag.HYPER)}
        self.notice_bufs = [np.zeros(NOTICE_WORDS, np.int64) for _ in ps_ranks[1:]]
        self.notice_reqs = [comm.Recv_init([buf, MPI.BYTE], source=r, tag=self.tags[Tag.NOTICE])
                            for buf, r in zip(self.notice_bufs, ps_ranks[1:])]
        for req in self.notice_reqs:
            req.Start()
        self.token_buf = np.zeros(TOKEN_WORDS, np.int64)
        self.log = log
        self.observed = log is not None or timeline.current is not None
        if log is not None:
            self.token_buf[TokenField.FLAGS] = TOKEN_STATS      # workers: send your step timings
        if timeline.current is not None:
            timeline.current.name_thread(1, "coordinator")
        width = spec.hyper.width
        self.hyper = [(np.zeros(width, np.int64), np.zeros(width, np.uint8))
                      for _ in range(self.W)]
        self.pushed_at = [0] * self.W       # the step each worker's last gradient was computed at
        self.pushes = [0] * self.W          # gradients each worker pushed so far
        self.scheduled = [False] * self.W   # its schedule follows the global step
        self.hyper_buf = np.zeros(hyper_words(width), np.int64)
        self.hyper_req = None               # async: waiting for a worker's hyper-parameters
        self.parked: Action | None = None   # ... for this DECIDE
        self.acks: dict[int, int] = {}      # step -> ps ranks that applied it
        self.decided: tuple[int, ...] = ()
        self.decided_step: int | None = None
        self.deferred: list[tuple[int, tuple]] = []
        self.load_pieces = None
        self.load_kind = Kind.LOAD          # or UPDATE: what the workers asked to load
        self.handlers = {Kind.DECIDE: self._decide, Kind.GO: self._go, Kind.REPLY: self._reply,
                         Kind.GRANT: self._grant, Kind.STOP: self._stop,
                         Kind.LOAD: self._load, Kind.SHUTDOWN: self._shutdown,
                         Kind.FAIL: self._fail}
        self.finished = False
        self.final_sends: list = []
        self.suspect: Action | None = None  # a deadlock the parked workers must confirm
        self.question = 0                   # the number of the last "still?" asked
        self.unconfirmed: set[int] = set()

    # -- events ---------------------------------------------------------------------------
    def start(self) -> None:
        self._emit(self.steps.start())

    def on_notice(self, notice: tuple) -> None:
        """A notice from a shard server: ``(PUSHED, worker, step, flags, hyper words, codes
        [, timing])`` or ``(CLOSED, worker, step[, timing])`` from the own rank, ``(APPLIED,
        NoticeField words)`` from any ps."""
        kind, *args = notice
        if kind == Kind.PUSHED:
            self._on_pushed(*args)
        elif kind == Kind.CLOSED:
            self._on_closed(*args)
        elif kind == Kind.APPLIED:
            self._on_applied(*args)
        else:
            raise ProtocolError(f"{self.label}: unknown notice {kind}")

    def _on_pushed(self, w: int, step: int, flags: int, words, codes, timing=None) -> None:
        """Worker ``w`` pushed a gradient computed at ``step``, with its hyper-parameters."""
        held_words, held_codes = self.hyper[w]
        held_words[:] = words
        held_codes[:] = codes
        self.pushed_at[w] = step
        self.pushes[w] += 1
        self.scheduled[w] = bool(flags & FLAG_SCHEDULED)
        if self.observed:
            self._observe_push(w, step, timing)
        else:
            self._emit(self.steps.push(w, step))

    def _on_closed(self, w: int, step: int, timing=None) -> None:
        """Worker ``w`` closed at ``step``."""
        if self.log is not None:
            self.log.closed(w, timing)
        self._emit(self.steps.close(w))

    def poll(self, rare: bool = False) -> bool:
        """APPLIED notices from the other ps ranks, awaited hyper-parameters, and with
        ``rare`` the workers' requests."""
        progressed = False
        for buf, req in zip(self.notice_bufs, self.notice_reqs):
            if req.Test():
                notice = (int(buf[NoticeField.KIND]), buf.copy())
                req.Start()
                self.on_notice(notice)
                progressed = True
        if rare:
            status = MPI.Status()
            msg = improbe(self.comm, self.losses, MPI.ANY_SOURCE, self.tags[Tag.REQ], status)
            if msg is not None:
                self._on_request(self.worker_ranks.index(status.Get_source()), msg.recv())
                progressed = True
        if self.hyper_req is not None and self.hyper_req.Test():
            self.hyper_req = None
            self._on_hyper()
            progressed = True
        return progressed

    def _observe_push(self, w: int, step: int, timing) -> None:
        """A push, recorded in the statistics log and the timeline (whether it was dropped)."""
        dropped = self.steps.dropped_total[w]
        actions = self.steps.push(w, step)
        dropped = self.steps.dropped_total[w] > dropped
        now = time.perf_counter()
        if self.log is not None:
            self.log.pushed(w, step, dropped, timing, now)
        if dropped and timeline.current is not None:
            timeline.current.instant("drop", now, {"worker": w, "computed_at": step}, tid=1)
        self._emit(actions)

    def _on_applied(self, words) -> None:
        """A ps rank applied a step: in strict sync possibly before it was decided here."""
        step = int(words[NoticeField.STEP])
        if words[NoticeField.FLAGS] & NOTICE_SKIPPED and int(words[NoticeField.SENDER]) == 0:
            self.skipped.append(step)
        if self.log is not None:
            self.log.applied(words)
        self.acks[step] = self.acks.get(step, 0) + 1
        self._check_applied()

    def _check_applied(self) -> None:
        """Every ps applied the step decided: the tokens."""
        step = self.decided_step
        if step is None or self.acks.get(step, 0) < len(self.ps_ranks):
            return
        del self.acks[step]
        self.decided_step = None
        if self.log is not None:
            self.log.step_applied(time.perf_counter())
        self._emit(self.steps.applied(self.decided))
        if self.log is not None:
            self.log.write_ready()       # after the tokens: off the step's critical path
        deferred, self.deferred = self.deferred, []
        for w, req in deferred:
            self._on_request(w, req)

    # -- decisions into messages ----------------------------------------------------------
    def _emit(self, actions: list[Action]) -> None:
        for a in actions:
            self.handlers[a.kind](a)

    def _to_shards(self, msg: np.ndarray, obj_for=None) -> None:
        """One control message to every shard server, in order (payload per ps optional)."""
        for j, rank in enumerate(self.ps_ranks):
            obj = None if obj_for is None else obj_for[j]
            if j == 0:
                self.local(msg, obj)
                continue
            self.comm.Send([msg, MPI.BYTE], dest=rank, tag=self.tags[Tag.CTL])
            if obj_for is not None:
                self.comm.send(obj, dest=rank, tag=self.tags[Tag.CTL_OBJ])

    def _token(self, kind: int, step: int, workers, arg: int = 0) -> None:
        tok = self.token_buf
        tok[TokenField.KIND], tok[TokenField.STEP], tok[TokenField.ARG] = kind, step, arg
        for w in workers:
            if w in self.lost:
                continue
            try:
                self.comm.Send([tok, MPI.BYTE], dest=self.worker_ranks[w],
                               tag=self.tags[Tag.TOKEN])
            except MPI.Exception as exc:     # it died: the loop hears of it next
                if self.losses is None or not self.losses.note(exc):
                    raise

    def depart(self, w: int) -> None:
        """Worker ``w`` left the job (its program ended): no collective can wait for it."""
        self._emit(self.steps.depart(w))

    def lose(self, w: int, host: str) -> None:
        """Worker ``w`` died on ``host``: named once, absent from every step from now on
        (as if it had closed); the job ends when the others cannot complete a step."""
        steps, rank = self.steps, self.worker_ranks[w]
        last = self.pushed_at[w] if self.pushes[w] else None
        self.lost[w] = {"worker": w, "rank": rank, "host": host, "last_step": last,
                        "noticed_at": time.time()}
        if w in steps.closed:            # it had finished training
            return
        alive = self.W - len(self.lost)
        need = 1 if self.spec.asynchronous else min(self.W, self.spec.replicas_to_aggregate)
        print(f"[mpisync] {self.label}: lost worker {w} (rank {rank} on {host}) at global "
              f"step {steps.global_step}, its last gradient "
              f"{'none' if last is None else f'computed at step {last}'}; {alive} of "
              f"{self.W} workers left", file=sys.stderr, flush=True)
        if alive < need:
            ranks = ", ".join(f"rank {v['rank']}" for v in self.lost.values())
            raise RuntimeError(
                f"{self.label}: lost workers {sorted(self.lost)} ({ranks}): the {alive} left "
                f"cannot complete a step of {self.spec.replicas_to_aggregate} gradients "
                f"(replicas_to_aggregate); the job ends")
        self._emit(steps.close(w))

    def _decide(self, a: Action) -> None:
        if self.observed:
            now = time.perf_counter()
            if self.log is not None:
                self.log.decided(a.step, a.taken, now)
            if timeline.current is not None:
                taken = [w for w, n in enumerate(a.taken) for _ in range(n)]
                timeline.current.instant("decide", now, {"step": a.step, "taken": taken}, tid=1)
        self.decided = a.workers
        first = min(w for w, n in enumerate(a.taken) if n)
        if self.spec.asynchronous and self.scheduled[first] and self.pushed_at[first] != a.step:
            self.parked = a          # its values at this step: ask the worker
            self.hyper_req = self.comm.Irecv([self.hyper_buf, MPI.BYTE],
                                             source=self.worker_ranks[first],
                                             tag=self.tags[Tag.HYPER])
            self._token(Kind.HYPER, a.step, (first,))
            return
        self._to_shards(self.control.new(Kind.DECIDE, a.step, taken=a.taken, workers=a.workers,
                                         hyper=self.hyper[first]))
        self.decided_step = a.step
        self._check_applied()       # strict sync: the other ps ranks may be done already

    def _on_hyper(self) -> None:
        a, self.parked = self.parked, None
        width = self.spec.hyper.width
        step = int(self.hyper_buf[HyperField.STEP])
        if step != a.step:
            raise ProtocolError(f"{self.label}: hyper-parameters for step "
                                f"{step}, asked for step {a.step}")
        words, codes = hyper_views(self.hyper_buf, width)
        self._to_shards(self.control.new(Kind.DECIDE, a.step, taken=a.taken, workers=a.workers,
                                         hyper=(words, codes)))
        self.decided_step = a.step

    def _go(self, a: Action) -> None:
        self._token(Kind.GO, a.step, a.workers, arg=1)     # arg 1: their gradients were taken

    def _reply(self, a: Action) -> None:
        self._to_shards(self.control.new(Kind.REPLY, a.step, workers=a.workers))
        self._token(Kind.GO, a.step, a.workers)

    def _grant(self, a: Action) -> None:
        self._token(Kind.GRANT, a.step, a.workers, arg=1)

    def _stop(self, a: Action) -> None:
        self._token(Kind.STOP, a.step, a.workers)

    def _load(self, a: Action) -> None:
        pieces, step = self.load_pieces
        self.load_pieces = None
        update = self.load_kind == Kind.UPDATE      # opt.update(): functions, no state
        self._to_shards(self.control.new(self.load_kind, a.step if update else step,
                                         has_obj=True), pieces)
        for w in a.workers:
            self.comm.send(None, dest=self.worker_ranks[w], tag=self.tags[Tag.INFO])
        if update:
            self.steps.loaded(a.step)         # they go on with the parameters they hold
            self._token(Kind.GRANT, a.step, a.workers)
        else:
            if self.log is not None:
                self.log.loaded(step)
            self._emit(self.steps.loaded(step))

    def _fail(self, a: Action) -> None:
        """A suspected deadlock: ask the parked workers whether they are still waiting (a
        load that waits for workers inside step() needs no answer: it is certain)."""
        if not a.taken:
            self._fail_now(a)
            return
        self.suspect, self.unconfirmed = a, set(a.taken)
        self.question += 1      # an answer to an earlier question (read late) is not this one's
        for w in a.taken:
            self.comm.send(still_question(a.step, self.question), dest=self.worker_ranks[w],
                           tag=self.tags[Tag.INFO])

    def _on_still(self, w: int, question: int) -> None:
        if self.suspect is None or question != self.question:
            return
        self.unconfirmed.discard(w)
        if self.unconfirmed:
            return
        a, self.suspect = self.suspect, None
        if not self.steps.deadlocked():
            self.steps.failed = False
            return
        self._fail_now(a)

    def _fail_now(self, a: Action) -> None:
        """Every worker involved gets a DeadlockError: those in step() a FAIL token and the
        reason, those in load_state_dict() the error as its answer, the parked the reason."""
        blocked, parked = list(a.workers), sorted(self.steps.parked)
        loading = sorted(self.steps.loading)
        text = self._deadlock_text(blocked, parked, a.step, loading)
        in_step = [w for w in blocked if w not in loading]
        self._token(Kind.FAIL, a.step, in_step)
        for worker in in_step + parked:
            self.comm.send(text, dest=self.worker_ranks[worker], tag=self.tags[Tag.INFO])
        for worker in loading:
            self.comm.send(DeadlockError(text), dest=self.worker_ranks[worker],
                           tag=self.tags[Tag.INFO])
        self.steps.fail_sent()
        self.load_pieces = None

    def _deadlock_text(self, blocked: list[int], parked: list[int], step: int,
                       loading: list[int]) -> str:
        gone = sorted(self.steps.departed - set(parked))
        if parked and gone and not loading:
            return (f"{self.label}: workers {parked} are in a collective on worker_comm that "
                    f"workers {gone} can never join: they left the job at global step "
                    f"{self.steps.global_step} (they closed, or their program ended: "
                    f"sys.exit(), an exception caught outside mpisync, or the end of the "
                    f"script) while the others "
                    f"trained on. Every worker must reach each collective among the workers "
                    f"(a Checkpointer's maybe_save() is one) or end training with opt.close()"
                    f" on every worker before it")
        if loading:
            others = sorted(set(blocked) - set(loading))
            where = (f"workers {others} wait inside step() for global step {step}"
                     if others else "")
            if parked:
                where += (" and " if where else "") + f"workers {parked} are in a collective " \
                         f"on worker_comm"
            call = "load_state_dict()" if self.load_kind == Kind.LOAD else "opt.update()"
            return (f"{self.label}: workers {loading} wait in {call} for every open worker "
                    f"to call it, but {where}: call {call} on every worker at the same "
                    f"point, before training or between two steps")
        spec = self.spec
        if spec.asynchronous or spec.num_tokens or spec.replicas_to_aggregate < spec.num_workers:
            why = ("with backup workers, num_tokens or asynchronous updates the workers do not "
                   "meet at the same step, so a collective among them during training can "
                   "wait for a worker whose step needs the others; gather such values after "
                   "opt.close() on every worker")
        else:
            why = ("the workers ran different numbers of steps (uneven data?). Give every "
                   "worker the same number of steps, or end training with opt.close() on "
                   "every worker before collectives among them")
        return (f"{self.label}: workers {blocked} wait inside step() for global step {step}, "
                f"which needs gradients from workers {parked}, who are in a collective on "
                f"worker_comm: {why}")

    def _shutdown(self, a: Action) -> None:
        if self.log is not None:
            self.log.finish(self.steps.global_step)
        self._to_shards(self.control.new(Kind.SHUTDOWN, a.step))
        # every worker's statistics after close(): the totals (small, so the sends complete
        # whether or not a worker ever reads them); per_step stays with serve()'s result
        final = {k: v for k, v in self.stats().items() if k != "per_step"}
        self.final_sends = [self.comm.isend(final, dest=rank, tag=self.tags[Tag.INFO])
                            for w, rank in enumerate(self.worker_ranks) if w not in self.lost]
        self.finished = True

    # -- requests -------------------------------------------------------------------------
    def _on_request(self, w: int, req: tuple) -> None:
        kind = req[0]
        if kind == Kind.STATS:
            self.comm.send(self.stats(), dest=self.worker_ranks[w], tag=self.tags[Tag.INFO])
        elif kind == Kind.PARK:
            # a request can be read after the push that followed it (requests are looked
            # for only when a turn finds nothing else): that collective is over
            if req[1] >= self.pushes[w]:
                self._emit(self.steps.park(w))
        elif kind == Kind.UNPARK:
            self.steps.unpark(w)
            if self.suspect is not None and w in self.suspect.taken:
                self.suspect = None          # it left: no deadlock after all
        elif kind == Kind.STILL:
            self._on_still(w, req[1])
        elif self.steps.applying:
            self.deferred.append((w, req))   # answered at version global_step, after the apply
        elif kind in (Kind.STATE, Kind.AVERAGES):
            self._to_shards(self.control.new(kind, self.steps.global_step, arg=w))
        elif kind in (Kind.LOAD, Kind.UPDATE):
            self._on_load_request(w, req[1], kind)
        else:
            raise ProtocolError(f"{self.label}: unknown request {kind!r} from worker {w}")

    def _on_load_request(self, w: int, payload, kind: Kind = Kind.LOAD) -> None:
        """A state to load (LOAD), or opt.update()'s functions (UPDATE, from every worker)."""
        what = "load_state_dict()" if kind == Kind.LOAD else "opt.update()"
        error, everyone = None, False
        if not self.steps.loading:
            self.load_kind = kind             # the first worker to ask says what is loaded
        elif kind != self.load_kind:
            error = f"worker {w} called {what} while other workers wait in another call"
        if error is None and kind == Kind.UPDATE:
            error = update_problem(payload)   # the same for every worker: each is told
            everyone, payload = error is not None, (payload, self.steps.global_step)
        if error is None:
            try:
                actions = self.steps.load(w)
            except RuntimeError as exc:
                error = str(exc).replace("load_state_dict()", what)
        if error is not None:
            if not everyone:
                error += (f"; call {what} on every worker at the same point, before training "
                          f"or between two steps")
            self.comm.send(ConfigError(f"{self.label}: {error}", collective=everyone),
                           dest=self.worker_ranks[w], tag=self.tags[Tag.INFO])
            return
        if payload is not None:
            self.load_pieces = payload
        self._emit(actions)

    def stats(self) -> dict:
        return dict(self.steps.stats(), workers_lost=list(self.lost.values()),
                    steps_skipped_nonfinite=list(self.skipped))

    def describe_wait(self) -> str:
        c = self.steps
        return (f"global step {c.global_step} has {c.num_taken} of {c.replicas_to_aggregate} "
                f"gradients; workers still computing: {sorted(c.computing)}, closed: "
                f"{sorted(c.closed)}")

    def finish(self) -> None:
        for req in self.final_sends:     # done, or done once the worker reads it
            req.Free()
        for req in self.notice_reqs:
            if req.Test() is False:
                req.Cancel()
                req.Wait()
            req.Free()
