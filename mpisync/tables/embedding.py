"""Embedding tables: modules whose rows live on the ps ranks, and tables whose rows travel."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.nn import functional as F

from ..native import kernels
from ..protocol import partition
from ..protocol.bags import POOL_CHOICES, bags_of, fewest_unique_to_pool
from ..protocol.tables import TableInfo
from ..worker.exchange import Request
from . import bagrows

if TYPE_CHECKING:
    from torch.types import Device

    from ..protocol.bags import Bags
    from ..protocol.partition import Partitioner

__all__ = ["Embedding", "EmbeddingBag", "TableParameter", "check_id_tensor", "live_table"]


_Info = TypeVar("_Info", bound=TableInfo)

class TableParameter(torch.nn.Parameter):
    """The stand-in parameter of an ``mpisync.Embedding``: empty; the table is on the ps ranks.

    It sits in the model's parameters and the optimizer's param groups like any
    parameter, so that the group's hyper-parameters and schedules apply to the table.
    """

    _mpisync_table: TableInfo

    def __deepcopy__(self, memo: dict) -> TableParameter:
        """A copy whose table is the same one once a SyncReplicasOptimizer serves it (the
        rows live on the ps ranks: the copy looks them up as the original does), and a
        table of its own before (its initial ``weight=`` copied), as ``nn.Embedding``'s."""
        if id(self) in memo:
            return memo[id(self)]
        out = type(self)(self.data.clone(), self.requires_grad)
        memo[id(self)] = out
        info = self._mpisync_table
        out._mpisync_table = info if info.channel is not None else copy.deepcopy(info, memo)
        return out

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save(model)``) as a ``TableParameter`` with its table, where
        torch's ``Parameter`` would come back as a plain one."""
        return _rebuild_table_parameter, (self.data, self.requires_grad, self._mpisync_table)

    # torch's Tensor.__repr__ is unannotated, and mypy rejects any override of its
    # keyword-only tensor_contents, even one with the same signature
    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        t = self._mpisync_table
        return f"TableParameter({t.num_rows} x {t.dim}, on the ps ranks)"


def _rebuild_table_parameter(data: torch.Tensor, requires_grad: bool,
                             info: TableInfo) -> TableParameter:
    out = TableParameter(data, requires_grad)
    out._mpisync_table = info
    return out


def live_table(info: _Info, what: str) -> _Info:
    """``info``, checked to be served by the ps ranks now (a RuntimeError naming why not)."""
    if info.channel is None:
        if info.name is not None:
            raise RuntimeError(f"{info.label}: {what} {info.name!r} was called after its "
                               f"SyncReplicasOptimizer was closed; its table is gone with "
                               f"the ps ranks' service")
        if info.left_out is not None:
            raise RuntimeError(f"{info.label}: {what} {info.left_out!r} is in none of the "
                               f"param groups of the torch optimizer given to this worker's "
                               f"SyncReplicasOptimizer, and no other one holds it, so no ps "
                               f"rank holds its table: give its weight to the torch "
                               f"optimizer of a SyncReplicasOptimizer before its first "
                               f"lookup (a frozen table too: requires_grad=False keeps it "
                               f"from being stepped)")
        raise RuntimeError(f"{info.label}: {what} was called before a "
                           f"SyncReplicasOptimizer holding its weight was created; its "
                           f"table lives on the ps ranks from then on (its torch optimizer "
                           f"must hold the weight: a frozen table too, which "
                           f"requires_grad=False keeps from being stepped)")
    return info


def check_id_tensor(ids: object, info: TableInfo, what: str) -> None:
    """A TypeError unless ``ids`` is a tensor of int64 or int32 ids."""
    if not torch.is_tensor(ids):
        raise TypeError(f"{info.label}: {what} {info.name!r} got {type(ids).__name__}; "
                        f"expected an integer tensor of ids")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{info.label}: {what} {info.name!r} got ids of dtype {ids.dtype}; "
                        f"expected an integer dtype (torch.int64 or torch.int32)")


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids.long(), sorted=True, return_inverse=True)``; on the host with a hash
    table where the kernels are built (``kernels.unique_inverse``: only the distinct ids are
    sorted)."""
    if ids.device.type == "cpu" and kernels.available():
        return kernels.unique_inverse(ids)
    return torch.unique(ids.long(), sorted=True, return_inverse=True)


def _check_ids(ids: torch.Tensor, info: TableInfo, what: str) -> None:
    check_id_tensor(ids, info, what)
    if ids.numel() and not kernels.all_below(ids.reshape(-1), info.num_rows):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= info.num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{info.label}: {what} {info.name!r} got id {bad}, outside "
                             f"[0, {info.num_rows}) (its num_embeddings)")


def _usable_device(device: Device, what: str) -> torch.device | None:
    """``device`` as a ``torch.device``, or a ValueError (naming ``what``, the table's
    arguments) when this process's torch cannot put tensors there: CUDA that is not
    available or has no such ordinal is asked of ``torch.cuda`` (no context is made); any
    other device is tried with an empty tensor."""
    if device is None:
        return None
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{what}: device {device!r} is not a device torch knows: "
                         f"{exc}") from None
    if place.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}: this process's torch cannot use device {device!r}: "
                             f"CUDA is not available (torch.cuda.is_available() is False); "
                             f"leave device out (the rows come back on the ids' device) or "
                             f"give one this process has")
        count = torch.cuda.device_count()
        if place.index is not None and place.index >= count:
            raise ValueError(f"{what}: this process's torch cannot use device {device!r}: "
                             f"it sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        return place
    try:
        torch.empty(0, device=place)
    except Exception as exc:  # noqa: BLE001 (torch raises several kinds; all are refusals)
        said = str(exc).strip().split("\n")[0]       # torch's first line ...
        if len(said) > 200:                             # ... or sentence, not its backends
            said = said.split(". ")[0] + "."
        raise ValueError(f"{what}: this process's torch cannot use device {device!r}: "
                         f"{type(exc).__name__}: {said}") from None
    return place


class _TableModule(torch.nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 partitioner: Partitioner | None, partition_strategy: str,
                 weight: torch.Tensor | None, seed: int, padding_idx: int | None,
                 dtype: torch.dtype, device: Device = None) -> None:
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim),
                            ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if partition_strategy not in partition.STRATEGIES:
            raise ValueError(f"partition_strategy must be one of {partition.STRATEGIES}, got "
                             f"{partition_strategy!r}")
        if padding_idx is not None:
            if padding_idx < 0:
                padding_idx += num_embeddings
            if not 0 <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings, got {padding_idx}")
        if weight is not None:
            if not torch.is_tensor(weight) or weight.dim() != 2:
                raise ValueError(f"weight must be a 2-dimensional tensor, got "
                                 f"{getattr(weight, 'shape', type(weight).__name__)}")
            dtype = weight.dtype
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.device = _usable_device(
            device, f"mpisync.{type(self).__name__}({num_embeddings}, {embedding_dim}, "
                    f"device={device!r})")
        info = TableInfo(num_embeddings, embedding_dim, partitioner, partition_strategy,
                         None if weight is None else weight.detach().clone(), seed, padding_idx,
                         dtype)
        stand_in = TableParameter(torch.empty(0, embedding_dim, dtype=dtype))
        stand_in._mpisync_table = info
        self.weight = stand_in

    @property
    def table(self) -> TableInfo:
        """What the optimizer learns of this table: its shape, partitioner, strategy,
        initial values and, once an optimizer serves it, the channel to its ps ranks."""
        return self.weight._mpisync_table

    def _live(self, what: str) -> TableInfo:
        """The table, checked to be served by the ps ranks now."""
        return live_table(self.table, what)

    def _rows(self, ids: torch.Tensor, what: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the unique ids' rows, the index of each id among them, the unique ids)."""
        info = self._live(what)
        _check_ids(ids, info, what)
        device = ids.device if self.device is None else self.device
        unique, inverse = unique_ids(ids)
        unique = unique.cpu()            # the batch's unique ids go to the host, ...
        rows = info.channel.lookup(info, unique)
        # ... and their rows come back to the device: never the table (the copy's backward
        # brings the rows' gradients to the host, where the push takes them)
        return rows.to(device), inverse.to(device), unique

    def _on_host(self, *tensors: Any) -> tuple[list[Any], torch.device]:
        """The tensors on the host (ids cross the bus there), and the device for the output;
        what is not a tensor is passed as it is, for the checks to name."""
        device = next((t.device for t in tensors if torch.is_tensor(t)), torch.device("cpu"))
        device = device if self.device is None else self.device
        return [t.cpu() if torch.is_tensor(t) else t for t in tensors], device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` (a copy, without autograd): for evaluation or export."""
        with torch.no_grad():
            rows, inverse, _ = self._rows(ids, "rows() of")
            return rows[inverse]

    def extra_repr(self) -> str:
        """The table's shape and partition strategy, for ``repr(model)``."""
        t = self.table
        return (f"{self.num_embeddings}, {self.embedding_dim}, partition_strategy="
                f"{t.strategy!r}, on the ps ranks")


class Embedding(_TableModule):
    """An embedding table that lives on the ps ranks only, partitioned across them.

    ``forward(ids)`` sends the batch's unique ids to the ps ranks that own them (one
    message per ps rank) and returns their rows, with autograd; ``step()`` of the
    ``SyncReplicasOptimizer`` holding ``self.weight`` pushes the rows' gradients, and the
    wrapped optimizer updates those rows where they live, its state beside them. A
    worker's memory does not depend on the table's size.

    Args:
        num_embeddings, embedding_dim: the table's shape.
        partitioner: how many shards (``mpisync.fixed_size(n)``, ``min_max``,
            ``axis_size``); default: one shard per ps rank.
        partition_strategy: ``"mod"`` (id ``i`` in shard ``i % n``) or ``"div"``
            (contiguous ranges), as TensorFlow's ``embedding_lookup``.
        weight: initial values, the same on every worker (the chief's are used);
            default: ``N(0, 1)`` drawn on the ps ranks, shard by shard, from ``seed``.
        padding_idx: that row gets no gradient, and starts at zero.
        device: where ``forward`` returns the rows; default: the device of the ids. On a
            GPU worker only the batch's unique ids and their rows cross the bus, and the
            rows' gradients on the way back; the table stays on the ps ranks.

    Raises:
        ValueError: a negative size or seed, an unknown ``partition_strategy``, a
            ``padding_idx`` outside the table, a ``weight`` that is not 2-dimensional, or
            a ``device`` this process's torch cannot use (e.g. ``"cuda"`` without CUDA).

    Example::

        emb = mpisync.Embedding(10_000_000, 64, partitioner=mpisync.fixed_size(8))
        model = torch.nn.Sequential(emb, torch.nn.Flatten(), torch.nn.Linear(64 * 3, 1))
        opt = mpisync.SyncReplicasOptimizer(          # on every worker, after the tables
            torch.optim.Adagrad(model.parameters(), lr=0.05),
            named_parameters=model.named_parameters())
        out = model(torch.tensor([[1, 2, 9_999_999]]))   # rows come from the ps ranks
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 partitioner: Partitioner | None = None, partition_strategy: str = "mod",
                 weight: torch.Tensor | None = None, seed: int = 0,
                 padding_idx: int | None = None, dtype: torch.dtype = torch.float32,
                 device: Device = None) -> None:
        super().__init__(num_embeddings, embedding_dim, partitioner, partition_strategy,
                         weight, seed, padding_idx, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, with autograd: the output has ``ids``' shape plus
        ``embedding_dim``.

        Sends one lookup to each ps rank owning some of the batch's unique ids and waits
        for its rows; local to this worker (the others need not look anything up).

        Args:
            ids: int64 or int32 ids in ``[0, num_embeddings)``, any shape.

        Returns:
            The rows on ``device`` (default: the device of ``ids``).

        Raises:
            TypeError: ``ids`` is not a tensor of int64 or int32.
            IndexError: an id outside the table, naming it, the table and this rank.
            RuntimeError: called before a ``SyncReplicasOptimizer`` over this table was
                created, or after it was closed.
        """
        rows, inverse, _ = self._rows(ids, "mpisync.Embedding")
        return F.embedding(inverse, rows)


class EmbeddingBag(_TableModule):
    """``nn.EmbeddingBag`` over a table on the ps ranks: sums, means or maxima of rows per bag.

    ``forward(input, offsets=None, per_sample_weights=None)`` as ``nn.EmbeddingBag``: a
    2-D input is one bag per row; a 1-D input needs ``offsets`` (where each bag starts;
    with ``include_last_offset=True`` one more, the end of the last bag); empty bags give
    zeros; ``padding_idx`` is left out of its bag (and of its mean);
    ``per_sample_weights`` (the input's shape) only with ``mode="sum"``. Bad arguments
    raise before anything is sent, naming the table and the rank.

    ``pool_on_ps``: ``"auto"`` (default) picks, per forward, the way that moves fewer
    bytes, below. ``False`` looks up the batch's unique rows and pools them here (as
    ``Embedding``); ``True`` sends each ps rank the ids it owns with their bags (and
    weights) and gets back one sum per bag from each, instead of rows; the push then sends
    each bag's gradient with the ids again, and the ps turns it into row gradients (the
    step is the same, within float rounding). ``"auto"`` picks, per forward, the way that
    moves fewer bytes (``mpisync.protocol.bags.pooling_pays``): pooling pays when bags hold more
    ids than a bag's pooled row costs, e.g. bags of 20 rarely repeated ids; not when ids
    repeat across the batch. ``mode="max"`` needs the rows, and per_sample_weights that
    require a gradient too: ``"auto"`` looks the rows up for them, ``True`` is refused.
    Otherwise as ``Embedding``: the output is on ``device``, default the input's device
    (the ids and offsets go to the host, the pooled rows come back).

    The arguments ``num_embeddings``, ``embedding_dim``, ``partitioner``,
    ``partition_strategy``, ``weight``, ``seed``, ``padding_idx``, ``dtype`` and ``device``
    are as ``Embedding``'s.

    Args:
        mode: ``"sum"``, ``"mean"`` (default) or ``"max"`` over each bag's rows.
        include_last_offset: as ``nn.EmbeddingBag``: ``offsets`` ends with the end of the
            last bag.
        pool_on_ps: ``"auto"`` (default), ``False`` or ``True``, see above.

    Raises:
        ValueError: an unknown ``mode`` or ``pool_on_ps``, ``pool_on_ps=True`` with
            ``mode="max"``, or any refusal of ``Embedding``.

    Example::

        bag = mpisync.EmbeddingBag(1_000_000, 32, mode="sum")
        ids = torch.tensor([3, 7, 7, 42, 5])
        offsets = torch.tensor([0, 3])           # two bags: [3, 7, 7] and [42, 5]
        pooled = bag(ids, offsets)               # shape (2, 32), once an optimizer holds it
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "mean",
                 partitioner: Partitioner | None = None, partition_strategy: str = "mod",
                 weight: torch.Tensor | None = None, seed: int = 0,
                 padding_idx: int | None = None, include_last_offset: bool = False,
                 pool_on_ps: bool | str = "auto", dtype: torch.dtype = torch.float32,
                 device: Device = None) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if not any(pool_on_ps is c or (isinstance(c, str) and pool_on_ps == c)
                   for c in POOL_CHOICES):
            raise ValueError(f"pool_on_ps must be False, True or 'auto', got {pool_on_ps!r}")
        if pool_on_ps is True and mode == "max":
            raise ValueError("pool_on_ps=True cannot pool mode='max' where the rows live (a "
                             "maximum needs every row on the worker); use pool_on_ps=False "
                             "or 'auto' (which looks the rows up for 'max')")
        super().__init__(num_embeddings, embedding_dim, partitioner, partition_strategy,
                         weight, seed, padding_idx, dtype, device)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)
        self.pool_on_ps = pool_on_ps

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Each bag's rows pooled by ``mode``, with autograd, as ``nn.EmbeddingBag``.

        Sends one message to each ps rank owning some of the batch's ids (their rows, or
        their bags' sums with ``pool_on_ps``); local to this worker.

        Args:
            input: int64 or int32 ids: 2-D (one bag per row) or 1-D with ``offsets``.
            offsets: where each bag of a 1-D ``input`` starts.
            per_sample_weights: a weight per id, ``input``'s shape (``mode="sum"`` only).

        Returns:
            ``(number of bags, embedding_dim)`` on ``device`` (default: ``input``'s).

        Raises:
            TypeError, IndexError, RuntimeError: as ``Embedding.forward``.
            ValueError: bad ``offsets`` or ``per_sample_weights``, or weights that need a
                gradient with ``pool_on_ps=True``; naming the table and this rank, before
                anything is sent.
        """
        (input, offsets, per_sample_weights), device = self._on_host(input, offsets,
                                                                    per_sample_weights)
        request, finish = self.plan(input, offsets, per_sample_weights)
        channel = self.table.channel
        if request.bags is None:             # rows: the lookup of Embedding
            return finish(channel.lookup(self.table, request.unique)).to(device)
        return finish(channel.exchange([request])[0]).to(device)

    def plan(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
             per_sample_weights: torch.Tensor | None = None
             ) -> tuple[Request, Callable[[torch.Tensor], torch.Tensor]]:
        """What a forward sends (an ``exchange.Request``) and how it ends: all checked, nothing
        sent. ``EmbeddingBagCollection`` sends the plans of several tables at once."""
        what = "mpisync.EmbeddingBag"
        info = self._live(what)
        _check_ids(input, info, what)
        kw: dict[str, Any] = {"mode": self.mode, "include_last_offset": self.include_last_offset,
              "padding_idx": self.padding_idx, "dtype": info.dtype, "label": info.label,
              "name": info.name}
        channel = info.channel
        index = channel.index_of(info)
        needs_rows = self.mode == "max" or (
            per_sample_weights is not None and per_sample_weights.requires_grad
            and torch.is_grad_enabled())
        if self.pool_on_ps is True and needs_rows:
            bags_of(input, offsets, per_sample_weights, flatten=False, **kw)
            raise ValueError(f"{info.label}: {what} {info.name!r} got per_sample_weights that "
                             f"require a gradient; pool_on_ps=True cannot give them one (their "
                             f"gradient needs the rows): use pool_on_ps=False or 'auto'")
        unique = inverse = bags = None
        pool = self.pool_on_ps is True
        if self.pool_on_ps == "auto" and not needs_rows:
            bags = bags_of(input, offsets, per_sample_weights, **kw)
            assert bags is not None          # flatten=True gives the bags
            spec = channel.tables[index].spec
            least = fewest_unique_to_pool(len(bags.ids), bags.num_bags, spec.row_bytes,
                                          0 if bags.weights is None else spec.dtype.itemsize,
                                          len(set(spec.owners)))
            if kernels.available():          # counted until it is known, not sorted
                pool = kernels.holds_distinct(input, least)
            else:
                unique, inverse = unique_ids(input)
                pool = len(unique) >= least
        if pool:
            if bags is None:                 # "auto" flattened them already
                bags = bags_of(input, offsets, per_sample_weights, **kw)
            assert bags is not None
            return _pooled_request(index, bags, self.mode)
        flat = bags if bags is not None else \
            bags_of(input, offsets, per_sample_weights, flatten=self.mode != "max", **kw)
        if unique is None:
            unique, inverse = unique_ids(input)
        assert inverse is not None           # computed with unique
        pad = None
        if self.padding_idx is not None:     # as torch: left out of its bag (and its mean)
            at = int(torch.searchsorted(unique, self.padding_idx))
            if at < len(unique) and int(unique[at]) == self.padding_idx:
                pad = at

        def finish(rows: torch.Tensor) -> torch.Tensor:
            return bagrows.pool(rows, inverse.view(input.shape), unique, flat, offsets,
                                self.mode, per_sample_weights, pad, self.include_last_offset)

        return Request(index, unique=unique), finish

    def extra_repr(self) -> str:
        """The table's shape, strategy, ``mode`` and ``pool_on_ps``, for ``repr(model)``."""
        return (super().extra_repr() + f", mode={self.mode!r}"
                + (f", pool_on_ps={self.pool_on_ps!r}" if self.pool_on_ps is not False else ""))


def _pooled_request(index: int, bags: Bags, mode: str
                    ) -> tuple[Request, Callable[[torch.Tensor], torch.Tensor]]:
    """The request of bags pooled at the owners, and the sum or mean it ends with."""
    def finish(sums: torch.Tensor) -> torch.Tensor:
        if mode == "mean":                  # as torch: padding left out of the count
            return sums / bags.counts.clamp(min=1).to(sums.dtype).unsqueeze(1)
        return sums.clone()     # a copy: the sums are the leaf whose gradient the push sends

    return Request(index, bags=bags), finish
