"""The shards of the tables that live on the ps ranks: read one at a time, written from a save."""
from __future__ import annotations

from ..errors import ConfigError
from ..protocol.wire import Tag

__all__ = ["TableShards"]


class TableShards:
    """Reads and writes the shards of the resident tables (``mpisync.Embedding``) through
    the rows channel, one shard in this worker's memory at a time."""

    def __init__(self, spec, cluster, rows):
        self.spec, self.cluster, self.rows = spec, cluster, rows

    def read(self, name: str, with_state: bool = True, changed: bool | None = None):
        """Yield the shards of table ``name``, one at a time (see ``table_shards()``)."""
        tables = {t.name: t for t in self.spec.tables if t.resident}
        if name not in tables:
            raise KeyError(f"{self.cluster.label}: no mpisync.Embedding table {name!r} in this "
                           f"optimizer; it has {sorted(tables)}")
        for k in range(tables[name].num_shards):
            if changed is None:
                yield self.rows.read_shard(name, k, with_state)
            else:
                yield self.rows.read_changed(name, k, with_state, whole=not changed)

    def read_snapshot(self, name: str):
        """Yield the shards of table ``name`` as at the snapshot (see ``RowsChannel.snapshot``)."""
        t = next(t for t in self.spec.tables if t.resident and t.name == name)
        for k in range(t.num_shards):
            yield self.rows.read_snapshot(name, k)

    def write_saved(self, tables: dict) -> None:
        """The chief writes the saved shards of the tables that live on the ps ranks; the
        other workers wait until it has. Only once every worker is in ``load_state_dict()``
        (ps 0 answered): a worker still reading rows between steps, before it reaches the
        call, reads the rows as they were, and none goes on to a step before the loaded
        rows are in place. Call on every worker."""
        if not tables:
            return
        chief, *others = self.cluster.layout.worker_ranks
        tag = self.rows.tags[Tag.TABLE]
        if not self.cluster.is_chief:
            error = self.rows.poller.wait_message(
                chief, tag, lambda: "worker 0 writing the tables' saved shards")
            if error is not None:
                raise ConfigError(f"{self.cluster.label}: load_state_dict(): worker 0 could not "
                                  f"write the tables' saved shards: {error}", collective=True)
            return
        hashed = {t.name for t in self.spec.tables if t.hashed is not None}
        error = None
        try:
            for name, saved in tables.items():
                for k, shard in enumerate(saved["shards"]):
                    if name in hashed:        # rows by id, with their counts
                        self.rows.write_shard(name, k, None, shard)
                    else:
                        self.rows.write_shard(name, k, shard["weight"], shard.get("state"))
        except (ValueError, RuntimeError, TypeError) as exc:
            error = exc
        for rank in others:
            self.rows.comm.send(None if error is None else str(error), dest=rank, tag=tag)
        if error is not None:
            raise error
