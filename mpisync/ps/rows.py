"""One ps rank's table shards: lookups, sparse accumulation, changed rows, shard reads."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ..accumulate import reduce_rows
from ..errors import ProtocolError
from ..native import kernels
from ..observe import timeline
from ..protocol import pooled
from ..protocol.rowsmsg import absent_parts, pack_rows, unpack_rows
from ..protocol.spec import JobSpec
from ..protocol.wire import ROWS_HEAD, RowsField, Tag, pad8, rows_mark
from ..runtime import heap
from ..runtime.progress import Poller
from ..tables.rowopt import RowScratch, apply_rows, handles_rows, merge_rows
from .changes import state_of
from .rowunits import Pending, Unit, frozen, place, takes_sparse, without_zeros

__all__ = ["RowShards", "takes_sparse"]

_SEED_STRIDE = 1_000_003


class Taken(list):
    """A push's pieces, one a unit here (``(ids, rows, bags)``), and ``had[n]``: whether its
    table had a gradient in the push (rows of other shards, if not here)."""

    __slots__ = ("had",)


class RowShards:
    """The table shards of one optimizer on one ps rank.

    Each push of a worker is followed by one rows message (tag SPARSE) with the rows its
    gradient touched in every shard here; ``attach`` pairs them in order, and a step
    reduces the taken ones (sum divided by their number, or per row) into a sparse
    gradient, or straight into the rows when ``rowopt.apply_rows`` handles the optimizer
    (then ``apply_rows()`` after the optimizer's step updates them in one vectorised pass,
    bitwise as torch's sparse step would). Lookups are answered at once with the current
    rows. For the sparse
    ``nn.Embedding`` weights that workers hold whole, each worker is sent the rows that
    changed since it last received any, with its parameters.
    """

    def __init__(self, spec: JobSpec, ps_index: int, worker_ranks: tuple[int, ...],
                 comm: MPI.Comm, poller: Poller, label: str):
        self.spec = spec
        self.comm = comm
        self.poller = poller
        self.label = label
        self.worker_ranks = worker_ranks
        self.W = len(worker_ranks)
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.SPARSE, Tag.LOOKUP, Tag.ROWS,
                                                           Tag.CHANGED, Tag.TABLE, Tag.INIT)}
        self.units: list[Unit] = []
        for t in spec.tables:
            for k, owner in enumerate(t.owners):
                if owner == ps_index:
                    rows = kernels.table_zeros((t.shard_rows[k], *t.row_shape), t.dtype)
                    self.units.append(Unit(t, k, torch.nn.Parameter(rows), label))
        self.kinds = [(u.spec.dtype, u.spec.row_shape) for u in self.units]
        names = [u.spec.name for u in self.units]
        self.groups = [names.index(n) for n in names]      # the table of each unit
        self.replicated = any(not u.spec.resident for u in self.units)   # workers hold them
        self.by_unit = {u.unit: u for u in self.units}
        self.arrived: list[deque] = [deque() for _ in range(self.W)]
        self.claims: list[deque] = [deque() for _ in range(self.W)]
        self.discard = [0] * self.W
        self.unseen: list[list[list[np.ndarray]]] = [[[] for _ in self.units]
                                                     for _ in range(self.W)]
        # each worker's last pooled lookup here, [seq, its pooled parts] (checked): what a
        # push that names it pools (``pooled.bag_grads``)
        self.last_lookup: list[list] = [[] for _ in range(self.W)]
        self.changed: list[list] = [[None] * len(self.units) for _ in range(self.W)]
        self.full = [True] * self.W        # every worker gets whole shards first
        self.sends: list[tuple[MPI.Request, object]] = []
        self.bytes_in = self.bytes_out = 0      # rows messages, for the statistics log
        self.pending: list[Pending] = []       # row updates for settle()
        self.step_rows: list = [None] * len(self.units)    # rows the last step changed
        self.optimizer = None
        self.snaps: dict = {}                   # a checkpoint's snapshot, by unit not read yet
        self.may_settle = lambda: True          # whether an idle poll may settle
        self.scratch = RowScratch()             # the update's temporaries
        if self.units:
            torch.sparse.check_sparse_tensor_invariants.disable()   # built here, coalesced
            heap.keep()             # each step's messages too: no fresh pages

    @property
    def active(self) -> bool:
        return bool(self.units)

    def params_by_name(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for u in self.units:
            out.setdefault(u.spec.name, []).append(u.param)
        return out

    def names(self) -> dict[int, str]:
        return {id(u.param): u.unit for u in self.units}

    def place_state(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The state an optimizer made for the shards when built (torch's Adagrad makes
        its sums then, in the heap) moved into ``kernels.table_zeros``' memory, which the
        row kernels reach at random as they do the shards: huge pages, fewer TLB misses."""
        if optimizer is None:
            return
        moved = False
        for u in self.units:
            if u.param in optimizer.state:
                moved |= place(optimizer.state[u.param], u.param.shape)
        if moved:
            heap.release()          # the heap's copies go back to the kernel

    def resident_units(self) -> set[str]:
        return {u.unit for u in self.units if u.spec.resident}

    # -- set-up ---------------------------------------------------------------------------
    def receive_initial(self, chief_rank: int) -> None:
        """Rows from the chief (given values), or drawn here from the table's seed."""
        for t in self.spec.tables:       # in the chief's sending order
            for u in [u for u in self.units if u.spec is t]:
                if u.hashed is not None:
                    continue            # rows are drawn as their ids are admitted
                if t.seed is None:
                    data = u.param.detach()
                    req = self.comm.Irecv([data.view(torch.uint8).numpy(), MPI.BYTE],
                                          source=chief_rank, tag=self.tags[Tag.INIT])
                    self.poller.wait_all([req], lambda t=t: f"the initial rows of {t.name!r}")
                    continue
                g = torch.Generator().manual_seed(t.seed * _SEED_STRIDE + u.k)
                with torch.no_grad():
                    u.param.normal_(generator=g)
                    if t.padding_idx is not None:
                        shard, local = t.locate(torch.tensor([t.padding_idx]))
                        if int(shard) == u.k:
                            u.param[int(local)] = 0

    # -- receiving ------------------------------------------------------------------------
    def poll(self) -> bool:
        """Receive row gradients and answer lookups; True if anything arrived.

        The last step's row updates are made first (``settle``), unless ``may_settle()``
        says to wait (ps 0 waits until the step's tokens are out) and nothing arrived that
        needs them."""
        if self.pending and self.may_settle():
            self.settle()
        progressed = False
        status = MPI.Status()
        while True:
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=self.tags[Tag.SPARSE],
                                    status=status)
            if msg is None:
                break
            self.settle()
            self._on_rows(self._recv(msg, status), self.worker_ranks.index(status.Get_source()))
            progressed = True
        replies = []         # sent once every waiting lookup is answered (``_answer_lookup``)
        while True:
            msg = self._probe(Tag.LOOKUP, status, twice=bool(replies))
            if msg is None:
                break
            self.settle()
            buf, rank = self._recv(msg, status), status.Get_source()
            answer = self._answer_exchange if rows_mark(buf) == pooled.EXCHANGE else \
                self._answer_lookup
            replies.append((answer(buf, rank), rank))
            progressed = True
        for reply, rank in replies:
            self._send(reply, rank, self.tags[Tag.ROWS])
        self._reap()
        return progressed

    def _probe(self, tag: int, status: MPI.Status, twice: bool = False):
        """A message of ``tag`` waiting here, or None. ``twice``: probe once more before
        None, since a probe's progress may only bring in a large message's envelope for
        the next one to find (MPICH: a lookup that came during the last answer)."""
        for _ in range(2 if twice else 1):
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=self.tags[tag], status=status)
            if msg is not None:
                return msg
        return None

    def _recv(self, msg, status: MPI.Status) -> np.ndarray:
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        msg.Recv([buf, MPI.BYTE])
        self.bytes_in += buf.nbytes
        return buf

    def _on_rows(self, buf: np.ndarray, w: int) -> None:
        # the ids of hash shards that read as zeros in this worker's lookups since its last
        # push (every one of them came before this push): their gradients are dropped
        unseen, self.unseen[w] = self.unseen[w], [[] for _ in self.units]
        if self.discard[w]:
            self.discard[w] -= 1
            return
        try:
            end = pooled.rows_section_nbytes(buf, self.kinds)
            rows = unpack_rows(buf[:end], self.kinds, with_ids=True)[2]
            bags = [None] * len(rows)
            if end < buf.nbytes:             # bags pooled here: their gradients, checked
                bags = pooled.bag_grads(buf, end, [u.param for u in self.units], self.groups,
                                        self.last_lookup[w])
        except ValueError as exc:
            raise ProtocolError(f"{self.label}: worker {w} sent table rows: {exc}") from None
        parts = Taken((ids, values, bag) if not zeros else without_zeros(ids, values, zeros)
                      for (ids, values), bag, zeros in zip(rows, bags, unseen))
        parts.had = [not a for a in absent_parts(buf)]
        if self.claims[w]:
            slot = self.claims[w].popleft()
            slot.rows, slot.waiting_rows = parts, False
        else:
            self.arrived[w].append(parts)

    def attach(self, slot) -> None:
        """A push arrived: pair it with its rows message (now, or when that arrives)."""
        w = slot.worker
        if self.arrived[w]:
            slot.rows, slot.waiting_rows = self.arrived[w].popleft(), False
        else:
            slot.rows, slot.waiting_rows = None, True
            self.claims[w].append(slot)

    def release(self, slot) -> None:
        """A push no step will take: its rows message is dropped whenever it comes."""
        if slot.waiting_rows:
            self.claims[slot.worker].remove(slot)
            self.discard[slot.worker] += 1
            slot.waiting_rows = False
        slot.rows = None

    def _answer_lookup(self, buf: np.ndarray, rank: int) -> np.ndarray:
        """The reply to a lookup: the rows of each part's ids, gathered straight into it
        (``pack_rows``'s layout, values only).

        ``poll`` sends the replies to the lookups that were waiting only once it has
        answered them all: a worker given its rows computes on a core the ps's threads
        share, and the rows for the others would wait for it (a lookup's rows take
        two threads' memory bandwidth for a millisecond or more)."""
        _, peek, parts = unpack_rows(buf, [None] * len(self.units), with_ids=True)
        counts = [len(local) for local, _ in parts]
        head = 8 * (ROWS_HEAD + len(parts))
        sizes = [pad8(c * u.spec.row_bytes) for c, u in zip(counts, self.units)]
        reply = np.empty(head + sum(sizes), np.uint8)
        words = reply[:head].view(np.int64)
        words[RowsField.STEP] = words[RowsField.SEQ] = 0
        words[RowsField.PARTS] = len(parts)
        words[ROWS_HEAD:] = counts
        out, at = torch.from_numpy(reply), head
        for n, (u, (local, _), c, size) in enumerate(zip(self.units, parts, counts, sizes)):
            if c:
                view = out[at:at + c * u.spec.row_bytes].view(u.spec.dtype).view(
                    c, *u.spec.row_shape)
                if u.hashed is not None:
                    rows, zeros = u.hashed.lookup(local, bool(peek))
                    view.copy_(rows)
                    if len(zeros) and not peek:
                        self.unseen[self.worker_ranks.index(rank)][n].append(zeros)
                elif not kernels.all_below(local, u.param.shape[0]):
                    raise ProtocolError(f"{self.label}: worker rank {rank} sent a lookup of rows "
                                        f"outside shard {u.unit}")
                else:
                    pooled.gather_rows(local, u.param.detach(), view)
                reply[at + c * u.spec.row_bytes:at + size] = 0
            at += size
        return reply

    def _answer_exchange(self, buf: np.ndarray, rank: int) -> np.ndarray:
        """The reply to a lookup of several tables, rows and bags pooled here
        (``mpisync.protocol.pooled``)."""
        w = self.worker_ranks.index(rank)
        unseen = self.unseen[w]

        def sighted(n: int, u) -> Callable[[torch.Tensor], torch.Tensor]:
            def read(ids: torch.Tensor) -> torch.Tensor:
                rows, zeros = u.hashed.lookup(ids, False)
                if len(zeros):
                    unseen[n].append(zeros)
                return rows
            return read

        read = {n: sighted(n, u) for n, u in enumerate(self.units) if u.hashed is not None}
        try:
            return pooled.answer(buf, [u.param for u in self.units], self.groups, read,
                                 self.last_lookup[w])
        except ValueError as exc:
            raise ProtocolError(f"{self.label}: worker rank {rank} sent a lookup: {exc}"
                                ) from None

    def _send(self, buf, rank: int, tag: int) -> None:
        self.bytes_out += buf.nbytes
        self.sends.append((self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=tag), buf))

    def _reap(self) -> None:
        if self.sends:
            self.sends = [(r, b) for r, b in self.sends if not r.Test()]

    # -- applying -------------------------------------------------------------------------
    def set_grads(self, chosen: list, optimizer: torch.optim.Optimizer) -> None:
        """Each shard's gradient from the taken pushes, reduced; remember what will change.

        The rows of a shard whose optimizer ``rowopt`` handles are updated by ``settle()``
        (the shard has no ``.grad`` for the optimizer's own step): with the compiled
        kernels, every taken piece, rows and pooled bags alike, summed per row in worker
        order inside the update's pass (``plankernels``) and divided there; without them,
        merged by ``merge_rows`` here. The others get a sparse gradient (an optimizer that
        updates only gradient rows) or a dense one.
        """
        self.settle()                   # the last step's rows first
        self._hash_slots(chosen, optimizer)
        self.optimizer = optimizer
        count = len(chosen)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        how = "sum" if self.spec.reduction == "sum" else self.spec.sparse_reduction
        for n, u in enumerate(self.units):
            taken = [(s.worker, s.rows[n]) for s in chosen
                     if len(s.rows[n][0]) or s.rows[n][2] is not None]
            if not taken:
                self._idle(n, u, group_of[id(u.param)], optimizer,
                           any(s.rows.had[n] for s in chosen))
                continue
            num_rows = u.param.shape[0]
            for w, (ids, _, _) in taken:
                if not kernels.all_below(ids, num_rows):
                    raise ProtocolError(f"{self.label}: worker {w} sent rows outside "
                                        f"[0, {num_rows}) of shard {u.unit}")
            group = group_of[id(u.param)]
            sparse = takes_sparse(optimizer, group)
            if sparse and how != "per_row" and handles_rows(optimizer, group, u.param) and \
                    kernels.available(u.param) and u.param.is_contiguous():
                u.param.grad = None
                item = Pending(frozen(group), u, [piece for _, piece in taken],
                                div=count if how == "mean" and count > 1 else 0)
                if not u.spec.resident:         # the rows that change, for the workers now
                    self._note(n, item.sum()[0].clone())    # (sum()'s ids are scratch)
                else:
                    self.step_rows[n] = item    # its ids once summed: touched()
                self.pending.append(item)
                continue
            pieces = [self._as_rows(u, piece) for _, piece in taken]
            shape = (num_rows, *u.spec.row_shape)
            merged = merge_rows(pieces, num_rows, count, how, u.scratch)
            if merged is None:                  # not sorted: coalesced in general
                grad = reduce_rows(pieces, shape, count, how)
                merged = grad.indices()[0], grad.values()
            ids, rows = merged
            if not sparse:
                u.param.grad = self._sparse(ids, rows, shape).to_dense()
                self._note(n, True)
                continue
            if handles_rows(optimizer, group, u.param):
                u.param.grad = None
                self.pending.append(Pending(frozen(group), u, None, ids, rows))
            else:
                u.param.grad = self._sparse(ids, rows, shape)
            self._note(n, ids)

    def _idle(self, n: int, u: Unit, group: dict, optimizer, had: bool) -> None:
        """A shard no taken push has rows for. Where the table had a gradient in the step
        (``had``: rows of its other shards, here or on other ps ranks), the shard steps
        with a gradient of no rows, as the whole table does in one process: an Adagrad's
        step count and learning rate decay, SparseAdam's bias correction, a dense
        optimizer's moments move on. Else it has none, and the optimizer passes it by."""
        u.param.grad = None
        if not had:
            self._note(n, None)
            return
        if not takes_sparse(optimizer, group):
            u.param.grad = torch.zeros_like(u.param)
            self._note(n, True)
            return
        ids = torch.empty(0, dtype=torch.int64)
        rows = torch.empty(0, *u.spec.row_shape, dtype=u.spec.dtype)
        if handles_rows(optimizer, group, u.param):
            self.pending.append(Pending(frozen(group), u, None, ids, rows))
        else:
            u.param.grad = self._sparse(ids, rows, (u.param.shape[0], *u.spec.row_shape))
        self._note(n, None)

    @staticmethod
    def _as_rows(u: Unit, piece: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A taken piece as (unique local ids, gradient rows): a pooled part's bags turned
        into rows and added after the push's own rows of the shard."""
        ids, rows, bag = piece
        if bag is None:
            return ids, rows
        more = pooled.rows_of(*bag, u.param.shape[0], u.scratch)
        if not len(ids):
            return more
        both, inverse = torch.unique(torch.cat([ids, more[0]]), return_inverse=True)
        summed = torch.zeros(len(both), *rows.shape[1:], dtype=rows.dtype)
        return both, summed.index_add_(0, inverse, torch.cat([rows, more[1]]))

    @staticmethod
    def _sparse(ids: torch.Tensor, rows: torch.Tensor, shape: tuple) -> torch.Tensor:
        return torch.sparse_coo_tensor(ids[None], rows, shape, is_coalesced=True,
                                       check_invariants=False)

    def apply_rows(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after the optimizer's own step: the rows ``set_grads`` kept are updated
        by ``settle()``, which runs before anything here reads or changes a shard again
        (the next poll, lookup, step, shard request or the end), so that the step's
        notice and the workers' new parameters go out first."""
        self.optimizer = optimizer

    def settle(self) -> None:
        """The row updates of the last applied step, if not done yet."""
        if not self.pending:
            return
        start = time.perf_counter()
        for item in self.pending:
            ids, rows = item.sum()
            self._changing(item.unit, ids)
            apply_rows(self.optimizer, item.group, item.unit.param, ids, rows, self.scratch,
                       item.div)
        self.pending = []
        if timeline.current is not None:
            timeline.current.span("rows", start, time.perf_counter(), -1)

    def _hash_slots(self, chosen: list, optimizer) -> None:
        """Hash shards: ids of the taken rows to slots; fresh slots' optimizer state reset."""
        for n, u in enumerate(self.units):
            if u.hashed is not None:
                u.hashed.settle(optimizer)
                for s in chosen:
                    s.rows[n] = (*u.hashed.to_slots(s.rows[n][:2]), None)

    def _note(self, n: int, rows) -> None:
        """Rows of unit ``n`` the step changes: None, a tensor of local ids, or True (all)."""
        self.step_rows[n] = rows
        self._changing(self.units[n], rows)
        self._changed(n, rows)

    def _changed(self, n: int, rows) -> None:
        """Rows of unit ``n`` the workers holding its weight must get with the step's."""
        if self.units[n].spec.resident or rows is None:
            return
        for w in range(self.W):
            if self.full[w]:
                continue
            have = self.changed[w][n]
            if rows is True or have is True:
                self.changed[w][n] = True
            else:
                self.changed[w][n] = rows if have is None else torch.cat([have, rows])

    def touched(self, n: int):
        """Rows of unit ``n`` the last step changed (None, local ids, or True), with the
        step's row updates made."""
        self.settle()
        rows = self.step_rows[n]
        return rows.sum()[0] if isinstance(rows, Pending) else rows

    def before_update(self, n: int, rows) -> None:
        """Rows of unit ``n`` (local ids, or True: all) that a function of ``opt.update``
        is about to change: a snapshot not read yet keeps them as they are."""
        self._changing(self.units[n], rows)

    def _changing(self, u: Unit, rows) -> None:
        """Rows of ``u`` (local ids, or True: all) are about to change: a checkpoint's
        snapshot not read yet keeps them, and the next incremental file holds them."""
        if self.snaps and u.unit in self.snaps:
            self.snaps[u.unit].before(rows)
        if u.marks is not None:
            u.marks.mark(rows)

    def changed_by_update(self, n: int, rows: torch.Tensor) -> None:
        """Rows of unit ``n`` that a function of ``opt.update`` changed after the step: the
        workers holding the weight get them with the step's own (the rows the step itself
        touched stay what ``rows="touched"`` functions get); True: every row."""
        if self.units[n].marks is not None:
            self.units[n].marks.mark(rows)
        if rows is True or len(rows):
            self._changed(n, rows)

    def send_changed(self, workers, step: int) -> None:
        """Send each of ``workers`` the rows of the sparse weights it has not seen."""
        if not self.replicated:
            return
        self.settle()
        for w in workers:
            parts = []
            for n, u in enumerate(self.units):
                rows = True if self.full[w] else self.changed[w][n]
                if u.spec.resident or rows is None:
                    parts.append((torch.empty(0, dtype=torch.int64), self._empty(u)))
                elif rows is True:
                    parts.append((torch.arange(u.param.shape[0]), u.param.detach()))
                else:
                    local = torch.unique(rows)
                    parts.append((local, u.param.detach()[local]))
            self.changed[w] = [None] * len(self.units)
            self.full[w] = False
            self._send(pack_rows(step, 0, parts), self.worker_ranks[w], self.tags[Tag.CHANGED])

    @staticmethod
    def _empty(u: Unit) -> torch.Tensor:
        return torch.empty(0, *u.spec.row_shape, dtype=u.spec.dtype)

    def reset(self) -> None:
        """After a load: every worker gets whole shards next."""
        self.settle()
        self.full = [True] * self.W

    # -- reading and writing whole shards --------------------------------------------------
    def on_table_request(self, request, rank: int, optimizer) -> None:
        """Answer a worker's read or write of one resident shard (pickled, off the step path):
        ``("read", unit, with_state)``, ``("read_changed", unit, with_state, whole)`` (the
        rows changed since the last such read, see ``mpisync.ps.changes``) or ``("write",
        unit, weight, state)``."""
        self.settle()
        what, unit = request[0], request[1]
        u = self.by_unit.get(unit)
        if u is None:
            raise ProtocolError(f"{self.label}: a request for table shard {unit!r}, not held here")
        if u.hashed is not None:
            self._on_hash_request(u, request, rank, optimizer)
            return
        state = state_of(optimizer, u.param)
        if what == "read":
            out = {"weight": u.param.detach().clone()}
            if request[2]:
                out["state"] = {k: v.clone() if torch.is_tensor(v) else v
                                for k, v in state.items()}
            self.comm.send(out, dest=rank, tag=self.tags[Tag.TABLE])
            return
        if what == "read_changed":
            out = u.marks.read(u.param, state, request[2], request[3])
            self.comm.send(out, dest=rank, tag=self.tags[Tag.TABLE])
            return
        _, _, weight, saved = request
        error = None
        try:
            self._write(u, weight, saved, optimizer)
        except (ValueError, RuntimeError, TypeError) as exc:
            error = exc
        self.comm.send(error, dest=rank, tag=self.tags[Tag.TABLE])

    def _on_hash_request(self, u: Unit, request, rank: int, optimizer) -> None:
        what = request[0]
        if what == "read":
            answer = u.hashed.read(optimizer, request[2])
        elif what == "read_changed":
            answer = u.hashed.read_changed(optimizer, request[2], request[3])
        elif what == "hash_stats":
            answer = u.hashed.stats()
        else:
            answer = None
            try:
                if request[2] is not None:
                    raise ValueError(f"{self.label}: hash shard {u.unit} is written with "
                                     f"its ids, not a dense weight")
                u.hashed.write(request[3], optimizer)
            except (ValueError, RuntimeError, TypeError) as exc:
                answer = exc
        self.comm.send(answer, dest=rank, tag=self.tags[Tag.TABLE])

    def _write(self, u: Unit, weight, saved, optimizer) -> None:
        self._changing(u, True)
        with torch.no_grad():
            if weight is not None:
                if tuple(weight.shape) != tuple(u.param.shape):
                    raise ValueError(f"{self.label}: shard {u.unit} has shape "
                                     f"{list(u.param.shape)}, the values given "
                                     f"{list(weight.shape)}")
                u.param.copy_(weight)
        self.full = [True] * self.W         # the workers holding it get the whole shard
        if saved is not None and optimizer is not None:
            state = optimizer.state[u.param]
            state.clear()
            for key, value in saved.items():
                state[key] = kernels.table_copy(value)

    def finish(self) -> None:
        self.settle()
        if self.sends:
            self.poller.wait_all([r for r, _ in self.sends], lambda: "row sends to workers")
            self.sends = []
