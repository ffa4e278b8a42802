"""Placement plans: which parameter-server rank owns each parameter, computed without messages."""

from __future__ import annotations

import difflib
import hashlib
import heapq
import json
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import SupportsIndex

__all__ = ["STRATEGIES", "Plan", "check_groups", "greedy", "greedy_sorted", "plan", "round_robin"]

#: Built-in strategy names; the first one is the default.
STRATEGIES = ("greedy_sorted", "greedy", "round_robin")

#: A custom strategy: ``fn(name, nbytes, ps_bytes) -> ps index``, called in creation order.
StrategyFn = Callable[[str, int, tuple[int, ...]], int]

_DIGEST_VERSION = "mpisync.placement/1"


@dataclass(frozen=True)
class Plan:
    """Owner of every parameter, one entry per name in creation order.

    Every rank builds its own ``Plan`` from the same names and sizes and gets the same
    one; compare :meth:`digest` across ranks to check that they did. ``colocate`` lists
    the groups of names that share their owner (each group in creation order).
    """

    names: tuple[str, ...]
    sizes_bytes: tuple[int, ...]
    owners: tuple[int, ...]
    num_ps: int
    strategy: str
    rows: tuple[str, ...] = ()
    colocate: tuple[tuple[str, ...], ...] = ()
    _index: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        num_ps = _check_num_ps(self.num_ps)
        names = _check_names(self.names)
        for field_name in ("sizes_bytes", "owners"):
            if len(getattr(self, field_name)) != len(names):
                raise ValueError(
                    f"got {len(getattr(self, field_name))} {field_name} for {len(names)} "
                    "names; expected one per name"
                )
        if self.rows and len(self.rows) != len(names):
            raise ValueError(f"got {len(self.rows)} rows for {len(names)} names; expected one "
                             f"per name, or none")
        if not isinstance(self.strategy, str):
            raise TypeError(
                f"strategy must be a str, got {type(self.strategy).__name__} {self.strategy!r}"
            )
        sizes = _check_sizes(self.sizes_bytes, names)
        owners = tuple(
            _check_owner(owner, name, num_ps, source="owners")
            for name, owner in zip(names, self.owners)
        )
        # Normalise to plain tuples of plain ints so that equality and digest do not
        # depend on the container type the caller passed in.
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sizes_bytes", sizes)
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "num_ps", num_ps)
        object.__setattr__(self, "_index", {name: i for i, name in enumerate(names)})
        groups = _canonical(check_groups(self.colocate), self._index)
        object.__setattr__(self, "colocate", groups)
        for group in groups:
            if len({self.owner(n) for n in group}) > 1:
                raise ValueError(f"colocated names {list(group)} have owners "
                                 f"{[self.owner(n) for n in group]}; a group has one owner")

    def owner(self, name: str) -> int:
        """Return the ps index that owns parameter ``name``.

        Raises:
            KeyError: if ``name`` is not in the plan.
        """
        try:
            return self.owners[self._index[name]]
        except KeyError:
            raise KeyError(
                f"parameter {name!r} is not in the placement plan ({len(self.names)} parameters)"
            ) from None

    @property
    def ps_bytes(self) -> tuple[int, ...]:
        """Total bytes owned by each ps index."""
        loads = [0] * self.num_ps
        for size, owner in zip(self.sizes_bytes, self.owners):
            loads[owner] += size
        return tuple(loads)

    def names_on(self, ps: int) -> list[str]:
        """Return the names owned by ps index ``ps``, in creation order.

        Raises:
            ValueError: if ``ps`` is not in ``range(num_ps)``.
        """
        if isinstance(ps, bool) or not isinstance(ps, int) or not 0 <= ps < self.num_ps:
            raise ValueError(f"ps index must be an int in range({self.num_ps}), got {ps!r}")
        return [name for name, owner in zip(self.names, self.owners) if owner == ps]

    @property
    def max_load_bytes(self) -> int:
        """Bytes held by the most loaded ps index (0 for an empty plan)."""
        return max(self.ps_bytes)

    def digest(self) -> str:
        """Return a short hex digest of the assignment (names, sizes, owners, num_ps).

        The strategy name is left out: two plans that put every parameter in the same
        place have the same digest, whichever strategy produced them.
        """
        canonical = json.dumps(
            [
                _DIGEST_VERSION,
                self.num_ps,
                list(self.names),
                list(self.sizes_bytes),
                list(self.owners),
            ],
            ensure_ascii=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]

    def table(self) -> str:
        """Return a table: one row per parameter or shard, then each ps index's bytes and share.

        A shard's row says which rows of its tensor it holds.
        """
        ps_bytes = self.ps_bytes
        total = sum(ps_bytes)
        name_w = max([len("name")] + [len(name) for name in self.names])
        bytes_w = max([len("bytes"), len(str(total))])
        rows = self.rows if any(self.rows) else ("",) * len(self.names)
        group_of = {n: f"g{i}" for i, group in enumerate(self.colocate) for n in group}
        title = (
            f"placement: {len(self.names)} parameters and shards on {self.num_ps} ps "
            f"(strategy {self.strategy}, digest {self.digest()}"
            + (f", {len(self.colocate)} colocated groups" if self.colocate else "") + ")"
        )
        with_w = 7 if self.colocate else 0
        lines = [title, f"{'name':<{name_w}}  {'bytes':>{bytes_w}}  ps"
                 + ("  colocated" if with_w else "") + ("  rows" if any(rows) else "")]
        for name, size, owner, r in zip(self.names, self.sizes_bytes, self.owners, rows):
            group = f"  {group_of.get(name, '-'):<{with_w + 2}}" if with_w else ""
            lines.append(f"{name:<{name_w}}  {size:>{bytes_w}}  {owner:<2}{group}  {r}".rstrip())
        lines.append("")
        lines.append(f"{'ps':<{name_w}}  {'bytes':>{bytes_w}}   share")
        for ps, load in enumerate(ps_bytes):
            share = 100.0 * load / total if total else 0.0
            lines.append(f"{ps:<{name_w}}  {load:>{bytes_w}}  {share:5.1f}%")
        lines.append(f"{'total':<{name_w}}  {total:>{bytes_w}}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def round_robin(sizes_bytes: Sequence[int], num_ps: int) -> list[int]:
    """Assign the i-th parameter to ps ``i % num_ps`` (TensorFlow's default strategy).

    Args:
        sizes_bytes: size of each parameter in bytes, in creation order (unused except
            for its length, but validated like the other strategies).
        num_ps: number of parameter-server ranks.

    Returns:
        The owning ps index of each parameter, in creation order.

    Raises:
        TypeError, ValueError: on a bad ``num_ps`` or size.
    """
    num_ps = _check_num_ps(num_ps)
    sizes = _check_sizes(sizes_bytes)
    return [i % num_ps for i in range(len(sizes))]


def greedy(sizes_bytes: Sequence[int], num_ps: int) -> list[int]:
    """Assign each parameter, in creation order, to the least-loaded ps (lowest index on ties).

    Same choices as TensorFlow contrib's ``GreedyLoadBalancingStrategy`` with
    ``byte_size_load_fn``.

    Args:
        sizes_bytes: size of each parameter in bytes, in creation order.
        num_ps: number of parameter-server ranks.

    Returns:
        The owning ps index of each parameter, in creation order.

    Raises:
        TypeError, ValueError: on a bad ``num_ps`` or size.
    """
    num_ps = _check_num_ps(num_ps)
    sizes = _check_sizes(sizes_bytes)
    return _least_loaded(sizes, range(len(sizes)), num_ps)


def greedy_sorted(sizes_bytes: Sequence[int], num_ps: int) -> list[int]:
    """Assign parameters largest first to the least-loaded ps (longest-processing-time).

    Sizes are sorted descending with a stable sort, so equal sizes keep creation order;
    ties between ps loads go to the lowest ps index. The max load is at most
    ``(4/3 - 1/(3*num_ps))`` times the optimum.

    Args:
        sizes_bytes: size of each parameter in bytes, in creation order.
        num_ps: number of parameter-server ranks.

    Returns:
        The owning ps index of each parameter, in creation order.

    Raises:
        TypeError, ValueError: on a bad ``num_ps`` or size.
    """
    num_ps = _check_num_ps(num_ps)
    sizes = _check_sizes(sizes_bytes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    return _least_loaded(sizes, order, num_ps)


_BUILTIN: dict[str, Callable[[Sequence[int], int], list[int]]] = {
    "greedy_sorted": greedy_sorted,
    "greedy": greedy,
    "round_robin": round_robin,
}


def plan(
    names: Iterable[str],
    sizes_bytes: Iterable[int],
    num_ps: int,
    strategy: str | StrategyFn = "greedy_sorted",
    rows: Sequence[str] = (),
    colocate: Iterable[Sequence[str]] = (),
    max_ps_bytes: int | None = None,
) -> Plan:
    """Place every parameter on one ps index; deterministic, so every rank gets the same plan.

    Args:
        names: unique parameter names, in creation order.
        sizes_bytes: size of each parameter in bytes, same order as ``names``.
        num_ps: number of parameter-server ranks (>= 1).
        strategy: one of :data:`STRATEGIES`, or a callable
            ``fn(name, nbytes, ps_bytes) -> ps index`` called in creation order with
            the bytes placed on each ps so far.
        rows: for the table, what rows each name holds ("" for a whole tensor).
        colocate: groups of names that must share their ps (TensorFlow's
            ``colocate_vars_with``), e.g. ``[["enc.weight", "enc.bias"]]``. Every strategy
            places a group as one item of the group's total size, where its first member
            comes in creation order: ``round_robin`` gives it one turn, the greedy
            strategies one choice by its total bytes, and a callable is called once, for
            the first member with the group's total bytes.
        max_ps_bytes: the most bytes one ps may hold; a plan that puts more on a ps (or a
            group larger than that) is refused. Where the greedy strategies' choices put
            more on a ps, they pack the items largest first, each on the first ps with room
            (first-fit decreasing), and refuse only when that finds no plan either.

    Returns:
        The :class:`Plan`.

    Raises:
        TypeError: ``num_ps`` is not an int, a name is not a str, a size is not an int,
            ``strategy`` is neither a str nor callable, or ``colocate`` is not a list of
            lists of names.
        ValueError: ``num_ps < 1``, duplicate names, a length mismatch, a negative size,
            an unknown strategy name, a callable strategy returning a bad index, a
            colocated name that is not in ``names`` or is in two groups, or a plan over
            ``max_ps_bytes``.
    """
    num_ps = _check_num_ps(num_ps)
    names = _check_names(names)
    sizes = tuple(sizes_bytes)
    if len(sizes) != len(names):
        raise ValueError(
            f"got {len(names)} names but {len(sizes)} sizes; expected one size per name"
        )
    sizes = _check_sizes(sizes, names)
    index = {name: i for i, name in enumerate(names)}
    groups = _canonical(check_groups(colocate), index)
    items = _items(len(names), groups, index)        # each a list of name indices
    item_sizes = [sum(sizes[i] for i in item) for item in items]
    if max_ps_bytes is not None:
        _check_cap(max_ps_bytes, items, item_sizes, names)

    if isinstance(strategy, str):
        if strategy not in _BUILTIN:
            raise ValueError(
                f"unknown placement strategy {strategy!r}; expected one of {STRATEGIES} "
                "or a callable fn(name, nbytes, ps_bytes) -> ps index"
            )
        strategy_name = strategy
        item_owners = _BUILTIN[strategy](item_sizes, num_ps)
    elif callable(strategy):
        builtin_name = next((k for k, fn in _BUILTIN.items() if fn is strategy), None)
        if builtin_name is not None:
            # The module's own functions take (sizes, num_ps): treat them as their names.
            strategy_name = builtin_name
            item_owners = _BUILTIN[builtin_name](item_sizes, num_ps)
        else:
            strategy_name = getattr(strategy, "__name__", type(strategy).__name__)
            item_owners = _call_strategy(strategy, strategy_name,
                                         [names[item[0]] for item in items], item_sizes, num_ps)
    else:
        raise TypeError(
            f"strategy must be a str in {STRATEGIES} or a callable, "
            f"got {type(strategy).__name__} {strategy!r}"
        )
    if (max_ps_bytes is not None and strategy_name in ("greedy", "greedy_sorted")
            and max(_loads(item_owners, item_sizes, num_ps)) > max_ps_bytes):
        item_owners = _first_fit(item_sizes, num_ps, max_ps_bytes) or item_owners
    owners = [0] * len(names)
    for item, owner in zip(items, item_owners):
        for i in item:
            owners[i] = owner
    result = Plan(names, sizes, tuple(owners), num_ps, strategy_name, tuple(rows), groups)
    if max_ps_bytes is not None and result.max_load_bytes > max_ps_bytes:
        ps = result.ps_bytes.index(result.max_load_bytes)
        raise ValueError(f"placement {strategy_name} puts {result.max_load_bytes} bytes on ps "
                         f"{ps}, over max_ps_bytes={max_ps_bytes}; the ps hold "
                         f"{list(result.ps_bytes)} bytes: add ps ranks, split large parameters "
                         f"(a partitioner) or use a greedy strategy")
    return result


def _loads(owners: Sequence[int], sizes: Sequence[int], num_ps: int) -> list[int]:
    loads = [0] * num_ps
    for owner, size in zip(owners, sizes):
        loads[owner] += size
    return loads


def _first_fit(sizes: Sequence[int], num_ps: int, cap: int) -> list[int] | None:
    """Largest first, each item to the first ps with room under ``cap`` (first-fit
    decreasing): a plan under the cap where the least-loaded choice found none, or None."""
    owners, loads = [0] * len(sizes), [0] * num_ps
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        ps = next((p for p in range(num_ps) if loads[p] + sizes[i] <= cap), None)
        if ps is None:
            return None
        owners[i], loads[ps] = ps, loads[ps] + sizes[i]
    return owners


def check_groups(colocate: Iterable[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """``colocate`` as a tuple of groups of names, after checking its types and shape.

    Raises:
        TypeError: not a list of lists of str (a group given as one str included).
        ValueError: an empty group, or a name in two groups (or twice in one).
    """
    if isinstance(colocate, (str, bytes)) or not isinstance(colocate, Iterable):
        raise TypeError(f"colocate must be a list of groups of names, e.g. "
                        f"[['enc.weight', 'enc.bias']], got {colocate!r}")
    groups: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for g, group in enumerate(colocate):
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise TypeError(f"colocate group {g} must be a list of names, got {group!r}; "
                            f"write colocate=[[{group!r}, ...]]")
        group = tuple(group)
        if not group:
            raise ValueError(f"colocate group {g} is empty")
        for name in group:
            if not isinstance(name, str):
                raise TypeError(f"colocate group {g} holds {type(name).__name__} {name!r}; "
                                f"expected parameter names (str)")
            if name in seen and seen[name] == g:
                raise ValueError(f"{name!r} is in colocate group {g} twice; name it once")
            if name in seen:
                raise ValueError(f"{name!r} is in colocate groups {seen[name]} and {g}; a name "
                                 f"may be in one group only (merge the groups)")
            seen[name] = g
        groups.append(group)
    return tuple(groups)


def _canonical(groups: Sequence[Sequence[str]], index: dict[str, int]
               ) -> tuple[tuple[str, ...], ...]:
    """Groups in creation order (members, then groups by first member); unknown names refused."""
    for group in groups:
        for name in group:
            if name not in index:
                close = difflib.get_close_matches(name, list(index), n=3)
                hint = f"; did you mean {close}?" if close else ""
                raise ValueError(f"colocate: {name!r} is not one of the plan's {len(index)} "
                                 f"names{hint}")
    ordered = [tuple(sorted(group, key=index.__getitem__)) for group in groups]
    return tuple(sorted(ordered, key=lambda group: index[group[0]]))


def _items(count: int, groups: Sequence[Sequence[str]], index: dict[str, int]) -> list[list[int]]:
    """Units of placement in creation order: each group where its first member is, once."""
    group_of = {index[n]: g for g, group in enumerate(groups) for n in group}
    items, placed = [], set()
    for i in range(count):
        g = group_of.get(i)
        if g is None:
            items.append([i])
        elif g not in placed:
            placed.add(g)
            items.append([index[n] for n in groups[g]])
    return items


def _check_cap(max_ps_bytes, items: list[list[int]], item_sizes: list[int],
               names: Sequence[str]) -> None:
    if isinstance(max_ps_bytes, bool) or not isinstance(max_ps_bytes, int):
        raise TypeError(f"max_ps_bytes must be an int, got {max_ps_bytes!r}")
    for item, size in zip(items, item_sizes):
        if size > max_ps_bytes:
            what = (f"colocated group {[names[i] for i in item]}" if len(item) > 1
                    else f"parameter {names[item[0]]!r}")
            raise ValueError(f"{what} holds {size} bytes, more than one ps may hold "
                             f"(max_ps_bytes={max_ps_bytes}); split it with a partitioner or "
                             f"colocate less")


def _least_loaded(sizes: Sequence[int], order: Iterable[int], num_ps: int) -> list[int]:
    """Visit parameters in ``order``, giving each to the least-loaded ps (lowest index on ties)."""
    # (load, ps) tuples: the heap's minimum is the smallest load, then the lowest index,
    # which is exactly np.argmin over the loads.
    heap = [(0, ps) for ps in range(num_ps)]
    owners = [0] * len(sizes)
    for i in order:
        load, ps = heapq.heappop(heap)
        owners[i] = ps
        heapq.heappush(heap, (load + sizes[i], ps))
    return owners


def _call_strategy(
    fn: StrategyFn, fn_name: str, names: Sequence[str], sizes: Sequence[int], num_ps: int
) -> list[int]:
    """Run a callable strategy in creation order, checking each index it returns."""
    loads = [0] * num_ps
    owners = []
    for name, size in zip(names, sizes):
        ps = _check_owner(fn(name, size, tuple(loads)), name, num_ps, source=f"strategy {fn_name}")
        loads[ps] += size
        owners.append(ps)
    return owners


def _check_owner(value: object, name: str, num_ps: int, source: str) -> int:
    ps = None
    if not isinstance(value, bool) and isinstance(value, SupportsIndex):
        try:
            ps = operator.index(value)  # accepts numpy integers such as np.argmin's result
        except TypeError:
            pass
    if ps is None or not 0 <= ps < num_ps:
        raise ValueError(
            f"{source} gave {value!r} for parameter {name!r}; expected an int in range({num_ps})"
        )
    return ps


def _check_num_ps(num_ps: object) -> int:
    if isinstance(num_ps, bool) or not isinstance(num_ps, int):
        raise TypeError(f"num_ps must be an int, got {type(num_ps).__name__} {num_ps!r}")
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1, got {num_ps}")
    return int(num_ps)


def _check_names(names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of str, got a single str {names!r}")
    names = tuple(names)
    first_seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise TypeError(
                f"parameter names must be str, got {type(name).__name__} {name!r} at position {i}"
            )
        if name in first_seen:
            raise ValueError(
                f"parameter names must be unique, got {name!r} at positions "
                f"{first_seen[name]} and {i}"
            )
        first_seen[name] = i
    return names


def _check_sizes(sizes_bytes: Iterable[int], names: Sequence[str] | None = None) -> tuple[int, ...]:
    sizes = []
    for i, size in enumerate(sizes_bytes):
        label = f"parameter {names[i]!r}" if names is not None else f"sizes_bytes[{i}]"
        if isinstance(size, bool):
            raise TypeError(f"size of {label} must be an int, got bool {size!r}")
        try:
            size = operator.index(size)  # accepts numpy integers, rejects floats
        except TypeError:
            raise TypeError(
                f"size of {label} must be an int, got {type(size).__name__} {size!r}"
            ) from None
        if size < 0:
            raise ValueError(f"size of {label} must be >= 0 bytes, got {size}")
        sizes.append(size)
    return tuple(sizes)
