"""Several ``mpisync.EmbeddingBag`` tables looked up in one exchange, feature by feature."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from .embedding import EmbeddingBag

__all__ = ["EmbeddingBagCollection"]


def _arguments(name: str, value: object) -> tuple[Any, Any, Any]:
    """``(input, offsets, per_sample_weights)`` of one feature."""
    if torch.is_tensor(value):
        return value, None, None
    if isinstance(value, (tuple, list)) and 1 <= len(value) <= 3:
        return (*value, *(None,) * (3 - len(value)))
    if isinstance(value, Mapping):
        unknown = set(value) - {"input", "offsets", "per_sample_weights"}
        if unknown:
            raise TypeError(f"feature {name!r} has keys {sorted(unknown)}; expected 'input', "
                            f"'offsets', 'per_sample_weights'")
        return value["input"], value.get("offsets"), value.get("per_sample_weights")
    raise TypeError(f"feature {name!r} is a {type(value).__name__}; expected a 2-D tensor of "
                    f"ids, or (input, offsets[, per_sample_weights])")


class EmbeddingBagCollection(torch.nn.Module):
    """Tables by feature name, looked up together: one message per ps rank for all of them.

    As TorchRec's ``EmbeddingBagCollection`` with a dict for its ``KeyedJaggedTensor``:
    ``forward(features)`` takes ``{feature: input}`` where an input is what the feature's
    ``mpisync.EmbeddingBag`` takes (a 2-D tensor, ``(ids, offsets)`` or ``(ids, offsets,
    per_sample_weights)``, or a dict with those keys) and returns ``{feature: pooled}``.
    Every table is checked first; then each ps rank gets one lookup covering every table
    it holds shards of (rows, or bags pooled there, as each table's ``pool_on_ps`` says),
    so 26 features cost one round trip, not 26. The tables train exactly as they would
    looked up one by one. As with TorchRec's, every feature must have an input (a
    ``KeyError`` on the worker that left one out, naming it, before anything is sent; the
    job then ends on every rank): a feature without ids in a batch gets empty bags, e.g.
    ``(torch.empty(0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))``, which
    pool to zeros. The output has every feature, in the collection's order.

    Args:
        tables: ``{feature: mpisync.EmbeddingBag}``; all held by one SyncReplicasOptimizer.

    Raises:
        TypeError: a table that is not an ``mpisync.EmbeddingBag``.
        ValueError: one table under two features.

    Example::

        ebc = mpisync.EmbeddingBagCollection({
            "user": mpisync.EmbeddingBag(1_000_000, 16, mode="sum"),
            "item": mpisync.EmbeddingBag(500_000, 16, mode="sum")})
        pooled = ebc({"user": (user_ids, user_offsets), "item": item_ids_2d})
        x = torch.cat([pooled["user"], pooled["item"]], dim=1)
    """

    def __init__(self, tables: Mapping[str, EmbeddingBag]) -> None:
        super().__init__()
        for name, table in tables.items():
            if not isinstance(table, EmbeddingBag):
                raise TypeError(f"table {name!r} is a {type(table).__name__}; expected an "
                                f"mpisync.EmbeddingBag")
        if len({id(t) for t in tables.values()}) != len(tables):
            raise ValueError("a table appears under two features; give each feature its own "
                             "mpisync.EmbeddingBag")
        self.tables = torch.nn.ModuleDict(tables)

    def _table(self, name: str) -> EmbeddingBag:
        """The table of feature ``name`` (a ModuleDict's items are typed as any Module;
        ``__init__`` checked that each is an EmbeddingBag)."""
        return cast(EmbeddingBag, self.tables[name])

    def forward(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """Every feature's bags pooled by its table, in one exchange with the ps ranks.

        Local to this worker: one message to each ps rank holding shards of any table.

        Args:
            features: ``{feature: input}`` for every feature of the collection; an input is
                a 2-D tensor of ids, ``(ids, offsets[, per_sample_weights])`` or a dict
                with those keys.

        Returns:
            ``{feature: (number of bags, embedding_dim)}``, in the collection's order.

        Raises:
            KeyError: a feature without a table, or a table without an input.
            TypeError: an input of another form.
            ValueError: tables held by different optimizers, or any refusal of
                ``EmbeddingBag.forward``; all before anything is sent.
        """
        label = self._table(next(iter(self.tables))).table.label if len(self.tables) else \
            "this worker"
        unknown = [name for name in features if name not in self.tables]
        if unknown:
            raise KeyError(f"{label}: mpisync.EmbeddingBagCollection got features {unknown} "
                           f"that have no table here; the tables are {list(self.tables)}")
        missing = [name for name in self.tables if name not in features]
        if missing:
            raise KeyError(f"{label}: mpisync.EmbeddingBagCollection got no input for "
                           f"features {missing}; as TorchRec's EmbeddingBagCollection, "
                           f"every feature needs one: give a feature without ids empty "
                           f"bags (ids of length 0 with offsets of zeros), which pool to "
                           f"zeros")
        plans = []
        for name in self.tables:
            plans.append((name, self._table(name).plan(*_arguments(name, features[name]))))
        if not plans:
            return {}
        channels = {id(self._table(name).table.channel): name for name, _ in plans}
        if len(channels) > 1:
            names = list(channels.values())
            info = self._table(names[0]).table
            raise ValueError(f"{info.label}: the tables of features {names} belong to "
                             f"different SyncReplicasOptimizers; one collection looks up the "
                             f"tables of one optimizer")
        channel = self._table(plans[0][0]).table.channel
        outs = channel.exchange([request for _, (request, _) in plans])
        return {name: finish(out) for (name, (_, finish)), out in zip(plans, outs)}
