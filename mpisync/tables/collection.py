"""Several ``mpisync.EmbeddingBag`` and ``mpisync.HashEmbeddingBag`` tables looked up in one
exchange, feature by feature.

The input is a dict ``{feature: input}`` or anything shaped like TorchRec's
``KeyedJaggedTensor`` (read through its methods: torchrec is not imported); the output of
the latter is a ``KeyedTensor`` shaped like TorchRec's.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from .embedding import EmbeddingBag
from .hashtables import HashEmbeddingBag

__all__ = ["EmbeddingBagCollection", "KeyedTensor"]


class KeyedTensor:
    """Pooled embeddings of several features side by side, as TorchRec's ``KeyedTensor``.

    ``values()`` is one ``(batch, sum of the dims)`` tensor, the features' columns one
    after another in ``keys()``' order; ``kt[key]`` and ``to_dict()`` give each feature's
    ``(batch, dim)`` columns as views of it. ``EmbeddingBagCollection`` returns one when
    its input is a ``KeyedJaggedTensor``.

    Args:
        keys: the features, in the columns' order.
        length_per_key: each feature's number of columns (its table's ``embedding_dim``).
        values: the ``(batch, sum(length_per_key))`` tensor.

    Raises:
        ValueError: ``keys`` and ``length_per_key`` of different lengths, or ``values``
            that is not 2-D with ``sum(length_per_key)`` columns.

    Example::

        kt = mpisync.KeyedTensor(["user", "item"], [16, 8], torch.zeros(4, 24))
        kt["item"].shape                  # (4, 8): columns 16 to 24 of kt.values()
    """

    def __init__(self, keys: list[str], length_per_key: list[int],
                 values: torch.Tensor) -> None:
        if len(keys) != len(length_per_key):
            raise ValueError(f"KeyedTensor got {len(keys)} keys and {len(length_per_key)} "
                             f"lengths; expected one length per key")
        if values.dim() != 2 or values.shape[1] != sum(length_per_key):
            raise ValueError(f"KeyedTensor got values of shape {list(values.shape)}; expected "
                             f"(batch, {sum(length_per_key)}), the lengths {length_per_key} "
                             f"side by side")
        self._keys, self._lengths, self._values = list(keys), list(length_per_key), values
        self._offsets = [0]
        for length in self._lengths:
            self._offsets.append(self._offsets[-1] + length)

    def keys(self) -> list[str]:
        """The features, in the columns' order."""
        return self._keys

    def values(self) -> torch.Tensor:
        """The ``(batch, sum(length_per_key()))`` tensor of every feature's columns."""
        return self._values

    def key_dim(self) -> int:
        """The dimension the keys run along: 1, the columns."""
        return 1

    def length_per_key(self) -> list[int]:
        """Each feature's number of columns, in ``keys()``' order."""
        return self._lengths

    def offset_per_key(self) -> list[int]:
        """Where each feature's columns start, and at the end the total: one more entry
        than ``keys()``, starting at 0."""
        return self._offsets

    def __getitem__(self, key: str) -> torch.Tensor:
        """The ``(batch, dim)`` columns of feature ``key``: a view of ``values()``."""
        at = self._keys.index(key) if key in self._keys else None
        if at is None:
            raise KeyError(f"KeyedTensor has no key {key!r}; its keys are {self._keys}")
        return self._values[:, self._offsets[at]:self._offsets[at + 1]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{feature: (batch, dim)}``, views of ``values()``, in ``keys()``' order."""
        return dict(zip(self._keys, self._values.split(self._lengths, dim=1)))

    def __repr__(self) -> str:
        return (f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths}, "
                f"values={tuple(self._values.shape)})")


def is_keyed_jagged(features: object) -> bool:
    """Whether ``features`` is shaped like TorchRec's ``KeyedJaggedTensor``: not a mapping,
    with callable ``keys()``, ``values()`` and ``lengths()`` or ``offsets()``."""
    if isinstance(features, Mapping):
        return False
    return (callable(getattr(features, "keys", None))
            and callable(getattr(features, "values", None))
            and any(callable(getattr(features, m, None)) for m in ("lengths", "offsets")))


def _jagged_features(kjt: Any, label: str) -> dict[str, tuple]:
    """``{key: (ids, offsets with the end of the last bag, per_sample_weights or None)}``
    of a ``KeyedJaggedTensor``-shaped ``kjt``, in its keys' order: key ``k`` of stride ``B`` has
    the bags ``lengths[k*B:(k+1)*B]``, the ids between their offsets and the weights
    sliced as the ids. All checked here, before anything is sent."""
    what = f"{label}: mpisync.EmbeddingBagCollection got a KeyedJaggedTensor"
    variable = getattr(kjt, "variable_stride_per_key", None)
    if callable(variable) and variable():
        raise ValueError(f"{what} with a variable batch size per feature "
                         f"(variable_stride_per_key() is True); every feature needs the same "
                         f"number of bags: give each feature a bag per sample (empty bags "
                         f"pool to zeros)")
    keys = list(kjt.keys())
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"{what} with keys {repeated} more than once")
    values = kjt.values()
    if not torch.is_tensor(values) or values.dim() != 1:
        raise ValueError(f"{what} whose values() is "
                         f"{list(values.shape) if torch.is_tensor(values) else type(values).__name__}"
                         f"; expected a 1-D tensor of ids")
    lengths_of = getattr(kjt, "lengths", None)
    if callable(lengths_of):
        lengths, source = lengths_of(), "lengths()"
    else:
        offsets, source = kjt.offsets(), "offsets()"
        if not torch.is_tensor(offsets) or offsets.dim() != 1 or not len(offsets) \
                or offsets.is_floating_point() or int(offsets[0]) != 0:
            raise ValueError(f"{what} whose offsets() is not a 1-D integer tensor starting "
                             f"at 0 (one more entry than bags)")
        lengths = offsets[1:] - offsets[:-1]
    if not torch.is_tensor(lengths) or lengths.dim() != 1 or lengths.is_floating_point():
        raise ValueError(f"{what} whose {source} is not a 1-D integer tensor")
    lengths = lengths.cpu().long()
    if len(lengths) and int(lengths.min()) < 0:
        at = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"{what} with a negative length: bag {at} has length "
                         f"{int(lengths[at])}" + (" (its offsets() decrease there)"
                                                  if source == "offsets()" else ""))
    if int(lengths.sum()) != len(values):
        raise ValueError(f"{what} whose lengths sum to {int(lengths.sum())} but whose "
                         f"values() has {len(values)} ids; they must be equal")
    if (len(lengths) % len(keys) if keys else len(lengths)):
        raise ValueError(f"{what} of {len(lengths)} bags for {len(keys)} keys; expected a "
                         f"multiple of the keys, the same number of bags (the stride) for "
                         f"each key")
    weights_of = getattr(kjt, "weights_or_none", None)
    weights = weights_of() if callable(weights_of) else None
    if weights is not None and (not torch.is_tensor(weights) or weights.shape != values.shape):
        raise ValueError(f"{what} whose weights_or_none() has shape "
                         f"{list(weights.shape) if torch.is_tensor(weights) else type(weights).__name__}"
                         f"; expected one weight per id, values()' shape {list(values.shape)}")
    stride = len(lengths) // len(keys) if keys else 0
    ends = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=ends[1:])
    features = {}
    for k, key in enumerate(keys):
        bags = ends[k * stride:(k + 1) * stride + 1]
        start, end = int(bags[0]), int(bags[-1])
        features[key] = (values[start:end], (bags - start).to(values.device),
                         None if weights is None else weights[start:end])
    return features


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

    As TorchRec's ``EmbeddingBagCollection``: ``forward(features)`` takes a
    ``KeyedJaggedTensor`` and returns a ``KeyedTensor`` (``mpisync.KeyedTensor``, shaped
    as TorchRec's: one ``(batch, sum of the dims)`` tensor, the features' columns in the
    collection's order). The KJT is read through its methods, without importing
    torchrec: ``keys()``, ``values()``, ``lengths()`` or ``offsets()`` and
    ``weights_or_none()`` (the ``per_sample_weights`` of every feature), with the same
    number of bags for each key (its ``stride()``; a variable batch per feature is
    refused). Or it takes a dict ``{feature: input}`` where an input is what the
    feature's ``mpisync.EmbeddingBag`` takes (a 2-D tensor, ``(ids, offsets)`` or
    ``(ids, offsets, per_sample_weights)``, or a dict with those keys) and returns
    ``{feature: pooled}``.
    Every table is checked first; then each ps rank gets one lookup covering every table
    it holds shards of (rows, or bags pooled there, as each table's ``pool_on_ps`` says),
    so 26 features cost one round trip, not 26. The tables train exactly as they would
    looked up one by one. As with TorchRec's, every feature must have an input (a
    ``KeyError`` on the worker that left one out, naming it, before anything is sent; the
    job then ends on every rank): a feature without ids in a batch gets empty bags, e.g.
    ``(torch.empty(0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))``, which
    pool to zeros. A KJT whose lengths are negative, do not sum to its number of ids or
    are not a multiple of its keys, or whose weights are not one per id, is a
    ``ValueError`` naming it, also before anything is sent. The output has every
    feature, in the collection's order.

    ``mpisync.HashEmbeddingBag`` tables (unbounded int64 ids) join the same exchange in
    training mode: their unique ids go to their shards with the other tables' requests,
    each lookup a sighting as in ``HashEmbeddingBag.forward``, and their bags pool on the
    worker. In ``eval()`` mode a hash table reads without sighting, in a lookup of its own.

    Args:
        tables: ``{feature: mpisync.EmbeddingBag or mpisync.HashEmbeddingBag}``; all held
            by one SyncReplicasOptimizer.

    Raises:
        TypeError: a table that is not an ``mpisync.EmbeddingBag`` or
            ``mpisync.HashEmbeddingBag``.
        ValueError: one table under two features.

    Example::

        ebc = mpisync.EmbeddingBagCollection({
            "user": mpisync.EmbeddingBag(1_000_000, 16, mode="sum"),
            "item": mpisync.EmbeddingBag(500_000, 16, mode="sum")})
        pooled = ebc({"user": (user_ids, user_offsets), "item": item_ids_2d})
        x = torch.cat([pooled["user"], pooled["item"]], dim=1)
        x = ebc(kjt).values()          # a KeyedJaggedTensor of both: the same columns
    """

    def __init__(self, tables: Mapping[str, EmbeddingBag | HashEmbeddingBag]) -> None:
        super().__init__()
        for name, table in tables.items():
            if not isinstance(table, (EmbeddingBag, HashEmbeddingBag)):
                raise TypeError(f"table {name!r} is a {type(table).__name__}; expected an "
                                f"mpisync.EmbeddingBag or mpisync.HashEmbeddingBag")
        if len({id(t) for t in tables.values()}) != len(tables):
            raise ValueError("a table appears under two features; give each feature its own "
                             "table")
        self.tables = torch.nn.ModuleDict(tables)

    def _table(self, name: str) -> EmbeddingBag | HashEmbeddingBag:
        """The table of feature ``name`` (a ModuleDict's items are typed as any Module;
        ``__init__`` checked that each is an EmbeddingBag or a HashEmbeddingBag)."""
        return cast("EmbeddingBag | HashEmbeddingBag", self.tables[name])

    def forward(self, features: Mapping[str, object] | Any
                ) -> dict[str, torch.Tensor] | KeyedTensor:
        """Every feature's bags pooled by its table, in one exchange with the ps ranks.

        Local to this worker: one message to each ps rank holding shards of any table.

        Args:
            features: ``{feature: input}`` for every feature of the collection, an input
                being a 2-D tensor of ids, ``(ids, offsets[, per_sample_weights])`` or a
                dict with those keys; or a TorchRec ``KeyedJaggedTensor`` (or any object
                with its ``keys()``, ``values()``, ``lengths()`` or ``offsets()`` and
                ``weights_or_none()``) holding every feature, the same number of bags
                for each (its ``stride()``).

        Returns:
            For a dict, ``{feature: (number of bags, embedding_dim)}``; for a
            ``KeyedJaggedTensor``, a ``KeyedTensor`` of ``(stride, sum of the dims)``;
            both in the collection's order.

        Raises:
            KeyError: a feature without a table, or a table without an input.
            TypeError: an input of another form.
            ValueError: tables held by different optimizers, a ``KeyedJaggedTensor``
                whose lengths are negative, do not sum to its number of ids or are not
                the same number per key, whose weights are not one per id, or that has a
                variable batch per feature; or any refusal of ``EmbeddingBag.forward``;
                all before anything is sent.
        """
        label = self._table(next(iter(self.tables))).table.label if len(self.tables) else \
            "this worker"
        if not is_keyed_jagged(features):
            return self._pooled(features, label)
        inputs = {}
        for key, (ids, ends, weights) in _jagged_features(features, label).items():
            last = key in self.tables and getattr(self._table(key), "include_last_offset",
                                                  False)
            inputs[key] = (ids, ends if last else ends[:-1], weights)
        pooled = self._pooled(inputs, label)
        if not pooled:
            return KeyedTensor([], [], torch.empty(0, 0))
        return KeyedTensor(list(pooled), [self._table(name).embedding_dim for name in pooled],
                           torch.cat(list(pooled.values()), dim=1))

    def _pooled(self, features: Mapping[str, object], label: str) -> dict[str, torch.Tensor]:
        """``{feature: pooled}`` of ``{feature: input}``, in one exchange."""
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
        plans, apart = [], {}
        for name in self.tables:
            table, args = self._table(name), _arguments(name, features[name])
            if isinstance(table, HashEmbeddingBag) and not table.training:
                apart[name] = args       # a read without sighting: its own lookup, below
                continue
            plans.append((name, table.plan(*args)))
        if not plans:
            return {name: self._table(name)(*apart[name]) for name in self.tables}
        channels = {id(self._table(name).table.channel): name for name, _ in plans}
        if len(channels) > 1:
            names = list(channels.values())
            info = self._table(names[0]).table
            raise ValueError(f"{info.label}: the tables of features {names} belong to "
                             f"different SyncReplicasOptimizers; one collection looks up the "
                             f"tables of one optimizer")
        channel = self._table(plans[0][0]).table.channel
        outs = channel.exchange([request for _, (request, _) in plans])
        done = {name: finish(out) for (name, (_, finish)), out in zip(plans, outs)}
        return {name: done[name] if name in done else self._table(name)(*apart[name])
                for name in self.tables}
