"""Checkpoint files: one consolidated torch file per save, written by the chief, and resume.

A checkpoint is a zip file in torch's own format: ``torch.load(path, weights_only=True)``
reads it without mpisync. It holds a dict::

    {"format": "mpisync.checkpoint", "version": 1, "global_step": int,
     "model": model.state_dict(),          # the parameters at that step, buffers
     "optimizer": opt.state_dict(tables=False),   # torch's schema + "mpisync" entry
     "tables": {name: {"num_rows", "row_shape", "dtype", "strategy",
                       "shards": [{"ids", "weight", "state"}, ...]}},
     # a HashEmbedding's shards ("strategy": "hash") hold the rows they had, by id, and
     # "counters": {"count", "last"} per row and the shard's "clock"
     "table_index": {name: the table's number in the optimizer's state},
     "extra": the user's extra, "workers": W, "ps": P, "mpisync_version": str,
     "schedulers": [{"class", "state"}, ...],   # the schedulers the optimizer adopted
     "worker_states": [{"worker_index", "rng", "samplers"}, ...]}  # one per worker

``mpisync.resumestate`` says what the last two hold (random number generators,
``WorkerSampler`` positions, schedulers' ``state_dict()``): a resumed job draws the same
batches and random numbers as one that never stopped. A file written before they existed
loads as before.

A ``Checkpointer`` writes chains (``full_every``): a full file, then files that hold the
dense state whole but of each table on the ps ranks only the rows changed since the
previous file, which they name as their base (``mpisync.ckptchain`` says what they hold
and how a chain is merged on load).

Embedding tables that live on the ps ranks are streamed into the file one shard at a
time, never gathered whole in one process. Writes are atomic: a temporary file in the
same directory, fsync, rename, fsync of the directory; an interrupted write leaves the
previous checkpoint as it was (``mpisync.ckptfile`` writes the file and reads it back).
Loading re-places everything for the job that loads it, which may have another number of
ps ranks or workers; hash tables' rows are re-hashed into the loading job's shards, with
their optimizer state and counts (and the ids seen but not admitted yet).

Tables reshard: a job with another number of ps ranks, partitioner or partition
strategy loads them, each row moving to its new shard with its optimizer state
(``mpisync.tables.reshard`` says how per-row and per-shard state are told apart, and when
per-shard state that disagrees refuses the load). Sparse ``nn.Embedding`` weights are
whole in ``"model"`` and their state in ``"optimizer"``, re-cut like any parameter's.

Memory for tables, on the chief (no other worker touches them): saving holds one shard
at a time (received, unpickled, written: about 4 times one saved shard with its state
at the peak); loading maps the file and builds one new shard at a time (about 3 times
one new shard with its state, plus the file's pages, which the kernel may drop). A ps
rank holds its shards and about two copies of the one it sends or receives.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from mpi4py import MPI

from . import ckptchain, ckptfile, ckptfit, ckptwrite, resumestate
from .ckptchain import latest
from .ckptfile import FORMAT, VERSION
from .environ import PREEMPTED_EXIT
from .errors import ConfigError
from .plainstate import plain_state
from .runtime import stopping
from .runtime.agreement import agree
from .runtime.failures import FAILURE_DIR_ENV, write_stop
from .tables import reshard
from .tables.hashtables import place_hash_table

if TYPE_CHECKING:
    from .optimizer import SyncReplicasOptimizer

__all__ = ["FORMAT", "VERSION", "Checkpointer", "latest", "load", "plain_state", "save"]



# -- save ----------------------------------------------------------------------------------
def save(path: str | os.PathLike, model: torch.nn.Module, opt: SyncReplicasOptimizer,
         extra: Any = None) -> str:
    """Write a checkpoint of ``model`` and ``opt`` at the current global step.

    Call on every worker, between steps (a collective over the workers); the chief
    writes the file, the others wait for it (a ``Checkpointer`` writes its files beside
    training instead; one it is writing is finished first). ``extra`` is anything
    ``torch.load(..., weights_only=True)`` reads back: numbers, strings, tensors, lists,
    dicts (an epoch, a data-loader position).

    Saved without being asked, for ``load`` to restore: every worker's random number
    generators (torch's CPU one, CUDA's if initialised, NumPy's global one, Python's
    ``random``) and the ``state_dict()`` of its live ``mpisync.WorkerSampler`` objects,
    gathered to the chief; and the ``state_dict()`` of every scheduler built over ``opt``.

    Returns:
        The path written.

    Raises:
        OSError: the chief could not write the file, or a Checkpointer's file it was
            writing (on every worker; nothing changed).
    """
    path = os.fspath(path)
    _settle_writing(opt, "mpisync.save()")
    _save(path, model, opt, extra, None)
    return path


def _settle_writing(opt, where: str) -> None:
    """Wait for the checkpoint file the chief writes beside training, if any (every worker,
    a collective); an OSError on every worker when it could not be written."""
    cluster = opt.cluster
    writing, opt._writing = opt._writing, None
    error = writing.wait() if writing is not None else None
    if error:
        writing.owner._chain = []       # the ps ranks' marks are gone: the next one is full
    agree(cluster.worker_comm, error, lambda errors: errors[0] and OSError(
        f"{cluster.label}: {where}: the checkpoint {errors[0]} (on the chief)"))


def _save(path: str, model, opt, extra, chain: tuple | None, aside: bool = False
          ) -> ckptwrite.Writing | None:
    """``save``; ``chain``, for a Checkpointer: (changed, base file, base id, this file's
    id), ``changed`` as ``table_shards`` takes it (False: full, the ps ranks' marks
    cleared; True: incremental over the base). With ``aside`` the chief's file is to be
    written while training goes on: the returned ``Writing`` (the chief's; None on the
    others; ``start()`` it), whose failure a Checkpointer reports later; the workers wait
    only for the dense state and the ps ranks' snapshot of the tables."""
    cluster = opt.cluster
    error, writing = None, None
    worker_states = cluster.worker_comm.gather(
        resumestate.capture_worker(cluster.worker_index), root=0)
    if cluster.is_chief:
        try:
            writing = ckptwrite.begin(path, model, opt, extra, worker_states, chain, aside)
            if not aside:
                writing.run()
                error, writing = writing.error, None
        except Exception as exc:  # noqa: BLE001 (every worker raises it below)
            error = f"{type(exc).__name__}: {exc}"
    agree(cluster.worker_comm, error, lambda errors: errors[0] and OSError(
        f"{cluster.label}: mpisync.save({path!r}) failed on the chief: {errors[0]}"))
    return writing


# -- load ----------------------------------------------------------------------------------
def _verdict(path: str, model, opt) -> tuple[tuple, dict | None]:
    """The chief's verdict on the file at ``path``, for every worker; it never raises.

    Returns:
        ``((None, model state, optimizer state, extra, schedulers), the checkpoint)`` to
        load it (``schedulers`` None in a file without them), or
        ``((what is wrong with it, naming the file,), None)``.
    """
    try:
        ck = ckptfile.read(path)
        files = ckptchain.chain(path, ck)     # an incremental file's bases, checked
    except (OSError, ValueError) as exc:      # its refusals of the file name the file
        return (str(exc),), None
    except Exception as exc:  # noqa: BLE001 (a malformed file: every worker raises it)
        return (ckptfile.malformed(path, exc),), None
    try:
        if len(files) > 1:                    # its tables merged shard by shard, as read
            ck = dict(ck, tables=ckptchain.merged_tables(files))
        problem = ckptfit.fits(ck, model, opt)
    except Exception as exc:  # noqa: BLE001 (a malformed file can make any check raise)
        return (ckptfile.malformed(path, exc),), None
    if problem:
        return (f"{path}: {problem}",), None
    return (None, ck["model"], _without_tables(ck["optimizer"]), ck.get("extra"),
            ck.get("schedulers")), ck


def load(path: str | os.PathLike, model: torch.nn.Module, opt: SyncReplicasOptimizer) -> Any:
    """Load a checkpoint written by ``save`` into ``model`` and ``opt``; returns ``extra``.

    Call on every worker, before training or between steps. The chief reads the file
    and checks it against the model and the optimizer before anything changes; a file
    that is truncated, malformed (an entry missing or of the wrong kind), of another
    model, or of a newer format raises the same error on every worker, naming the file
    and the problem, and nothing is loaded. Parameters, buffers, optimizer state, moving
    averages, the global step and the tables are then placed for this job (any number of
    ps ranks and workers).

    Then what ``save`` saved without being asked is restored, where the file has it: the
    state of each scheduler built over ``opt`` (build them, in the same order, before
    loading), and on every worker its own random number generators and the positions of
    its live ``WorkerSampler`` objects (built before loading, in the same order). A job
    with another number of workers than the saved one restores the schedulers only, and
    the chief warns that the per-worker states were left out.

    Raises:
        ConfigError: the file cannot be loaded into this model and optimizer.
    """
    path = os.fspath(path)
    cluster = opt.cluster
    opt._resumable = True              # resumed by hand: no warning under --restarts
    _settle_writing(opt, "mpisync.load()")
    payload, ck = None, None
    if cluster.is_chief:
        payload, ck = _verdict(path, model, opt)
    payload = cluster.worker_comm.bcast(payload, root=0)
    if payload[0] is not None:
        raise ConfigError(f"{cluster.label}: mpisync.load(): {payload[0]}", collective=True)
    _, model_state, opt_state, extra, schedulers = payload
    model.load_state_dict(model_state)
    if cluster.is_chief:
        assert ck is not None            # the chief's verdict was to load it
        _place_tables(ck["tables"], opt)
    opt.load_state_dict(opt_state)
    if schedulers is not None:
        resumestate.restore_schedulers(opt, schedulers, cluster.label)
    entries = _worker_entries(ck, path, cluster) if cluster.is_chief else None
    entry = cluster.worker_comm.scatter(entries, root=0)
    if entry is not None:
        resumestate.restore_worker(entry, cluster.label)
    return extra


def _worker_entries(ck: dict | None, path: str, cluster) -> list:
    """The chief's list for the scatter of the saved per-worker states: one per worker,
    or Nones (a file without them, or saved by another number of workers: a warning)."""
    assert ck is not None
    saved = ck.get("worker_states")
    if isinstance(saved, list) and len(saved) == cluster.num_workers:
        if all(isinstance(e, dict) and isinstance(e.get("rng"), dict) for e in saved):
            return saved
        warnings.warn(f"{cluster.label}: {path}: malformed per-worker states, not "
                      f"restored", stacklevel=3)
        return [None] * cluster.num_workers
    if saved is not None:
        warnings.warn(f"{cluster.label}: {path} was saved by {ck.get('workers')} workers, this "
                      f"job has {cluster.num_workers}: the schedulers are restored, the "
                      f"per-worker states (random number generators, WorkerSampler "
                      f"positions) are not", stacklevel=3)
    return [None] * cluster.num_workers


def _without_tables(state: dict) -> dict:
    state = dict(state)
    if "mpisync" in state:
        state["mpisync"] = {k: v for k, v in state["mpisync"].items() if k != "tables"}
    return state


def _place_tables(saved: dict, opt) -> None:
    """Each table shard of this job, built from the saved shards (any partitioning).

    On the chief, one new shard at a time: see ``mpisync.tables.reshard`` for how rows and
    their optimizer state move and what is held meanwhile.
    """
    for t in opt.spec.tables:
        if t.hashed is not None:
            place_hash_table(saved[t.name]["shards"], t, opt.rows_channel)
            continue
        if not t.resident:
            continue
        table = saved[t.name]
        from_shards, _ = reshard.sources(table, t)
        unread = ckptfit.unread(opt, t.name)
        for k in range(t.num_shards):
            weight, state = reshard.new_shard(table, t, k, from_shards[k], unread)
            opt.rows_channel.write_shard(t.name, k, weight, state)
            del weight, state             # one new shard in memory at a time


# -- periodic checkpoints ------------------------------------------------------------------
def _lockstep(opt) -> bool:
    """Whether every worker's ``step()`` is one global step (strict synchronous training),
    so that the workers call ``maybe_save()`` equally often."""
    spec = opt.spec
    return spec.replicas_to_aggregate == spec.num_workers and not spec.asynchronous


class Checkpointer:
    """Periodic checkpoints ``ckpt-<global step>.pt`` in a directory, the newest ``keep``.

    ``maybe_save()`` after each ``step()``, on every worker: it saves when
    ``every_steps`` global steps passed since the last save, or (the chief's clock)
    ``every_seconds``; with ``every_seconds`` each call is a small collective over the
    workers, so that they agree. ``resume()`` loads the newest complete checkpoint, if
    there is one, and returns its ``extra`` (None otherwise): with the model and the
    optimizer it restores the schedulers built over the optimizer, every worker's random
    number generators and its ``WorkerSampler`` positions (see ``load``), so build those
    before calling it; a job resumed so draws the same batches and random numbers as
    one that never stopped.

    Preemption and time limits: a worker's Checkpointer (made in the main thread) installs
    flag-only handlers for SIGTERM, SIGUSR1 and SIGUSR2 until the optimizer closes. When
    any worker got one, the next ``maybe_save()`` saves on every worker, closes the
    optimizer and raises ``SystemExit(mpisync.environ.PREEMPTED_EXIT)`` (75) on every
    worker; the chief says so in one line. ``maybe_save()`` is then one small collective
    over the workers per call. With backup workers, K-batch or asynchronous updates a
    worker's ``step()`` calls do not line up with the others', so without
    ``every_seconds`` the workers meet only where ``every_steps`` makes a checkpoint due:
    a signal takes effect there.

    Written while training goes on: a save holds the workers while the chief reads the
    dense state and the ps ranks take a snapshot of the tables (copy on write, row by
    row, ``mpisync.ps.snapshot``); the chief writes the file on a thread while every
    worker trains on. ``maybe_save()`` and ``save()`` return the path the file will have;
    ``wait()`` returns once it is written, and the next save, ``resume()``,
    ``mpisync.load``, ``mpisync.save`` and ``opt.close()`` wait for it first. A failed
    write is raised as an ``OSError`` naming the file on every worker at the next
    ``maybe_save()`` that meets the others, ``save()``, ``wait()`` or ``resume()`` (on
    the chief at ``opt.close()``), and the next file is full. Under an MPI without
    ``MPI_THREAD_MULTIPLE`` the file is written before ``save()`` returns.

    A file is written beside its final name and renamed when complete, so a kill mid-write
    never leaves a broken checkpoint; the chief's Checkpointer removes, when made, the
    partial files that a writer on its host killed mid-write left in ``directory``.

    Incremental checkpoints: a file holds the dense state (model, optimizer state,
    schedulers, per-worker states) whole, but of each table that lives on the ps ranks
    (``mpisync.Embedding``, ``mpisync.EmbeddingBag``) only the rows that changed since
    the previous file (their ids, values and optimizer state; a shard's non-row state
    such as a ``step`` whole), and names that file as its base (``mpisync.ckptchain``).
    Every ``full_every``-th file of a chain is full; so is the first save of a
    Checkpointer, one after ``resume()`` and one after a failed save. A row counts as
    changed when a step updated it (every row of a shard whose optimizer steps its dense
    gradient: weight decay, momentum), an ``opt.update`` function over all rows ran, or
    the table was loaded or written; of a hash table (``mpisync.HashEmbedding``,
    ``HashEmbeddingBag``), the rows whose values, state or counts changed (each id a
    lookup sighted), by id, and the ids evicted since. ``load``, ``resume`` and
    ``plain_state`` follow the chain and restore what a full file of the same step
    restores, bitwise; ``latest`` passes over a file whose chain is not all there;
    ``keep`` never removes a base that a kept file needs. The first Checkpointer made over
    an optimizer reads which rows changed (the ps ranks forget them as it reads them);
    another one over the same optimizer (a second directory, say for the best model)
    writes full files only, so that neither's files miss rows.

    Args:
        directory: where the checkpoints are written (by the chief) and looked for.
        model: the model whose parameters and buffers are saved and loaded.
        opt: the ``SyncReplicasOptimizer`` training ``model``.
        keep: how many of the newest checkpoints up to the step saved to keep (default:
            all), and the older files their chains need; files of later steps are left
            alone.
        every_steps: save when the global step passes a multiple of it.
        every_seconds: save when this many seconds passed on the chief since the last save.
        full_every: every how many files a chain starts again with a full one (default
            8; 1: every file full).

    Raises:
        ValueError: ``keep``, ``every_steps`` or ``full_every`` not a positive int,
            ``every_seconds`` not above 0 (on the worker that passed it).

    Example::

        ckpt = mpisync.Checkpointer("ckpt", model, opt, keep=3, every_steps=500,
                                    full_every=8)
        start_epoch = ckpt.resume() or 0        # every worker
        for epoch in range(start_epoch, epochs):
            for x, y in loader:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                ckpt.maybe_save(extra=epoch)    # every worker, after each step
    """

    def __init__(self, directory: str | os.PathLike, model: torch.nn.Module,
                 opt: SyncReplicasOptimizer, *,
                 keep: int | None = None, every_steps: int | None = None,
                 every_seconds: float | None = None, full_every: int = 8) -> None:
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {full_every!r}")
        for name, value in (("keep", keep), ("every_steps", every_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0 or None, got {every_seconds!r}")
        self.directory = os.fspath(directory)
        self.model, self.opt = model, opt
        self.keep, self.every_steps, self.every_seconds = keep, every_steps, every_seconds
        self.full_every = full_every
        self._chain: list[str] = []     # the files of the current chain: none, next full
        self._last_id: str | None = None
        self.last_step = opt.global_step
        self.last_time = time.monotonic()
        opt._checkpointed = True       # a warning under --restarts unless resume() is called
        if opt.cluster.is_chief:       # what a chief killed mid-write left (it writes)
            ckptfile.remove_stale_temporaries(self.directory)
        # the ps ranks keep one record of the rows changed since the last incremental file:
        # the first Checkpointer alive over ``opt`` owns it, any other writes full files
        if opt._changes_owner is None or opt._changes_owner() is None:
            opt._changes_owner = weakref.ref(self)
        if not opt.closed and stopping.install():     # until the optimizer closes
            opt._hooks.on_remove(stopping.release)

    def path(self, step: int) -> str:
        """The file of the checkpoint at global step ``step``: ``<directory>/ckpt-<step>.pt``
        (the step written with nine digits, so that the names sort by step). Local."""
        return os.path.join(self.directory, f"ckpt-{step:09d}.pt")

    def due(self) -> bool:
        """Whether a checkpoint is due now: ``every_steps`` global steps passed since the
        last save (or load), or the chief's clock says ``every_seconds`` did.

        A collective over the workers (the chief's answer is broadcast, so every worker
        saves or none does): call it on every worker, as ``maybe_save()`` does.
        """
        return self._agree()[0]

    def _agree(self) -> tuple[bool, int | None]:
        """(due, the signal a worker got or None), agreed by the workers in one gather."""
        step = self.opt.global_step
        due = self.every_steps is not None and step // self.every_steps > \
            self.last_step // self.every_steps
        if self.every_seconds is not None:
            due = due or time.monotonic() - self.last_time >= self.every_seconds
        elif not due and not _lockstep(self.opt):
            # backup workers, K-batch or asynchronous: workers' step() calls do not line
            # up, so they meet only where a checkpoint is due (each reaches it once)
            return False, None
        writing = self.opt._writing      # the chief's, aside: failed already?
        failed = writing is not None and writing.done and writing.failure is not None
        said = self.opt.cluster.worker_comm.allgather((due, stopping.received(), failed))
        if said[0][2]:
            _settle_writing(self.opt, "Checkpointer.maybe_save()")     # raises on every worker
        return said[0][0], next((s for _, s, _ in said if s is not None), None)

    def maybe_save(self, extra: Any = None) -> str | None:
        """Save if one is due (call on every worker after each step); the path or None.

        None, and nothing asked of the other workers, once ``opt.stopped`` (workers that
        closed before this one can join no save: in strict synchronous training, uneven
        data ends the loop on its own; with backup workers the others train on without
        the closed ones, and a save they are due then is a ``DeadlockError`` naming them).

        Raises:
            SystemExit: ``PREEMPTED_EXIT`` on every worker, once a worker was sent SIGTERM,
                SIGUSR1 or SIGUSR2: after saving (the file written) and closing the
                optimizer.
            OSError: on every worker, when the chief could not write an earlier file.
        """
        if self.opt.stopped:
            return None
        due, signum = self._agree()
        if signum is None:
            return self.save(extra) if due else None
        stopping.ignore_from_now()      # stopping: a second signal must not end a rank now
        path, step = self.save(extra), self.opt.global_step
        self.wait()
        self.opt.close()
        if self.opt.cluster.is_chief:
            print(f"mpisync: stopped by {signal.Signals(signum).name} at global step "
                  f"{step}; checkpoint {path}; exit status {PREEMPTED_EXIT}",
                  file=sys.stderr, flush=True)
            where = os.environ.get(FAILURE_DIR_ENV)
            if where:                   # python -m mpisync.launch --restarts: start again
                write_stop(where, step)
        raise SystemExit(PREEMPTED_EXIT)

    def save(self, extra: Any = None) -> str:
        """Save now (every worker); the path. Incremental unless this file is to be full
        (``full_every``). The workers wait for the dense state and the ps ranks' snapshot
        of the tables; the chief writes the file while training goes on, then removes all
        but the newest ``keep`` and the files their chains need (see the class)."""
        _settle_writing(self.opt, "Checkpointer.save()")
        step = self.opt.global_step
        path = self.path(step)
        tables = any(t.resident for t in self.opt.spec.tables)
        owner = self.opt._changes_owner
        if owner is None or owner() is None:       # the owner is gone: this one takes over
            owner = self.opt._changes_owner = weakref.ref(self)
            self._chain = []
        owns = owner() is self
        incremental = (tables and owns and 0 < len(self._chain) < self.full_every
                       and path not in self._chain)
        file_id = ckptchain.file_id()
        chain = ((True, self._chain[-1], self._last_id, file_id) if incremental
                 else (False if tables and owns else None, None, None, file_id))
        try:
            writing = _save(path, self.model, self.opt, extra, chain,
                            aside=MPI.Query_thread() >= MPI.THREAD_MULTIPLE)
        except BaseException:
            self._chain = []            # the ps ranks' marks may be gone: the next is full
            raise
        if writing is not None:         # the chief: the file is to be written aside
            writing.owner, writing.then = self, lambda: self._prune(step)
            self.opt._writing = writing
            writing.start()
        elif self.opt.cluster.is_chief:  # written (MPI without threads: at once)
            self._prune(step)
        self._chain = [*self._chain, path] if incremental else [path]
        self._last_id = file_id
        self.last_step, self.last_time = step, time.monotonic()
        return path

    def wait(self) -> None:
        """Wait until the chief has written the last checkpoint (every worker).

        Raises:
            OSError: on every worker, when it could not be written.
        """
        _settle_writing(self.opt, "Checkpointer.wait()")

    def _prune(self, step: int) -> None:
        """On the chief, once the file of ``step`` is written: remove all but the newest
        ``keep`` up to it and the files their chains need."""
        if self.keep is None:
            return
        # the newest up to this step: a file of a later step (a run that went further,
        # a file cut short that resume() passed over) is neither counted nor removed,
        # so that it never crowds out the file just written
        listed = [(s, p) for s, p in ckptchain.listed(self.directory) if s <= step]
        needed = {os.path.abspath(p) for _, newer in listed[-self.keep:]
                  for p in ckptchain.needed(newer)}
        for _, old in listed[:-self.keep]:
            if os.path.abspath(old) not in needed:
                with contextlib.suppress(OSError):
                    os.unlink(old)

    def resume(self) -> Any:
        """Load the newest complete checkpoint, if any (every worker); its ``extra``.

        Newer checkpoint files that cannot be loaded (cut short, or an incremental one
        whose chain of bases is broken) are passed over with a warning that names them and
        why.

        Raises:
            ConfigError: on every worker, when the directory holds checkpoints but none
                that loads, and one of them is whole but its chain is broken or torch
                cannot read it back (each named, with why): the job would otherwise start
                again from step 0 and in time write over them. Files cut short alone hold
                nothing to resume from: the job starts from step 0 (warned).
        """
        self.opt._resumable = True     # no warning under --restarts (resumestate)
        _settle_writing(self.opt, "Checkpointer.resume()")
        found = passed = None
        refuse = False
        if self.opt.cluster.is_chief:
            found, passed, refuse = ckptchain.newest_loadable(self.directory)
        found, passed, refuse = self.opt.cluster.worker_comm.bcast((found, passed, refuse),
                                                                   root=0)
        if passed and self.opt.cluster.is_chief and not refuse:
            warnings.warn(f"{self.opt.cluster.label}: Checkpointer.resume(): passed over "
                          f"{passed}", RuntimeWarning, stacklevel=2)
        if refuse:
            raise ConfigError(
                f"{self.opt.cluster.label}: Checkpointer.resume(): {self.directory} holds "
                f"checkpoints but none can be loaded ({passed}); starting from step 0 would "
                f"write over them: move them away, or give another directory, to start "
                f"afresh", collective=True)
        if found is None:
            return None
        extra = load(found, self.model, self.opt)
        self._chain = []                # the next save is full
        self.last_step, self.last_time = self.opt.global_step, time.monotonic()
        return extra
