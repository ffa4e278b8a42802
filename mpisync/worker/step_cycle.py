"""A worker's step: push what it wrote and its gradients, wait for the token, pull."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..protocol.wire import FLAG_SCHEDULED, Kind
from ..runtime import heap
from .refusals import check_held, check_settings

if TYPE_CHECKING:
    from .stepclock import StepClock

__all__ = ["StepCycle"]


class StepCycle:
    """One optimizer's steps on this worker, from its gradients to the new parameters.

    It holds the global step this worker stands at, whether training stopped (``stopped``:
    other workers closed and no step can complete), the pushes so far (``seq``) and this
    worker's own figures: ``steps`` (steps counted), ``wait_s`` (seconds waited for the
    token) and, once closed, the hash tables' counts (``hash_stats``) and the job's final
    statistics (``final_stats()``).

    Args:
        spec: the optimizer's agreed spec.
        cluster: the worker's cluster.
        dense: its ``DenseChannel``; ``rows``: its ``RowsChannel``.
        local: its ``LocalUpdate`` (``dense="allreduce"``) or None.
        tracker: its ``WriteTracker``.
        schedules: its ``Schedules``, told every counted global step.
        wrapped: the wrapped torch optimizer, whose settings ``check_settings`` watches.
        groups: returns the param groups whose hyper-parameters travel with each push.
    """

    def __init__(self, spec, cluster, dense, rows, local, tracker, schedules,
                 wrapped, groups: Callable[[], list]):
        self.spec, self.cluster, self.label = spec, cluster, cluster.label
        self.dense, self.rows, self.local, self.tracker = dense, rows, local, tracker
        self.schedules, self.wrapped, self.groups = schedules, wrapped, groups
        self.settings = None        # what settings_of() read of the wrapped optimizer
        self.clock: StepClock | None = None    # statistics log or timeline, once set up
        self.stopped = False
        self.global_step = -1
        self.seq = 0
        self.steps = 0
        self.wait_s = 0.0
        self.hash_stats: dict | None = None
        self.final: dict | None = None
        self.heap_held = False      # keep_steps() from the first step until close()

    def zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad(set_to_none)`` for every channel's gradients."""
        self.dense.zero_grad(set_to_none)
        if self.local is not None:
            self.local.channel.zero_grad(set_to_none)
        if self.rows.active:
            self.rows.zero_grad(set_to_none)

    def run(self) -> None:
        """One ``step()`` after its checks and closure: what was written and the gradients
        go out, this worker applies its own part (``dense="allreduce"``) meanwhile, and
        the parameters of the new global step come in. Warns (at the caller of
        ``step()``) when the step did not take this worker's gradient and writes."""
        clock, local = self.clock, self.local
        if clock is not None:
            clock.begin(self.global_step)
        if self.settings:
            check_settings(self.settings, self.wrapped, self.label)
        if local is not None:
            local.channel.before_step()    # collective: every worker's gradients averaged
            local.check_finite(self.global_step)
        written = self.tracker.written()   # first: a parameter given a new tensor is checked
        self.push(written)
        if clock is not None:
            clock.pushed()
        if local is not None:              # while the ps ranks apply theirs
            local.step(self.dense.hyper_out, self.groups(), self.global_step)
        if not self.heap_held:              # the first step: a step's temporaries kept from
            self.heap_held = heap.keep_steps()  # now on, what set-up freed given back
            heap.tidy()
        taken = self.receive()
        if clock is not None:
            clock.end()
        if written and not taken and not self.spec.asynchronous:
            names = [self.dense.names[i] for i in written]
            warnings.warn(f"{self.label}: the step did not take this worker's gradient "
                          f"(it came too late), so the writes to {names} that travelled with "
                          f"it were dropped too; write parameters on every worker",
                          RuntimeWarning, stacklevel=3)

    def push(self, written: list[int]) -> None:
        """Send this worker's gradients (after what it wrote) to every ps rank."""
        dense = self.dense
        dense.gather()
        if not dense.has_grad.any():
            check_held(self.tracker, self.label)
        self.spec.hyper.encode(self.groups(), *dense.hyper_out)
        flags = FLAG_SCHEDULED if self.schedules.follows_global_step else 0
        self.seq += 1
        worker = self.cluster.worker_index
        assert worker is not None            # the optimizer refused a ps rank
        dense.push(self.global_step, worker, self.seq, flags, written)
        if self.rows.active:
            self.rows.push(self.global_step, self.seq)

    def receive(self, count: bool = True) -> bool:
        """Wait for the token; with it come the parameters of the new global step.

        ``count``: a step of training (the schedules and this worker's figures count it),
        not one of set-up or of a load. Returns whether the step took this worker's
        gradient.
        """
        on_hyper = self.hyper_at if self.spec.asynchronous else None
        kind, step, taken, waited = self.dense.pull(on_hyper)
        if self.rows.active:
            self.rows.wait_sends()
            if kind == Kind.GO:
                self.rows.pull(step)
        if kind == Kind.STOP:
            self.stopped = True
        self.global_step = step
        if count:
            self.schedules.note_step(step)
            self.steps += 1
            self.wait_s += waited
        return taken

    def hyper_at(self, step: int):
        """Asynchronous mode: the hyper-parameters at the step that applies our gradient."""
        self.schedules.advance_to(step)
        return self.spec.hyper.values(self.groups())

    def own_figures(self, closed: bool) -> dict:
        """This worker's entries of ``optimizer.stats`` (see there)."""
        out = {"local_steps": self.steps, "token_wait_s": self.wait_s,
               "bytes_per_ps": [a + b for a, b in zip(self.dense.bytes_per_ps,
                                                      self.rows.bytes_per_ps)]}
        looked = self.rows.last_lookups
        out.update(lookups_per_ps=list(looked[0]), lookup_sent_per_ps=list(looked[1]),
                   lookup_received_per_ps=list(looked[2]))
        hashed = self.hash_stats
        if not closed and any(t.hashed is not None for t in self.spec.tables):
            hashed = self.rows.hash_stats()
        if hashed is not None:
            out["hash_tables"] = hashed
        return out

    def final_stats(self) -> dict:
        """The job's final statistics, read once (after close(): every worker gets them)."""
        if self.final is None:
            self.final = self.dense.final_stats()
        return self.final

    def close(self) -> None:
        """Leave the job: every channel closes (see ``optimizer.close()``); warns (at the
        caller of ``close()``) of parameters written after the last step."""
        try:
            written = self.tracker.written()
        except TypeError as exc:
            # a parameter that moved or changed type after set-up, refused by step(): the
            # worker still leaves the job (the ps ranks would wait for it otherwise)
            warnings.warn(f"{exc}; closing with the values of the last step", RuntimeWarning,
                          stacklevel=3)
            written = []
        if written:
            names = [self.dense.names[i] for i in written]
            warnings.warn(f"{self.label}: parameters {names} were written after the "
                          f"last step(); the ps ranks keep their values from that step",
                          RuntimeWarning, stacklevel=3)
        if any(t.hashed is not None for t in self.spec.tables):
            self.hash_stats = self.rows.hash_stats()
        worker = self.cluster.worker_index
        assert worker is not None            # the optimizer refused a ps rank
        self.dense.close(self.global_step, worker)
        self.rows.close()
        if self.local is not None:
            self.local.channel.close()
        self.tracker.release()
