"""Accumulators and staleness: which gradients a step takes, and their reduction (no MPI)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .protocol.wire import Kind

__all__ = ["REDUCTIONS", "SPARSE_REDUCTIONS", "Action", "ShardAccumulator", "StepCoordinator",
           "reduce_rows"]

REDUCTIONS = ("mean", "sum")
SPARSE_REDUCTIONS = ("mean", "per_row")


def reduce_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, ...],
                count: int, how: str = "mean") -> torch.Tensor:
    """The sparse gradient of a step from the taken gradients' rows, coalesced.

    Args:
        pieces: per taken gradient (in reduction order), its row ids (each once) and rows.
        shape: the dense shape (rows, *row shape).
        count: the number of gradients the step took (some may have no rows here).
        how: ``"mean"`` (the sum divided by ``count``: large-batch training), ``"per_row"``
            (each row's sum divided by the number of gradients that have it, TensorFlow's
            ``SparseConditionalAccumulator``) or ``"sum"``.
    """
    ids = torch.cat([i for i, _ in pieces])
    values = torch.cat([v for _, v in pieces])
    grad = torch.sparse_coo_tensor(ids[None], values, shape, check_invariants=False).coalesce()
    if how == "sum" or count == 1:
        return grad
    divisor: torch.Tensor | int
    if how == "per_row":
        ones = torch.ones(len(ids), dtype=values.dtype)
        per_row = torch.sparse_coo_tensor(ids[None], ones, shape[:1],
                                          check_invariants=False).coalesce().values()
        divisor = per_row.view(-1, *[1] * (len(shape) - 1))
    else:
        divisor = count
    return torch.sparse_coo_tensor(grad.indices(), grad.values() / divisor, shape,
                                   is_coalesced=True, check_invariants=False)


@dataclass(frozen=True)
class Action:
    """Something the coordinator's caller must send.

    ``kind`` is a ``wire.Kind``, the same word the message carries:
      DECIDE    step ``step`` is complete: every ps applies the gradients counted in
                ``taken`` (per worker), then sends the new parameters to ``workers``;
      GO        send token GO(``step``) to ``workers`` (their parameters are on the way);
      REPLY     every ps sends its current parameters to ``workers`` now, and the
                coordinator sends them token GO(``step``);
      GRANT     send token GRANT(``step``): compute another gradient on the same
                parameters;
      STOP      send token STOP(``step``) to ``workers``;
      LOAD      every open worker (``workers``) asked to load a state: load it on every
                ps, then call ``loaded()``;
      FAIL      no step can ever complete: ``workers`` wait inside ``step()`` for workers
                that are in a collective among the workers (``taken`` lists those);
      SHUTDOWN  every worker has closed: stop the ps ranks.
    """

    kind: Kind
    step: int
    workers: tuple[int, ...] = ()
    taken: tuple[int, ...] = ()


@dataclass
class StepRecord:
    """Which workers' gradients one global step took, and which arrived too late."""

    step: int
    taken: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


class StepCoordinator:
    """The token barrier's bookkeeping, as TensorFlow's chief queue runner keeps it.

    Invariant: the parameters on every ps are at version ``global_step`` except while
    ``applying``. A step takes the first ``replicas_to_aggregate`` gradients computed at
    ``global_step`` in arrival order; any gradient computed at an older step, or arriving
    after the step closed, is dropped and recorded. Every push is answered by exactly one
    token, and a worker holding a token is "computing". Each step hands out at most
    ``num_tokens`` extra tokens for the same step (TensorFlow's ``num_tokens`` beyond one
    per worker), so by default no worker runs ahead.

    With ``asynchronous`` every gradient is its own step, applied in arrival order
    whatever step it was computed at (TensorFlow's asynchronous training), and nothing is
    dropped. ``max_staleness=k`` bounds it: a worker that has had more than k gradients
    applied beyond the slowest open worker gets its next token only once that worker
    catches up (or closes).
    """

    def __init__(self, num_workers: int, replicas_to_aggregate: int, num_tokens: int = 0,
                 global_step: int = 0, asynchronous: bool = False,
                 max_staleness: int | None = None):
        # the arguments were validated once, in mpisync.protocol.spec
        self.num_workers = num_workers
        self.replicas_to_aggregate = replicas_to_aggregate
        self.num_tokens = num_tokens
        self.global_step = global_step
        self.applying = False
        self.stopped = False
        self.taken = [0] * num_workers
        self.num_taken = 0
        self.pool = num_tokens
        self.waiting: list[int] = []       # pushed; token comes when the step is applied
        self.late: list[int] = []          # pushed while applying; reply after it
        self.computing: set[int] = set()   # holds a token, will push (or close)
        self.closed: set[int] = set()
        self.records: dict[int, StepRecord] = {}
        self.taken_total = [0] * num_workers      # taken, the open step included
        self.applied_total = [0] * num_workers    # taken by steps that were applied
        self.dropped_total = [0] * num_workers
        self.decided: tuple[int, ...] = ()        # taken counts of the step being applied
        self.loading: set[int] = set()            # asked to load a state, waiting for all
        self.parked: set[int] = set()             # in a collective among the workers
        self.departed: set[int] = set()           # left the job: their program ended
        self.failed = False
        self.failed_for: set[int] = set()   # the parked workers the FAIL told
        self.asynchronous = asynchronous
        self.max_staleness = max_staleness
        self.queue: list[int] = []         # async: pushed while applying, in arrival order
        self.held: set[int] = set()        # async: applied, token withheld (staleness bound)

    # -- events -------------------------------------------------------------------------
    def start(self) -> list[Action]:
        """Every worker needs the initial parameters and its first token."""
        self.computing = set(range(self.num_workers))
        return [Action(Kind.REPLY, self.global_step, tuple(range(self.num_workers)))]

    def push(self, worker: int, step: int) -> list[Action]:
        """Worker ``worker`` pushed a gradient computed at ``step``."""
        if worker not in self.computing:
            raise RuntimeError(f"worker {worker} pushed without holding a token")
        self.parked.discard(worker)        # it left any collective it was in
        if step > self.global_step:
            raise RuntimeError(f"worker {worker} pushed step {step} ahead of global step "
                               f"{self.global_step}")
        self.computing.discard(worker)
        if self.asynchronous:
            if self.applying:
                self.queue.append(worker)
                return []
            return self._decide_alone(worker)
        if self.stopped:
            self._record(step).dropped.append(worker)
            self.dropped_total[worker] += 1
            return [Action(Kind.STOP, self.global_step, (worker,))]
        if step == self.global_step and not self.applying:
            self.taken[worker] += 1
            self.num_taken += 1
            self.taken_total[worker] += 1
            self._record(step).taken.append(worker)
            if self.num_taken == self.replicas_to_aggregate:
                self.applying = True
                workers = tuple(sorted(self.waiting + [worker]))
                self.waiting = []
                self.decided = tuple(self.taken)
                return [Action(Kind.DECIDE, step, workers, self.decided)]
            if self.pool > 0:
                self.pool -= 1
                self.computing.add(worker)
                return [Action(Kind.GRANT, step, (worker,))]
            self.waiting.append(worker)
            return self._check_stall() + self._check_deadlock()
        # stale: computed at an older step, or arrived after its step closed
        self._record(step).dropped.append(worker)
        self.dropped_total[worker] += 1
        if self.applying:
            self.late.append(worker)
            return []
        self.computing.add(worker)
        return [Action(Kind.REPLY, self.global_step, (worker,))]

    def applied(self, decided_workers: tuple[int, ...]) -> list[Action]:
        """Every ps applied the step; ``decided_workers`` already have their parameters."""
        if not self.applying:
            raise RuntimeError("applied() without a step being applied")
        self.applying = False
        for w, n in enumerate(self.decided):
            self.applied_total[w] += n
        self.global_step += 1
        self.taken = [0] * self.num_workers
        self.num_taken = 0
        self.pool = self.num_tokens
        actions = []
        # a worker that died while its step was applied closed meanwhile: no token for it
        decided_workers = tuple(w for w in decided_workers if w not in self.closed)
        if decided_workers:
            actions.append(Action(Kind.GO, self.global_step, decided_workers))
            self.computing.update(decided_workers)
        if self.late:
            late, self.late = tuple(sorted(self.late)), []
            actions.append(Action(Kind.REPLY, self.global_step, late))
            self.computing.update(late)
        if self.asynchronous:
            actions += self._release_held()
            if self.queue:
                actions += self._decide_alone(self.queue.pop(0))
        return actions + self._check_stall() + self._check_shutdown() + self._check_deadlock()

    def park(self, worker: int) -> list[Action]:
        """Worker ``worker`` waits for the others in a collective: it pushes nothing now."""
        self.parked.add(worker)
        return self._check_deadlock()

    def unpark(self, worker: int) -> None:
        """Worker ``worker`` left the collective; a deadlock suspected meanwhile is void."""
        self.parked.discard(worker)
        self.failed = False

    def depart(self, worker: int) -> list[Action]:
        """Worker ``worker`` left the job (its program ended): it joins no collective again."""
        self.departed.add(worker)
        if worker in self.failed_for:  # told it could not go on, and left: in no collective
            self.failed_for.discard(worker)
            self.parked.discard(worker)
            if not self.failed_for:    # a worker that goes into one later is told too
                self.failed = False
        return self._check_deadlock()

    def deadlocked(self) -> bool:
        """No step and no load can complete: workers wait inside step() or in
        load_state_dict() for workers that are in a collective among the workers, or that
        are themselves waiting (a load on some workers only), or workers in a collective
        after another one left the job."""
        if self.applying or self.queue or not (self.parked or self.loading):
            return False             # a step nobody can complete otherwise: a stall (STOP)
        if self.parked and self.departed - self.parked:
            return True              # a collective that a worker who left can never join
        if self.loading and self.loading >= set(range(self.num_workers)) - self.closed:
            return False             # every open worker asked: the state is loaded
        blocked = set(self.waiting) | self.held | self.loading
        return bool(blocked) and not (self.computing - self.parked - self.loading)

    def _check_deadlock(self) -> list[Action]:
        """FAIL (once) when ``deadlocked()``; the caller confirms it with the parked workers,
        whose word that they left the collective may still be on its way."""
        if self.failed or not self.deadlocked():
            return []
        self.failed, self.failed_for = True, set(self.parked)
        blocked = set(self.waiting) | self.held | self.loading
        return [Action(Kind.FAIL, self.global_step, tuple(sorted(blocked)),
                       tuple(sorted(self.parked)))]

    def load(self, worker: int) -> list[Action]:
        """Worker ``worker`` asks to load a state; LOAD once every open worker asked.

        Every worker gives up its token until the state is loaded, so no gradient can
        reach a step before all of them hold the loaded one.
        """
        if self.applying or self.num_taken:
            raise RuntimeError(f"worker {worker} called load_state_dict() while step "
                               f"{self.global_step} already holds gradients")
        self.computing.discard(worker)
        self.loading.add(worker)
        return self._check_load() or self._check_deadlock()

    def loaded(self, global_step: int) -> list[Action]:
        """Every ps loaded the state at ``global_step``: the loading workers get it.

        Gradients the open step took meanwhile (pushed by a worker that then closed) were
        computed on the state before the load: dropped.
        """
        self._discard_step()
        self.pool = self.num_tokens
        self.failed = False
        workers, self.loading = tuple(sorted(self.loading)), set()
        self.global_step = global_step
        self.computing.update(workers)
        return [Action(Kind.REPLY, global_step, workers)]

    def fail_sent(self) -> None:
        """FAIL reached the blocked workers. The loading ones hold their token again, as if
        they had not asked; those inside step() are owed nothing more (they can only close:
        the gradients their step took count as dropped then)."""
        self.computing |= self.loading
        self.loading = set()
        self.waiting = []
        self.held = set()

    def _check_load(self) -> list[Action]:
        open_workers = set(range(self.num_workers)) - self.closed
        if not self.loading or not self.loading >= open_workers:
            return []
        return [Action(Kind.LOAD, self.global_step, tuple(sorted(self.loading)))]

    def close(self, worker: int) -> list[Action]:
        """Worker ``worker`` closed: it holds a token and will push no more."""
        self.computing.discard(worker)
        self.closed.add(worker)
        self.loading.discard(worker)
        # one that waited inside step() closes only after a DeadlockError: no token for it
        self.waiting = [w for w in self.waiting if w != worker]
        self.late = [w for w in self.late if w != worker]
        self.held.discard(worker)
        released = self._release_held() if not self.applying else []
        return (released + self._check_load() + self._check_stall() + self._check_shutdown()
                + self._check_deadlock())

    # -- helpers ------------------------------------------------------------------------
    def _decide_alone(self, worker: int) -> list[Action]:
        """Async: the next step is this worker's gradient alone."""
        self.applying = True
        self.taken_total[worker] += 1
        self._record(self.global_step).taken.append(worker)
        taken = tuple(int(w == worker) for w in range(self.num_workers))
        self.decided = taken
        if self._too_far_ahead(worker):
            self.held.add(worker)
            return [Action(Kind.DECIDE, self.global_step, (), taken)]
        return [Action(Kind.DECIDE, self.global_step, (worker,), taken)]

    def _too_far_ahead(self, worker: int) -> bool:
        if self.max_staleness is None:
            return False
        open_counts = [n for w, n in enumerate(self.taken_total) if w not in self.closed]
        return self.taken_total[worker] - min(open_counts) > self.max_staleness

    def _release_held(self) -> list[Action]:
        """Async: hand the current parameters to held workers back within the bound."""
        free = tuple(sorted(w for w in self.held if not self._too_far_ahead(w)))
        if not free:
            return []
        self.held.difference_update(free)
        self.computing.update(free)
        return [Action(Kind.REPLY, self.global_step, free)]

    def _record(self, step: int) -> StepRecord:
        rec = self.records.get(step)
        if rec is None:
            rec = self.records[step] = StepRecord(step)
        return rec

    def _check_stall(self) -> list[Action]:
        """No open worker can push for this step any more: the training is over."""
        if self.applying or self.computing or self.loading or not self.waiting:
            return []
        self.stopped = True
        self._discard_step()
        waiting, self.waiting = tuple(sorted(self.waiting)), []
        return [Action(Kind.STOP, self.global_step, waiting)]

    def _discard_step(self) -> None:
        """The current step will never be applied: count what it took as dropped."""
        if not self.num_taken:
            return
        rec = self._record(self.global_step)
        # the open step's are the last ones: a state loaded at an older step may have
        # applied this step before, and those stay taken
        kept = len(rec.taken) - self.num_taken
        rec.dropped.extend(rec.taken[kept:])
        del rec.taken[kept:]
        for w, n in enumerate(self.taken):
            self.taken_total[w] -= n
            self.dropped_total[w] += n
        self.taken = [0] * self.num_workers
        self.num_taken = 0

    def _check_shutdown(self) -> list[Action]:
        if self.applying or len(self.closed) < self.num_workers:
            return []
        self._discard_step()
        return [Action(Kind.SHUTDOWN, self.global_step)]

    def stats(self) -> dict:
        """A plain-data snapshot: totals, per worker, and per step.

        ``gradients_applied`` and ``taken_per_worker`` count the gradients of applied steps
        only; ``gradients_pending`` those that the open step holds (applied with it, or
        counted as dropped if it never completes) and, in asynchronous mode, those queued
        behind the step being applied. ``per_step`` lists every step that took
        or dropped a gradient, the open one included.
        """
        return {
            "global_step": self.global_step,
            "steps": self.global_step,
            "gradients_applied": sum(self.applied_total),
            # async: the gradients queued behind the step being applied are pending too
            "gradients_pending": (sum(self.taken_total) - sum(self.applied_total)
                                  + len(self.queue)),
            "gradients_dropped": sum(self.dropped_total),
            "taken_per_worker": list(self.applied_total),
            "dropped_per_worker": list(self.dropped_total),
            "per_step": [
                {"step": r.step, "taken": list(r.taken), "dropped": list(r.dropped)}
                for r in sorted(self.records.values(), key=lambda r: r.step)
            ],
            "stopped": self.stopped,
        }


class ShardAccumulator:
    """One ps rank's received gradients, held by step until the coordinator decides.

    Like TensorFlow's ConditionalAccumulator: a gradient computed at a step older than
    the shard's ``global_step`` is stale and refused; ``take`` reduces the chosen
    gradients (MEAN or SUM) in a fixed order (worker index, then arrival), so the result
    does not depend on arrival timing. Buffers are the caller's; they are handed back.
    """

    def __init__(self, reduction: str = "mean", global_step: int = 0,
                 asynchronous: bool = False):
        self.reduction = reduction
        self.global_step = global_step
        self.asynchronous = asynchronous
        self._held: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
        self._fifo: dict[int, list] = defaultdict(list)    # async: per worker, oldest first
        self.dropped = 0

    def offer(self, worker: int, step: int, item) -> bool:
        """Hold ``item`` (a received gradient) for ``step``; False if it is stale.

        In asynchronous mode nothing is stale: a step takes each worker's oldest held items.
        """
        if self.asynchronous:
            self._fifo[worker].append(item)
            return True
        if step < self.global_step:
            self.dropped += 1
            return False
        self._held[step][worker].append(item)
        return True

    def ready(self, step: int, taken: tuple[int, ...]) -> bool:
        """True when every gradient that ``taken`` names for ``step`` has arrived."""
        return all(len(self._items(step, w)) >= n for w, n in enumerate(taken) if n)

    def chosen(self, step: int, taken: tuple[int, ...]) -> list:
        """The items ``taken`` names, in reduction order: worker index, then arrival."""
        return [item for w, n in enumerate(taken) if n for item in self._items(step, w)[:n]]

    def reset(self, global_step: int) -> list:
        """A state was loaded at ``global_step``: return every item held (none counts)."""
        self.global_step = global_step
        freed = [item for held in self._held.values() for items in held.values()
                 for item in items]
        freed += [item for items in self._fifo.values() for item in items]
        self._held.clear()
        self._fifo.clear()
        return freed

    def advance(self, step: int, taken: tuple[int, ...] = ()) -> list:
        """Step ``step`` is applied: return the items it no longer needs.

        Synchronous: every item held for steps <= ``step``. Asynchronous: the items
        ``taken`` named.
        """
        self.global_step = step + 1
        freed = []
        if self.asynchronous:
            for w, n in enumerate(taken):
                freed.extend(self._fifo[w][:n])
                del self._fifo[w][:n]
            return freed
        for s in [s for s in self._held if s <= step]:
            for items in self._held.pop(s).values():
                freed.extend(items)
        return freed

    def _items(self, step: int, worker: int) -> list:
        """``worker``'s items for ``step``; asynchronous: all of them, oldest first."""
        if self.asynchronous:
            return self._fifo[worker]
        held = self._held.get(step)
        return held.get(worker, []) if held else []

    def reduce(self, regions_out, regions_in_list, count: int,
               reduction: str | None = None) -> None:
        """Sum ``regions_in_list`` into ``regions_out`` region by region; MEAN divides by count.

        Args:
          regions_out: list of tensors (one per dtype region) receiving the result.
          regions_in_list: one list of tensors per chosen gradient, in reduction order
            (of ``regions_out``'s dtypes, or narrower ones: the sum is in the output's).
          count: the number of gradients taken (the divisor for MEAN).
          reduction: overrides the accumulator's own reduction.
        """
        mean = (reduction or self.reduction) == "mean"
        for r, out in enumerate(regions_out):
            if len(regions_in_list) == 1 or regions_in_list[0][r].dtype != out.dtype:
                out.copy_(regions_in_list[0][r])    # a narrower wire dtype: summed in out's
                for regions_in in regions_in_list[1:2]:
                    out.add_(regions_in[r])
            else:      # two passes over memory for the first pair, not three
                torch.add(regions_in_list[0][r], regions_in_list[1][r], out=out)
            for regions_in in regions_in_list[2:]:
                out.add_(regions_in[r])
            if mean and count > 1:
                if count & (count - 1) == 0:
                    out.mul_(1.0 / count)   # exact for a power of two, and faster than div
                else:
                    out.div_(count)
