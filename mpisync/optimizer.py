"""SyncReplicasOptimizer: the torch face of synchronous parameter-server training."""
from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from mpi4py import MPI

from .errors import ClosedError, ConfigError
from .protocol.multi import JointOptimizer, inners, join_state_dicts, joint_problem
from .protocol.spec import Options
from .ps.steplog import log_path
from .resumestate import warn_if_restarts_start_over
from .runtime import heap
from .runtime.progress import SETUP_TIMEOUT, Poller, spin_seconds
from .worker.hooks import TorchHooks
from .worker.parts import WorkerParts
from .worker.refusals import (
    refuse_add_param_group,
    refuse_grad_scaler,
    refuse_step_in_averaged,
)
from .worker.setup import agreed_setup, worker_cluster
from .worker.stepclock import for_worker

if TYPE_CHECKING:
    from .protocol.partition import PartitionerSpec
    from .protocol.spec import JobSpec
    from .ps_ranks import Cluster
    from .worker.rows import RowsChannel

__all__ = ["SyncReplicasOptimizer"]


class SyncReplicasOptimizer(torch.optim.Optimizer):
    """Synchronous data-parallel training with the model held on parameter-server ranks.

    Each ``step()`` sends, to every ps rank, one fused buffer holding the gradients that
    rank owns; the ps ranks average the first ``replicas_to_aggregate`` gradients computed
    at the current global step (later and older ones are dropped and counted), apply the
    wrapped optimizer, whose state lives there, and send the new parameters back. The
    coordinator (ps 0) then hands out the token: the new global step. ``step()`` returns
    once this worker holds the token and the parameters of that step.

    It means what the same loop means in one process with all the workers' batches:
    hyper-parameters of any type (numbers, tensors, tuples) changed by any scheduler reach
    the ps ranks exactly; a parameter whose ``.grad`` is None is skipped; a write to a
    parameter between steps (``model.load_state_dict``, a clamp) reaches the ps ranks;
    parameters no optimizer group holds are broadcast from the chief once and left alone.
    Construction, ``load_state_dict()`` and ``close()`` must be called on every worker;
    ``step()`` too (a worker that skips it holds a step up). ``state_dict()`` may be called
    on any worker alone: it reads the ps ranks' state at one global step.

    Args:
        optimizer: a ``torch.optim`` optimizer (or a subclass of one) over the model's
            parameters; it is rebuilt on the ps ranks over each shard: its class, its
            constructor arguments, its attributes and its param groups. Or a list of
            them over disjoint parameters (``[torch.optim.Adam(mlp_params),
            mpisync.RowWiseAdagrad(table_params)]``): still one push, one token and one
            pull per step; each keeps its own param groups, state and LR schedulers (one
            built over it after this call is adopted as if built over this optimizer:
            global step, checkpoints), and the step is theirs in one process (``mpisync.protocol.multi``).
            ``param_groups`` and ``state_dict()`` then hold their groups concatenated in
            the list's order (``state_dict()["mpisync"]["optimizers"]``: groups per
            optimizer); ``load_state_dict()`` also takes ``{"optimizers": [sd_a, sd_b]}``
            of the same optimizers in one process. An empty list, an entry that is not an
            optimizer, a parameter in two of them and a trainable parameter of
            ``named_parameters`` in none are refused on every worker.
        named_parameters: ``model.named_parameters()``; names must match on every worker.
        replicas_to_aggregate: gradients averaged per step (default: the number of workers).
        total_num_replicas: the number of workers (default and only valid value: the number
            of worker ranks); more workers than ``replicas_to_aggregate`` are backups.
        num_tokens: extra gradients per step that workers may compute on the same
            parameters before the step is applied (default ``max(0, to_aggregate - total)``;
            fewer than that cannot complete a step).
        placement: ``"greedy_sorted"`` (default), ``"greedy"``, ``"round_robin"`` or a
            callable, see ``mpisync.placement.plan``; every worker must get the same plan.
        cluster: what ``mpisync.init()`` returned (default: the last one).
        reduction: ``"mean"`` (default: equal to training on the combined batch) or ``"sum"``.
        deterministic: also make torch's kernels deterministic on every rank; gradients
            are always reduced in worker order, so strict-sync runs repeat bitwise.
        ema_decay: keep an exponential moving average of every floating-point parameter (not
            the embedding tables: ``mpisync.Embedding``, sparse ``nn.Embedding``) on
            the ps ranks, updated after each applied step (``average = decay * average +
            (1 - decay) * parameter``); read it with ``averages()`` or ``averaged()``.
        ema_num_updates: use ``min(ema_decay, (1 + t) / (10 + t))`` after the t-th step, as
            TensorFlow's ``ExponentialMovingAverage(decay, num_updates=global_step)``.
        asynchronous: asynchronous training instead: the ps ranks apply every gradient as
            its own step, in arrival order, whatever step it was computed at, and send the
            pushing worker the new parameters at once. ``replicas_to_aggregate`` is 1.
        max_staleness: with ``asynchronous``, a worker may be at most this many applied
            gradients ahead of the slowest worker that has not closed; beyond that its
            ``step()`` waits for the slowest to catch up (default: unbounded).
        named_buffers: ``model.named_buffers()``: module buffers (BatchNorm's running
            statistics) kept on the ps ranks and handed to every worker with each step.
        buffers: what the ps ranks keep of them after each step: ``"broadcast"`` (default,
            DDP's ``broadcast_buffers``: the values of the lowest-index worker whose
            gradient the step took, the chief in strict sync), ``"mean"`` (the mean over the
            workers taken; integer buffers from the lowest-index one) or ``"local"`` (each
            worker keeps its own, as if ``named_buffers`` were not given).
        schedule: how learning-rate schedulers built on this optimizer count steps:
            ``"auto"`` (default: one stepped after every ``step()`` follows the global step,
            as TensorFlow's schedules do; one stepped less often, per epoch, counts its own
            calls), ``"global_step"`` (every scheduler follows the global step) or
            ``"local"`` (every scheduler counts its own calls).
        partitioner: split parameters along axis 0 into shards, each placed on its own
            (``mpisync.fixed_size(n)``, ``mpisync.min_max(...)``, ``mpisync.axis_size(...)``),
            or a dict from parameter name (a glob) to partitioner. Workers keep a
            partitioned parameter whole; the ps ranks each hold and update their shards.
        sparse_reduction: how the sparse gradients of embedding tables are reduced:
            ``"mean"`` (default: their sum divided by the number of gradients taken, equal
            to training on the combined batch) or ``"per_row"`` (each row's sum divided by
            the number of taken gradients that have the row, TensorFlow's
            ``SparseConditionalAccumulator``).
        dense: where the dense parameters live: ``"ps"`` (default: on the ps ranks, with
            their optimizer state) or ``"allreduce"``: the workers keep them, average their
            gradients among themselves in buckets started from gradient hooks while
            backward runs (after ``backward()`` each ``.grad`` holds the mean over the
            workers, as with DDP), and each applies the wrapped optimizer to them; embedding
            tables and partitioned parameters stay on the ps ranks. Strict sync only: no
            backup workers, no asynchronous mode, no extra tokens. Every worker must call
            ``backward()`` equally often between two steps, and write these parameters on
            every worker or on none.
        allreduce_backend: with ``dense="allreduce"``: ``"auto"`` (default: ``"nccl"``
            where every worker's parameters are on a GPU of its own, else ``"mpi"``,
            through host memory where workers share a GPU), ``"nccl"`` (a
            ``torch.distributed`` NCCL group over the workers, set up from their
            communicator; the buckets stay on the GPU), ``"mpi"`` (mpi4py's
            ``Iallreduce`` on the workers' communicator) or ``"horovod"`` (Horovod's
            allreduce; mpisync calls ``hvd.init(comm=...)`` on the workers unless it was).
        bucket_bytes: the most gradient bytes per bucket (a parameter larger than that
            gets a bucket of its own). With ``dense="allreduce"``: the all-reduce's buckets
            (default 4 MiB). Otherwise each push to a ps rank travels in buckets of its
            parameters (default 4 MiB): the first ones sent from gradient hooks while
            backward still runs, each reduced, applied and sent back by the ps as soon as
            every gradient of it is in.
        wire_dtype: ``torch.bfloat16`` or ``torch.float16`` (or ``"bf16"``, ``"fp16"``):
            float32 and float64 gradients and parameters travel between workers and ps
            ranks in that dtype, half the bytes or less (Horovod's compression does the
            same for gradients). The ps ranks reduce and apply in the parameters' own
            dtype and keep the master copy; workers compute with the parameters rounded
            to ``wire_dtype``. Results differ from float32 by that rounding (docs/design.md).
            Default None: exact.
        shared_memory: a worker and a ps rank on one machine exchange gradients and
            parameters through shared memory instead of MPI messages (``mpisync.runtime.shm``;
            default True; ``MPISYNC_SHARED_MEMORY=0`` turns it off for every optimizer).
            Not with a ``wire_dtype`` or ``num_tokens``: those pairs use MPI messages.
        stats_log: where ps 0 writes the statistics log, one JSON line per global step
            (read it with ``python -m mpisync.stats``); default: ``MPISYNC_STATS`` (the
            optimizers created after the first one write ``<stem>.opt<k><suffix>``);
            ``False``: none. The chief's value counts.
        nonfinite: what a step whose averaged gradient holds NaN or Inf does (checked on
            the ps ranks, for the parameters they hold, not the rows of tables):
            ``"raise"`` (default: a ``NonFiniteError`` naming the parameter and the
            workers whose gradients were not finite ends the job; the step is not applied)
            or ``"skip"`` (one ps rank only: the step leaves the parameters and the
            optimizer state as they were, as a loop that skips ``optimizer.step()`` for
            that batch; the global step still counts it, and
            ``stats["steps_skipped_nonfinite"]`` lists it; not with ``dense="allreduce"``,
            where the workers check the gradients they averaged and raise).
        colocate: groups of names whose parameters (or buffers, or single shards
            ``"name/part_k"``, or globs: ``"enc.*"``) must live on the same ps rank, as
            TensorFlow's ``colocate_vars_with``: ``[["enc.weight", "enc.bias"], ...]``. Every placement
            strategy honours them (``print(opt.plan)`` marks each group); partitioned
            parameters and tables are colocated shard by shard (see
            ``mpisync.protocol.routes.colocated_units``). A name that no ps holds, or that is in two
            groups, is an error on every worker.
        max_ps_bytes: the most bytes of parameters, buffers and table shards one ps rank
            may hold (``mpisync.placement.plan``): a colocated group larger than that, or a
            placement that puts more on a ps, is an error on every worker at set-up.

    Example::

        cluster = mpisync.init(num_ps=2)              # every rank
        if cluster.is_ps:
            cluster.serve()                           # until the workers leave
        else:
            model = Net()
            opt = mpisync.SyncReplicasOptimizer(
                torch.optim.Adam(model.parameters(), lr=1e-3),
                named_parameters=model.named_parameters(),
                replicas_to_aggregate=4, total_num_replicas=5,   # one backup worker
                cluster=cluster)
            for x, y in loader:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()                            # push, wait for the token, pull
            opt.close()                               # every worker
    """

    # torch.amp.GradScaler then calls step() itself (found_inf set) instead of skipping it
    # on this worker alone; step() refuses it (mpisync.worker.refusals.refuse_grad_scaler)
    _step_supports_amp_scaling = True
    _mpisync_wrapper = True   # what refuses a SyncReplicasOptimizer given to another one

    def __init__(self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 replicas_to_aggregate: int | None = None,
                 total_num_replicas: int | None = None,
                 num_tokens: int | None = None,
                 placement: str | Callable = "greedy_sorted",
                 cluster: Cluster | None = None, reduction: str = "mean", deterministic: bool = False,
                 ema_decay: float | None = None, ema_num_updates: bool = False,
                 asynchronous: bool = False, max_staleness: int | None = None,
                 named_buffers: Iterable[tuple[str, torch.Tensor]] | None = None,
                 buffers: str = "broadcast", schedule: str = "auto",
                 partitioner: PartitionerSpec = None,
                 sparse_reduction: str = "mean", dense: str = "ps",
                 allreduce_backend: str = "auto", bucket_bytes: int | None = None,
                 wire_dtype: torch.dtype | str | None = None, shared_memory: bool = True,
                 stats_log: str | bool | None = None, nonfinite: str = "raise",
                 colocate: Iterable[Sequence[str]] | None = None,
                 max_ps_bytes: int | None = None) -> None:
        from .ps_ranks import _current
        self.cluster = cluster = worker_cluster(_current if cluster is None else cluster)
        self._ready = self.closed = False    # closed: close() was called
        self._stepped = False                # a step() ran (the restarts warning's moment)
        self._resumable = False              # a Checkpointer's resume() or load() resumed it
        self._checkpointed = False           # a Checkpointer saves it
        # a weak reference to the Checkpointer that reads the tables' changed rows
        self._changes_owner: Callable[[], Any] | None = None
        self._writing: Any = None            # the chief's checkpoint file being written aside
        problem = None
        if isinstance(optimizer, (list, tuple)):   # several: joined, refused on every rank
            named_parameters = list(named_parameters)
            problem = joint_problem(optimizer, named_parameters)
            if problem is None:
                optimizer = JointOptimizer(optimizer)
        optimizer = cast(torch.optim.Optimizer, optimizer)   # a list only where refused
        self.wrapped = optimizer             # the torch optimizer given (same param groups)
        self._given = inners(optimizer)      # it, or the optimizers joined in it
        options = Options(replicas_to_aggregate, total_num_replicas, num_tokens, placement,
                          reduction, deterministic, ema_decay, ema_num_updates, asynchronous,
                          max_staleness, buffers, schedule, partitioner, sparse_reduction,
                          dense, allreduce_backend, bucket_bytes, nonfinite,
                          colocate=colocate or (), max_ps_bytes=max_ps_bytes,
                          wire_dtype=wire_dtype,
                          # shared memory waits for workers to copy: not where one may die
                          shared_memory=shared_memory if cluster.losses is None else False)
        self._hooks = TorchHooks()      # given back by close(), or now if set-up fails
        with self._hooks.removed_on_error():   # set-up: agree on the spec, open the channels
            self._poller = Poller(cluster.p2p_comm, cluster.timeout, cluster.label,
                                  spin_seconds(cluster.oversubscribed), cluster.losses)
            opt_id = len(cluster.optimizers)
            self._stats_log = log_path(stats_log, opt_id)
            model, spec, routes = agreed_setup(optimizer, named_parameters, named_buffers,
                                               options, cluster, opt_id, self._stats_log,
                                               problem)
            self._names = [n for n, _ in model.params]
            self._params = [p for _, p in model.params]
            self._spec, self.plan = spec, routes.plan
            torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
            self.param_groups = optimizer.param_groups    # shared: schedulers edit them
            self.defaults = optimizer.defaults
            parts = self._parts = WorkerParts(spec, routes, cluster, model, self._poller,
                                              optimizer, lambda: self.param_groups,
                                              options.schedule)
            self._dense, self._rows, self._cycle = parts.dense, parts.rows, parts.cycle
            self._mpisync_schedules = parts.schedules     # what schedulers built over it find
            for inner in inners(optimizer) if isinstance(optimizer, JointOptimizer) else ():
                # and those built over one joined optimizer: they too follow the global
                # step and are in checkpoints (a later SyncReplicasOptimizer takes them over)
                inner._mpisync_schedules = parts.schedules  # type: ignore[attr-defined]
            cluster.optimizers.append(self)
            with self._poller.patience(SETUP_TIMEOUT):
                self._cycle.receive(count=False)
            self._rows.forget_initial()
            self._cycle.clock = for_worker(self._dense, cluster)  # statistics log or timeline
            self._ready = True
        atexit.register(self.close_at_exit)

    @property
    def global_step(self) -> int:
        """The global step whose parameters this worker holds."""
        return self._cycle.global_step

    @property
    def stopped(self) -> bool:
        """Training is over: other workers closed and no step can complete."""
        return self._cycle.stopped

    @property
    def spec(self) -> JobSpec:
        """What every rank agreed on at set-up (``mpisync.protocol.spec.JobSpec``)."""
        return self._spec

    @property
    def rows_channel(self) -> RowsChannel:
        """The channel the rows of the tables travel on (``mpisync.worker.rows``)."""
        return self._rows

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The ``(name, parameter)`` pairs of ``named_parameters``, in that order."""
        return list(zip(self._names, self._params))

    def add_param_group(self, param_group: dict) -> None:
        """Refused once wrapped: the ps ranks hold a fixed set of parameters.

        Raises:
            ConfigError: always, after construction.
        """
        if not getattr(self, "_ready", False):
            return super().add_param_group(param_group)
        refuse_add_param_group(self.cluster.label)

    def group_order(self) -> list[str]:
        """Parameter names in param-group order: how torch numbers them in a state_dict."""
        name_of = {id(p): n for n, p in zip(self._names, self._params)}
        return [name_of[id(p)] for g in self.param_groups for p in g["params"]]

    # -- the step -----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, with torch's meaning of ``set_to_none``.

        A gradient that is None stays None (torch skips that parameter, and so do the ps
        ranks). ``set_to_none=False`` zeroes the fused send buffers in place and points
        every existing ``.grad`` into them, so ``backward()`` writes straight into what
        ``step()`` sends: no copy at all. With ``set_to_none=True`` (torch's default)
        ``step()`` copies each new gradient into the send buffer once.
        """
        self._check_open("zero_grad")
        self._cycle.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Push this worker's gradients, wait for the token, pull the new parameters.

        Parameters written since the last step travel first and replace the ps ranks'
        values before the step's gradients are applied. After training is over
        (``self.stopped``: other workers closed and no step can complete) it does nothing.
        Returns the closure's loss, if a closure is given.
        """
        self._check_open("step")
        self._parts.check_groups(self.param_groups)
        if kwargs or getattr(self, "found_inf", None) is not None:
            refuse_grad_scaler(kwargs, self.cluster.label)
        if self._parts.state_io.swapped:
            refuse_step_in_averaged(self.cluster.label)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.stopped:
            self._cycle.run()
            # the torch optimizers given stepped too: as torch's schedulers' wrapper of
            # their step() would note it, so a scheduler over one of them does not warn
            # that its own step() came first
            for inner in self._given:
                if hasattr(inner.step, "_wrapped_by_lr_sched"):
                    inner._opt_called = True   # type: ignore[attr-defined]
            if not self._stepped:
                self._stepped = True
                warn_if_restarts_start_over(self)
        return loss

    # -- everything else ----------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"{self.cluster.label}: {what}() called after close()")

    def park(self, parked: bool) -> None:
        """This worker is (no longer) in a collective among the workers: it pushes nothing."""
        self._parts.link.park(parked, self._cycle.seq)   # pushes so far

    def raise_if_failed(self, call: str) -> None:
        """While in a collective: answer ps 0's question, or raise what it found."""
        self._parts.link.raise_if_failed(call)

    @property
    def stats(self) -> dict:
        """Step statistics from the coordinator, plus this worker's own figures.

        Keys: global_step, steps, gradients_applied (gradients of applied steps),
        gradients_pending (held by the open step), gradients_dropped, taken_per_worker,
        dropped_per_worker, per_step (each step's taken and dropped workers), stopped,
        workers_lost (workers that died in a job that survives them: worker, rank, host,
        the step its last gradient was computed at, and noticed_at, the time ps 0 noticed
        it, as ``time.time()``), steps_skipped_nonfinite (steps whose
        gradient held NaN or Inf, with ``nonfinite="skip"``), and
        for this worker: local_steps, token_wait_s and bytes_per_ps (bytes pushed per step
        to each ps), and of the lookups of tables during the last step, per ps:
        lookups_per_ps (messages), lookup_sent_per_ps and lookup_received_per_ps (bytes).
        After ``close()`` they are the job's final figures, the same on every worker,
        without ``per_step`` (reading them waits for the last worker's close;
        ``cluster.serve()`` returns them with ``per_step``). With ``mpisync.HashEmbedding``
        tables, ``hash_tables`` holds each one's ``admitted``, ``evicted`` and ``live`` rows
        (summed over its shards; after ``close()``, as they were when this worker closed).
        """
        own = self._cycle.own_figures(self.closed)
        stats = dict(self.final_stats()) if self.closed else self._parts.link.stats()
        return {**stats, **own}

    def table_shards(self, name: str, with_state: bool = True, changed: bool | None = None
                     ) -> Iterator[dict[str, Any]]:
        """Yield the shards of the ``mpisync.Embedding`` table ``name``, one at a time.

        Each is a dict: ``ids`` (the table rows it holds), ``weight`` (their values) and,
        with ``with_state``, ``state`` (the wrapped optimizer's state for those rows),
        read from the ps rank that holds it. Only one shard is in this worker's memory at
        a time; any worker may call it, for example the chief to export the table.

        ``changed`` is for incremental checkpoints (``mpisync.Checkpointer``'s
        ``full_every``), which rely on being its only caller: True yields only the rows
        changed since the last call with ``changed`` given (``ids``, ``at``: their places
        in the shard, ``weight``, ``per_row``: the per-row state entries' names, ``state``:
        those entries' rows and the other entries whole), False every row in that form;
        either way the ps ranks forget which rows changed. A hash table's (``changed``
        given): the rows changed, by id, as without ``changed``, with ``per_row`` and
        ``removed`` (the ids held at the last such call and evicted since; None where every
        row is given).
        """
        self._check_open("table_shards")
        yield from self._parts.tables.read(name, with_state, changed)

    def state_dict(self, tables: bool = True) -> dict:
        """The optimizer state of the whole model, as a plain torch optimizer would hold it.

        Same schema as ``torch.optim.Optimizer.state_dict()`` (parameters numbered in
        param-group order), plus an ``"mpisync"`` entry with the global step, the plan's
        digest and, with ``ema_decay``, the moving averages (``{name: tensor}``). With
        ``tables``, ``"mpisync"]["tables"]`` holds each ``mpisync.Embedding`` table
        shard by shard (see ``table_shards``): its rows and their optimizer state, read
        from the ps ranks one shard at a time; the table's stand-in parameter has no
        entry in ``"state"``.
        """
        self._check_open("state_dict")
        self._parts.check_groups(self.param_groups)
        state = self.state_and_values(tables)[0]
        if isinstance(self.wrapped, JointOptimizer):
            state["mpisync"]["optimizers"] = self.wrapped.counts()
        return state

    def state_and_values(self, tables: bool) -> tuple[dict, dict[str, torch.Tensor]]:
        """``state_dict(tables)``, and the values of the parameters the ps ranks hold, read
        at the same global step as their state."""
        return self._parts.state_io.read(self.group_order(), self.global_step, tables)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state (from ``state_dict()`` or a plain torch optimizer).

        Call on every worker at the same point: before training, or between two steps.
        No worker's gradient reaches a step before every worker holds the loaded state.
        Moving averages missing from ``state_dict`` restart from the current parameters.
        """
        self._check_open("load_state_dict")
        self._parts.check_groups(self.param_groups)
        if "param_groups" not in state_dict and "optimizers" in state_dict:
            state_dict = {**join_state_dicts(state_dict["optimizers"]),
                          **{k: v for k, v in state_dict.items() if k != "optimizers"}}
        self._parts.state_io.load(state_dict, self.param_groups, self.group_order(),
                                  self.global_step, lambda: self._cycle.receive(count=False))
        self._mpisync_schedules.rebase(self.global_step)

    def update(self, name_or_glob: str, fn: Callable | None, rows: str = "all") -> None:
        """Run ``fn`` where the parameters ``name_or_glob`` names live, after every step.

        TensorFlow's ``StrategyExtended.update``: ``fn`` changes a parameter in place (or
        returns its new value) on the ps rank that owns it, after the optimizer's step
        and before the moving averages, so that a constraint (max-norm, non-negativity,
        clipping) never needs the whole parameter on a worker; the workers get the
        constrained values with the parameters of the step. It equals
        ``optimizer.step(); fn(p)`` in one process for every parameter the glob matches
        (``fnmatch``), from the next applied step on. A partitioned parameter's or a
        table's shards each get their own rows (a row-wise ``fn`` is exact, one over the
        whole tensor is not), and ``rows="touched"`` gives a table's ``fn`` only the rows
        a step changed (after one pass over all of them): exact for row-wise constraints
        that leave a row satisfying them unchanged. See ``mpisync.protocol.updates``.

        ``fn`` must be importable where the ps ranks run: a function (or a
        ``functools.partial`` of one, or an instance of a class) defined at module
        level, not only in the workers' branch; lambdas and functions defined inside
        functions are refused. Functions run in the order registered; ``fn=None`` removes
        those registered for ``name_or_glob``. Registrations are code, not state:
        checkpoints do not hold them; register them again in a job that resumes.

        Collective: call it on every worker at the same point, with the same arguments,
        before training or between two steps (as ``load_state_dict()``).

        Raises:
            ConfigError: on every worker, when any worker's ``fn`` cannot reach the ps
                ranks or fails on a stand-in of what it gets, the glob matches nothing
                (or a parameter the optimizer does not update), or ``rows`` is unknown.
            MismatchError: on every worker, when the workers registered differently.
        """
        self._check_open("update")
        self._parts.update_fns.change(name_or_glob, fn, rows,
                                      lambda: self._cycle.receive(count=False))

    def averages(self) -> dict[str, torch.Tensor]:
        """The moving averages of the floating-point parameters, ``{name: tensor}``.

        They are those of the newest global step, in ``named_parameters`` order, pulled
        from the ps ranks (copies). Any single worker may call it, for example the chief
        before it evaluates; the others keep training meanwhile.

        Raises:
            ConfigError: the optimizer was created without ``ema_decay``.
        """
        self._check_open("averages")
        if self._spec.ema_decay is None:
            raise ConfigError(f"{self.cluster.label}: averages() needs a "
                              f"SyncReplicasOptimizer created with ema_decay")
        return self._parts.state_io.averages()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[dict[str, torch.Tensor]]:
        """Within the block the model's parameters hold their moving averages.

        For evaluation: ``with opt.averaged(): accuracy = evaluate(model)``. The parameters
        are restored when the block ends; ``step()`` inside it is an error. Yields what
        ``averages()`` returns.
        """
        averages = self.averages()
        with self._parts.state_io.swapped_in(averages):
            yield averages

    def close(self) -> None:
        """Leave the job. Call on every worker; the last one out stops the ps ranks.

        Other workers still inside ``step()`` then finish that step without this worker
        (or stop, ``opt.stopped``), so collectives among the workers are safe once every
        worker closed. ``stats`` read afterwards are the job's final figures. Parameters
        written after the last ``step()`` are not sent (warned).
        """
        if self.closed:
            return
        writing, self._writing = self._writing, None
        error = writing.wait() if writing is not None else None   # the ps ranks serve it
        try:
            self._cycle.close()
            self.closed = True
            if self._cycle.heap_held:      # kept from its first step (``StepCycle.run``)
                self._cycle.heap_held = False
                heap.let_go()
        finally:
            self._hooks.remove()
        if error:
            raise OSError(f"{self.cluster.label}: the checkpoint {error}")

    def final_stats(self) -> dict:
        """The job's final statistics, read once (after close(): every worker gets them)."""
        return self._cycle.final_stats()

    def close_at_exit(self) -> None:
        """``close()`` if still open while MPI is (at exit, or when the cluster ends)."""
        if not self.closed and MPI.Is_initialized() and not MPI.Is_finalized():
            self.close()
