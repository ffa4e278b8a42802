"""The worker's transport for tables: lookups, row gradients, changed rows, shard reads."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ..errors import ProtocolError
from ..protocol.rowsmsg import pack_rows, unpack_rows
from ..protocol.spec import JobSpec
from ..protocol.tables import TableSpec, table_info
from ..protocol.wire import Tag, pad8
from ..runtime.progress import Poller
from .exchange import Request, exchange, pooled_sections, split
from .tracking import TrackedParameter, rebound

__all__ = ["RowsChannel"]


class _Table:
    """One table as this worker sees it."""

    def __init__(self, spec: TableSpec, param: torch.Tensor):
        self.spec = spec
        self.param = param                  # the stand-in, or the whole sparse nn.Embedding weight
        self.info = table_info(param)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # (unique ids, rows leaf)
        self.pooled: list = []               # exchange.Pooled: bags pooled at the owners
        self.cls = type(param)
        if self.info is None and type(param) is torch.nn.Parameter:
            param.__class__ = TrackedParameter   # p.data writes count as writes too
        self.version = param._version        # a sparse weight: what the ps ranks hold

    def takes_grad(self) -> bool:
        """Whether a lookup now collects a gradient for the next push: grad enabled and
        the weight not frozen (``requires_grad=False``), as torch's ``nn.Embedding``."""
        return torch.is_grad_enabled() and self.param.requires_grad


class RowsChannel:
    """Tables of one optimizer: ``mpisync.Embedding`` tables and sparse ``nn.Embedding`` weights.

    Every push sends one rows message to each ps rank that holds a table shard (the ps
    pairs it with the dense push), with the local ids and gradients of the rows this
    worker's batch touched. A lookup sends the unique ids to the ps ranks that own them,
    one message per ps rank, all at once. After a step, a worker holding a sparse
    ``nn.Embedding`` receives the rows that changed since it last heard.
    """

    def __init__(self, spec: JobSpec, cluster, params: dict[str, torch.Tensor], poller: Poller):
        self.spec = spec
        self.on_grad: Callable[[torch.Tensor | None], None] | None = None       # dense="allreduce": a table's gradient joins the round
        self.cluster = cluster
        self.comm = cluster.p2p_comm
        self.poller = poller
        self.label = cluster.label
        self.tags = {k: Tag.of(k, spec.opt_id) for k in (Tag.SPARSE, Tag.LOOKUP, Tag.ROWS,
                                                           Tag.CHANGED, Tag.TABLE, Tag.INIT,
                                                           Tag.SNAP)}
        self.tables = [_Table(t, params[t.name]) for t in spec.tables]
        # per ps: its shards, in spec order: (table index, shard)
        self.on_ps: list[list[tuple[int, int]]] = [[] for _ in range(spec.num_ps)]
        for i, t in enumerate(spec.tables):
            for k, owner in enumerate(t.owners):
                self.on_ps[owner].append((i, k))
        self.replicated_ps = [j for j, shards in enumerate(self.on_ps)
                              if any(not spec.tables[i].resident for i, _ in shards)]
        self.sends: list[tuple[MPI.Request, np.ndarray]] = []
        self.buffers: dict = {}              # message buffers, by (kind, ps)
        # per ps rank: the number of the last lookup of bags pooled there (``exchange``),
        # and its pooled parts, which a push of just those names instead of sending them
        self.exchanged: list[tuple[int, list]] = [(0, []) for _ in range(spec.num_ps)]
        self.bytes_per_ps = [0] * spec.num_ps
        # lookups since the last push, and those of the step before it: messages, bytes
        # sent and received per ps rank
        self.lookups = [[0] * spec.num_ps for _ in range(3)]
        self.last_lookups = [[0] * spec.num_ps for _ in range(3)]
        self.seq = 0
        for table in self.tables:
            if table.info is not None:
                table.info.name, table.info.channel, table.info.label = (
                    table.spec.name, self, self.label)
        for name, p in params.items():     # tables its optimizer leaves out: said at lookup
            info = table_info(p)
            if info is not None and info.channel is None:
                info.left_out, info.label = name, self.label

    @property
    def active(self) -> bool:
        return bool(self.tables)

    # -- set-up ---------------------------------------------------------------------------
    def send_initial(self) -> None:
        """The chief's initial rows, shard by shard, to the ps ranks (tables without a seed)."""
        for table in self.tables:
            t = table.spec
            if t.seed is not None:
                continue
            values = table.info.weight if table.info is not None else table.param.detach()
            for k, owner in enumerate(t.owners):
                ids = t.global_ids(k, torch.arange(t.shard_rows[k]))
                rows = values[ids].contiguous()
                req = self.comm.Isend([rows.view(torch.uint8).numpy(), MPI.BYTE],
                                      dest=self.cluster.ps_rank(owner), tag=self.tags[Tag.INIT])
                self.poller.wait_all([req], lambda t=t: f"table {t.name!r} reaching the ps ranks")

    def forget_initial(self) -> None:
        """Initial values given with ``weight=`` are the ps ranks' now: drop this copy."""
        for table in self.tables:
            if table.info is not None:
                table.info.weight = None

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, info, unique: torch.Tensor, peek: bool = False) -> torch.Tensor:
        """The rows of ``unique`` (sorted unique ids), as a leaf that collects their gradient.

        ``peek``: a hash table reads without counting a sighting (no row admitted).
        """
        index = self.index_of(info)
        table = self.tables[index]
        t = table.spec
        order, counts, local = split(t, unique)
        pieces = torch.split(local, counts)
        out = torch.empty(len(unique), *t.row_shape, dtype=t.dtype)
        reqs, replies = [], []
        for j, shards in enumerate(self.on_ps):
            mine = [(i, k) for i, k in shards if i == index]
            if not any(counts[k] for _, k in mine):
                continue
            parts = [(pieces[k] if i == index else torch.empty(0, dtype=torch.int64), None)
                     for i, k in shards]
            msg = pack_rows(-1, int(peek), parts)
            reply = np.empty(8 * (3 + len(shards))
                             + sum(pad8(counts[k] * t.row_bytes) for _, k in mine), np.uint8)
            rank = self.cluster.ps_rank(j)
            reqs.append(self.comm.Isend([msg, MPI.BYTE], dest=rank, tag=self.tags[Tag.LOOKUP]))
            reqs.append(self.comm.Irecv([reply, MPI.BYTE], source=rank, tag=self.tags[Tag.ROWS]))
            replies.append((j, shards, mine, reply, msg))
            self.count_lookup(j, msg.nbytes, reply.nbytes)
        self.poller.wait_all(reqs, lambda: f"rows of table {t.name!r} from the ps ranks")
        positions = torch.split(order, counts)
        for j, shards, mine, reply, _ in replies:
            kinds = [(t.dtype, t.row_shape) if i == index else None for i, _ in shards]
            _, _, parts = unpack_rows(reply, kinds, with_ids=False)
            for (i, k), (_, values) in zip(shards, parts):
                if i == index and counts[k]:
                    out[positions[k]] = values
        if table.takes_grad():
            out.requires_grad_(True)
            if self.on_grad is not None:
                out.register_post_accumulate_grad_hook(self.on_grad)
            table.pending.append((unique, out))
        return out

    def exchange(self, requests: list[Request]) -> list[torch.Tensor]:
        """Rows or pooled bags of several tables: one message per ps rank (``exchange``)."""
        return exchange(self, requests)

    def index_of(self, info) -> int:
        """The index of the table whose ``TableInfo`` is ``info``."""
        return next(i for i, tb in enumerate(self.tables) if tb.info is info)

    def buffer(self, key, nbytes: int) -> np.ndarray:
        """A byte buffer of at least ``nbytes`` kept under ``key`` from call to call (a
        step's messages reuse the last step's memory instead of faulting in new pages)."""
        buf = self.buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffers[key] = np.empty(nbytes, np.uint8)
        return buf

    def count_lookup(self, j: int, sent: int, received: int) -> None:
        for n, add in enumerate((1, sent, received)):
            self.lookups[n][j] += add

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool) -> None:
        for table in self.tables:
            # as torch: None, or zero where there is one (the step then takes the table with
            # a gradient of no rows: ``push``)
            if set_to_none or table.param.grad is None:
                table.param.grad = None
            else:
                table.param.grad.zero_()
            if table.info is None:
                continue
            leaves = [p.leaf for p in table.pooled]
            for rows in [rows for _, rows in table.pending] + leaves:
                if set_to_none or rows.grad is None:
                    rows.grad = None
                else:
                    rows.grad.zero_()

    def _gradient(self, table: _Table) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(unique ids, their summed gradient rows) of one table for this push, or None."""
        if table.info is None:
            g = table.param.grad
            if g is None:
                return None
            if not g.is_sparse:
                g = g.to_sparse(1)
            g = g.coalesce()
            return g.indices()[0], g.values()
        got = [(ids, rows.grad) for ids, rows in table.pending if rows.grad is not None]
        table.pending = []
        if not got:
            return None
        if len(got) == 1:
            ids, grad = got[0]
        else:
            ids, inverse = torch.unique(torch.cat([i for i, _ in got]), return_inverse=True)
            grad = torch.zeros(len(ids), *table.spec.row_shape, dtype=table.spec.dtype)
            grad.index_add_(0, inverse, torch.cat([g for _, g in got]))
        pad = table.spec.padding_idx
        if pad is not None:
            keep = ids != pad
            ids, grad = ids[keep], grad[keep]
        return ids, grad

    def push(self, step: int, seq: int) -> None:
        """Send every ps rank holding a table shard the rows of this worker's gradients.

        A sparse weight written since the last step (``model.load_state_dict()``, a
        clamp) is first sent whole to its ps ranks, shard by shard.
        """
        for table in self.tables:
            if table.info is None and (table.param._version != table.version
                                       or rebound(table.param)):
                self._write_whole(table)
        # the tables with a gradient in this push (by rows, by bags pooled at the owners, or
        # a gradient zeroed since the last: a table left out of this forward whose .grad
        # was zeroed, not set to None, by zero_grad(set_to_none=False), of the optimizer or
        # the model): the shards of one without rows here still step (an Adagrad's step
        # count, Adam's moments), as the whole table does in one process
        had = [table.info is not None and table.param.grad is not None
               or any(p.leaf.grad is not None for p in table.pooled) for table in self.tables]
        per_table = []
        for i, table in enumerate(self.tables):
            got = self._gradient(table)
            if got is None:
                per_table.append(None)
                continue
            had[i] = True
            ids, grad = got
            order, counts, local = split(table.spec, ids)
            per_table.append((torch.split(local, counts), torch.split(grad[order], counts)))
        for table, got in zip(self.tables, had):
            if got and table.info is not None and table.param.grad is None:
                # the stand-in holds a gradient now, as the table's weight would in torch:
                # empty, as the stand-in is; zero_grad() sets it to None or leaves it
                table.param.grad = torch.zeros(table.param.shape, dtype=table.param.dtype,
                                               device=table.param.device)
        empty = torch.empty(0, dtype=torch.int64)
        sections = pooled_sections(self)
        reuse = not self.sends          # the last push's buffers: every send of them is done
        self.last_lookups = self.lookups
        self.lookups = [[0] * self.spec.num_ps for _ in range(3)]
        for j, shards in enumerate(self.on_ps):
            if not shards:
                continue
            parts = []
            for i, k in shards:
                got = per_table[i]
                parts.append((empty, self._no_rows(i)) if got is None else (got[0][k], got[1][k]))
            msg = pack_rows(step, seq, parts, [not had[i] for i, _ in shards])
            section = sections[j]
            if section is not None:     # the bags pooled at the owners follow
                size = msg.nbytes + section.nbytes()
                into = self.buffer(("push", j), size) if reuse else np.empty(size, np.uint8)
                into[:msg.nbytes] = msg
                msg = section.pack(into, msg.nbytes)
            self.bytes_per_ps[j] = msg.nbytes
            self.sends.append((self.comm.Isend([msg, MPI.BYTE], dest=self.cluster.ps_rank(j),
                                               tag=self.tags[Tag.SPARSE]), msg))

    def _write_whole(self, table: _Table) -> None:
        t = table.spec
        values = table.param.detach()
        for k in range(t.num_shards):
            self.write_shard(t.name, k, values[t.global_ids(k, torch.arange(t.shard_rows[k]))],
                             None)
        table.version = table.param._version

    def _no_rows(self, i: int) -> torch.Tensor:
        t = self.spec.tables[i]
        return torch.empty(0, *t.row_shape, dtype=t.dtype)

    def wait_sends(self) -> None:
        if self.sends:
            self.poller.wait_all([r for r, _ in self.sends], lambda: "row gradient sends")
            self.sends = []

    def pull(self, step: int) -> None:
        """The rows of sparse tables that changed, from each ps rank holding their shards."""
        for j in self.replicated_ps:
            buf = self._receive_raw(self.cluster.ps_rank(j), self.tags[Tag.CHANGED],
                                    f"changed rows of step {step} from ps {j}")
            shards = self.on_ps[j]
            kinds = [(self.spec.tables[i].dtype, self.spec.tables[i].row_shape)
                     for i, _ in shards]
            got_step, _, parts = unpack_rows(buf, kinds, with_ids=True)
            if got_step != step:
                raise ProtocolError(f"{self.label}: ps {j} sent the rows of step {got_step} "
                                    f"with token {step}")
            with torch.no_grad():
                for (i, k), (local, values) in zip(shards, parts):
                    table = self.tables[i]
                    if table.info is None and len(local):
                        table.param.index_copy_(0, table.spec.global_ids(k, local), values)
                        table.version = table.param._version

    def _receive_raw(self, source: int, tag: int, what: str) -> np.ndarray:
        status = MPI.Status()
        msg = self.poller.wait_probe(source, tag, status, lambda: what)
        buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        msg.Recv([buf, MPI.BYTE])
        return buf

    # -- reading and writing whole shards --------------------------------------------------
    def read_shard(self, name: str, k: int, with_state: bool = True) -> dict:
        """Shard ``k`` of resident table ``name`` from its ps: ids, weight, optimizer state."""
        t = next(tb.spec for tb in self.tables if tb.spec.name == name)
        rank = self.cluster.ps_rank(t.owners[k])
        self.comm.send(("read", t.unit(k), with_state), dest=rank, tag=self.tags[Tag.TABLE])
        return self._placed(t, k, self.poller.wait_message(
            rank, self.tags[Tag.TABLE], lambda: f"shard {k} of table {name!r}"))

    def read_changed(self, name: str, k: int, with_state: bool = True, whole: bool = False
                     ) -> dict:
        """The rows of shard ``k`` of resident table ``name`` changed since the last call
        for it (every row with ``whole``); its ps forgets them (``mpisync.ps.changes``).

        Returns ``ids`` (global) and ``at`` (places in the shard) of those rows, their
        ``weight``, ``per_row`` (the names of the per-row state entries) and, with
        ``with_state``, ``state``: those rows of the per-row entries, the others whole. A
        hash shard's: ``ids``, ``weight``, ``per_row``, ``state``, ``counters`` as
        ``read_shard`` gives them for those ids, and ``removed``: the ids it held at the
        last call and holds no more (None with every row).
        """
        t = next(tb.spec for tb in self.tables if tb.spec.name == name)
        rank = self.cluster.ps_rank(t.owners[k])
        self.comm.send(("read_changed", t.unit(k), with_state, whole), dest=rank,
                       tag=self.tags[Tag.TABLE])
        return self._placed(t, k, self.poller.wait_message(
            rank, self.tags[Tag.TABLE], lambda: f"changed rows of shard {k} of table {name!r}"))

    @staticmethod
    def _placed(t: TableSpec, k: int, got: dict) -> dict:
        """A shard read from its ps with the global ``ids`` of its rows (and, for changed
        rows, ``at``: their places in the shard); a hash shard's ps sends its ids."""
        if t.hashed is not None:
            return got
        if "local" not in got:                  # every row
            got["ids"] = t.global_ids(k, torch.arange(t.shard_rows[k]))
            return got
        at = got.pop("local")
        got["at"] = torch.arange(t.shard_rows[k]) if at is None else at
        got["ids"] = t.global_ids(k, got["at"])
        return got

    def snapshot(self, what: tuple, aside: bool = False) -> None:
        """Begin (``("snap_begin", mode)``) or end (``("snap_end",)``) a checkpoint's
        snapshot of the resident shards on every ps rank holding some
        (``mpisync.ps.snapshot``); returns once each has. ``aside``: called from a thread
        beside the step's (the checkpoint's writer)."""
        ranks = [self.cluster.ps_rank(j) for j, shards in enumerate(self.on_ps)
                 if any(self.spec.tables[i].resident for i, _ in shards)]
        for rank in ranks:
            self.comm.send(what, dest=rank, tag=self.tags[Tag.SNAP])
        for rank in ranks:
            answer = self.poller.wait_message(rank, self.tags[Tag.SNAP],
                                              lambda: "a ps rank's snapshot of its tables",
                                              aside=aside)
            if answer is not None:
                raise answer

    def read_snapshot(self, name: str, k: int) -> dict:
        """Shard ``k`` of resident table ``name`` as at the snapshot, as ``read_shard``
        (a snapshot begun with mode None) or ``read_changed`` gives it; once per shard."""
        t = next(tb.spec for tb in self.tables if tb.spec.name == name)
        rank = self.cluster.ps_rank(t.owners[k])
        self.comm.send(("snap_read", t.unit(k)), dest=rank, tag=self.tags[Tag.SNAP])
        got = self.poller.wait_message(rank, self.tags[Tag.SNAP],
                                       lambda: f"shard {k} of table {name!r} as saved",
                                       aside=True)
        if isinstance(got, Exception):
            raise got
        return self._placed(t, k, got)

    def hash_stats(self) -> dict[str, dict[str, int]]:
        """Admitted, evicted and live rows of each hash table, summed over its shards."""
        out = {}
        for table in self.tables:
            t = table.spec
            if t.hashed is None:
                continue
            total = {"admitted": 0, "evicted": 0, "live": 0}
            for k, owner in enumerate(t.owners):
                rank = self.cluster.ps_rank(owner)
                self.comm.send(("hash_stats", t.unit(k)), dest=rank, tag=self.tags[Tag.TABLE])
                got = self.poller.wait_message(rank, self.tags[Tag.TABLE],
                                               lambda k=k, t=t: f"counts of shard {k} of {t.name!r}")
                for key in total:
                    total[key] += got[key]
            out[t.name] = total
        return out

    def write_shard(self, name: str, k: int, weight: torch.Tensor | None, state: dict | None
                    ) -> None:
        """Replace shard ``k`` of table ``name`` (and, if given, its optimizer state) on its ps.

        Every worker holding the table then receives the whole shard with its next step.
        """
        t = next(tb.spec for tb in self.tables if tb.spec.name == name)
        rank = self.cluster.ps_rank(t.owners[k])
        self.comm.send(("write", t.unit(k), weight, state), dest=rank, tag=self.tags[Tag.TABLE])
        answer = self.poller.wait_message(rank, self.tags[Tag.TABLE],
                                          lambda: f"ps {t.owners[k]} loading shard {k} of {name!r}")
        if answer is not None:
            raise answer

    def close(self) -> None:
        self.wait_sends()
        for table in self.tables:
            if table.info is not None:
                table.info.channel = None
            elif type(table.param) is TrackedParameter:
                table.param.__class__ = table.cls
            table.pending = []
            table.pooled = []
