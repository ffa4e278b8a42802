"""Reductions and broadcasts among the workers: tensors, numbers, and nests of them.

What ``cluster.reduce``, ``cluster.batch_reduce`` and ``cluster.broadcast`` run, on a
communicator of the workers only (the ps ranks take no part). Each call first agrees on
what every worker passed (one small ``allgather``: the operation, a digest of the
structure, any problem a worker found), so that a mismatch is the same clear error on every
worker instead of a hang or garbage; then the values travel fused. Values of at most
``SMALL_BYTES`` (16 KiB; metrics, counts, statistics) travel with the agreement itself and
every worker reduces them in worker order: one collective in all. Larger ones take one
``Allreduce`` per kind of number present (integers, floating point, complex). A broadcast
is one ``bcast`` of the structure and one ``Bcast`` of the tensors' raw bytes.

Result types, for each leaf (a tensor, a Python or NumPy number):

- ``"sum"``, ``"max"``, ``"min"`` keep the dtype (or Python type), as
  ``torch.distributed.all_reduce`` does in place. Integer and bool tensors and NumPy
  integers travel as int64 and are cast back (an integer sum wraps as the dtype does);
  bool: ``"sum"`` and ``"max"`` are a logical or, ``"min"`` a logical and. Python ints
  are exact at any size, as Python's own arithmetic: they travel with the agreement.
  float16, bfloat16 and float32 are summed in float32 (one rounding to the dtype at the
  end), float64 in float64. ``"max"`` and ``"min"`` propagate NaN, as ``torch.maximum``
  does. Complex values support ``"sum"`` and ``"mean"`` only.
- ``"mean"`` is the sum divided by the number of workers. Floating-point and complex
  leaves keep their dtype; integer and bool tensors give ``torch.get_default_dtype()``
  (summed in float64, which never wraps, then divided and cast) and Python ints and
  bools a Python float: a mean of counts is not rounded to an integer.

Results are new tensors, detached from autograd (as ``torch.distributed``'s in-place
collectives leave no graph): reduce the value a loss was computed from, not for its
gradient.
"""
from __future__ import annotations

import functools
import hashlib
import math
import numbers
import pickle
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from mpi4py import MPI

from ..errors import ConfigError, MismatchError
from .agreement import agree, first_problem

__all__ = ["OPS", "SMALL_BYTES", "agree", "batch_reduce", "broadcast", "reduce"]

#: Reductions: the sum, the mean over the workers, the elementwise maximum and minimum.
OPS = ("sum", "mean", "max", "min")
_MPI_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_KINDS = (torch.int64, torch.float32, torch.float64, torch.complex128)   # on the wire
_ALIGN = 16            # bytes: where each tensor of a broadcast starts in its buffer
#: Values of at most this many bytes (on the wire) travel with the agreement itself.
SMALL_BYTES = 16 << 10


class _Leaf:
    """One number or tensor of a value: how it travels and how it comes back.

    A Python int travels as itself (``number``; ``kind`` None), every other leaf as a
    tensor of its ``kind``.
    """

    __slots__ = ("back", "device", "dtype", "kind", "number", "numel", "shape", "tensor")

    def __init__(self, tensor: torch.Tensor | None, back: str, number: int | None = None):
        self.tensor, self.number = tensor, number
        self.back = back                 # "tensor", "ndarray", "numpy", "int", "float", "bool"
        if tensor is None:               # a Python int
            self.dtype = self.kind = self.device = None
            self.shape, self.numel = (), 0
            return
        self.dtype, self.shape = tensor.dtype, tuple(tensor.shape)
        self.numel = tensor.numel()
        self.device = tensor.device
        self.kind = _kind_of(tensor.dtype)

    def signature(self) -> str:
        if self.tensor is None:
            return self.back
        return f"{self.back}:{str(self.dtype).replace('torch.', '')}{list(self.shape)}"


def _kind_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype a leaf travels in."""
    if dtype.is_complex:
        return torch.complex128
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return torch.int64


def _leaf(value, path: str) -> _Leaf:
    """A leaf from a tensor or a number; ConfigError naming ``path`` for anything else."""
    if torch.is_tensor(value):
        if value.is_sparse or value.layout != torch.strided or value.is_quantized:
            what = "quantized" if value.is_quantized else str(value.layout)
            raise ConfigError(f"{path} is a {what} tensor; reduce dense tensors")
        _check_unsigned(value.dtype, path)
        return _Leaf(value.detach(), "tensor")
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
        _check_unsigned(value.dtype, path)
        if isinstance(value, np.ndarray):
            return _Leaf(torch.from_numpy(np.ascontiguousarray(value)), "ndarray")
        return _Leaf(torch.from_numpy(np.asarray(value)), "numpy")
    if isinstance(value, bool):
        return _Leaf(torch.tensor(int(value), dtype=torch.int64), "bool")
    if isinstance(value, numbers.Integral):
        return _Leaf(None, "int", int(value))
    if isinstance(value, numbers.Real):
        return _Leaf(torch.tensor(float(value), dtype=torch.float64), "float")
    raise ConfigError(f"{path} is a {type(value).__name__}; expected a tensor, a number, or a "
                      f"dict, list or tuple of them")


def _check_unsigned(dtype, path: str) -> None:
    """64-bit unsigned integers do not fit the int64 they travel in: refused."""
    if dtype == torch.uint64 or (isinstance(dtype, np.dtype) and dtype == np.uint64):
        raise ConfigError(f"{path} is of dtype uint64, which does not fit int64 on the wire; "
                          f"convert it to int64")


class _Node:
    """A container of a value, its leaves replaced (by their index, for tensors to send).

    ``mapping``: a mapping's keys in the caller's order; None for a list or tuple.
    ``factory``: a ``defaultdict``'s ``default_factory``.
    """

    __slots__ = ("cls", "factory", "items", "mapping")

    def __init__(self, cls: type, items: list, mapping: list | None, factory=None):
        self.cls, self.items, self.mapping, self.factory = cls, items, mapping, factory

    def __reduce__(self):
        return _Node, (self.cls, self.items, self.mapping, self.factory)


def _flatten(value, path: str, leaves: list, tokens: list) -> object:
    """The value's skeleton (containers holding leaf indices); its leaves and signature
    tokens are appended to ``leaves`` and ``tokens``. Mappings go in sorted key order."""
    if isinstance(value, Mapping):
        keys = sorted(value, key=repr)
        tokens.append(f"dict[{', '.join(map(repr, keys))}]")
        return _Node(type(value), [(k, _flatten(value[k], f"{path}[{k!r}]", leaves, tokens))
                                   for k in keys], list(value), _factory(value))
    if isinstance(value, (list, tuple)):
        tokens.append(f"{type(value).__name__}({len(value)})")
        return _Node(type(value), [_flatten(v, f"{path}[{i}]", leaves, tokens)
                                   for i, v in enumerate(value)], None)
    leaves.append(_leaf(value, path))
    tokens.append(leaves[-1].signature())
    return len(leaves) - 1


def _rebuild(skeleton, leaf: Callable):
    """The value of ``skeleton``: its containers rebuilt, each leaf ``x`` as ``leaf(x)``."""
    if not isinstance(skeleton, _Node):
        return leaf(skeleton)
    if skeleton.mapping is not None:            # in this worker's own key order
        got = {k: _rebuild(s, leaf) for k, s in skeleton.items}
        return _container(skeleton, {k: got[k] for k in skeleton.mapping})
    return _container(skeleton, [_rebuild(s, leaf) for s in skeleton.items])


def _factory(mapping):
    """A ``defaultdict``'s ``default_factory`` (None for other mappings)."""
    return mapping.default_factory if isinstance(mapping, defaultdict) else None


def _container(node: _Node, parts):
    """``parts`` (a dict or a list) in a container of ``node``'s type, where it can be built."""
    cls = node.cls
    if cls is type(parts):
        return parts
    if hasattr(cls, "_fields"):                 # a namedtuple
        return cls(*parts)
    try:
        return cls(node.factory, parts) if issubclass(cls, defaultdict) else cls(parts)
    except TypeError:                           # a container that cannot be built so
        return parts


def agree_call(comm: MPI.Comm, what: str, error: str | None, fields: dict[str, str],
               payload=None, member: str | None = "worker") -> list:
    """Every rank's problem and ``fields`` agreed on (``runtime.agreement.agree``): the same
    error on every rank, or every rank's ``payload``, in rank order.

    Collective. A problem any rank found is a ``ConfigError`` on every rank, naming that
    rank (``worker 2``: ``member`` and its rank in ``comm``; None: the problem names its
    rank itself, and ``what`` may be empty); a field that differs from rank 0's, a
    ``MismatchError`` naming the ranks.
    """
    gathered = agree(comm, (error, fields, payload), functools.partial(_call_judge, what, member))
    return [p for _, _, p in gathered]


def _call_judge(what: str, member: str | None, gathered: list) -> Exception | None:
    """The first problem, else the first field that differs from rank 0's."""
    failure = first_problem([problem for problem, _, _ in gathered], what,
                            member and (lambda w: f"{member} {w}"))
    if failure is not None:
        return failure
    ref = gathered[0][1]
    differ = [w for w, (_, theirs, _) in enumerate(gathered) if theirs != ref]
    if not differ:
        return None
    w = differ[0]
    field = next(k for k in [*ref, *gathered[w][1]] if ref.get(k) != gathered[w][1].get(k))
    error = MismatchError(
        f"{what}: workers {differ} differ from worker 0 in {field} (worker {w}: "
        f"{gathered[w][1].get(field, 'none')}; worker 0: {ref[field]}); every worker must "
        f"call it alike: the same arguments, and values of the same structure, shapes "
        f"and dtypes", collective=True)
    error.field = field            # the same on every rank
    return error


def _structure(value) -> tuple[list[_Leaf], object, list[str], str | None]:
    """(leaves, skeleton, signature tokens, problem) of a value to reduce."""
    leaves: list[_Leaf] = []
    tokens: list[str] = []
    try:
        skeleton = _flatten(value, "value", leaves, tokens)
    except ConfigError as exc:
        return [], None, [], str(exc)
    except RecursionError:
        return [], None, [], "value is nested too deeply (or contains itself)"
    except Exception as exc:  # noqa: BLE001 - any failure must reach every worker, not hang
        return [], None, [], f"its value cannot be reduced: {type(exc).__name__}: {exc}"
    return leaves, skeleton, tokens, None


def _signature(tokens: list[str]) -> str:
    """The structure as text, or its digest for a big nest (the agreement stays small)."""
    text = " ".join(tokens)
    if len(text) <= 200:
        return text
    return f"{len(tokens)} parts, digest {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _first_difference(comm: MPI.Intracomm, tokens: list[str], error: MismatchError):
    """``error`` with the first part of the structure that differs (a big nest's digests
    say only that it does). Collective: every rank raised ``error`` alike and is here."""
    gathered = comm.allgather(tokens)
    for w, theirs in enumerate(gathered[1:], start=1):
        for i in range(max(len(theirs), len(gathered[0]))):
            a = gathered[0][i] if i < len(gathered[0]) else "nothing"
            b = theirs[i] if i < len(theirs) else "nothing"
            if a != b:
                return MismatchError(f"{error} First difference: part {i} of the structure is "
                                     f"{b} on worker {w}, {a} on worker 0", collective=True)
    return error


def reduce(comm: MPI.Intracomm, value, op: str = "sum"):
    """``value`` reduced over every rank of ``comm``; the same structure, on every rank.

    Call on every rank of ``comm`` with values of the same structure, shapes and dtypes.
    See the module's docstring for the result's dtypes.

    Raises:
        ConfigError: on every rank, when any rank passed an unknown ``op``, an operation
            its values do not support, or a leaf that is not a tensor or a number.
        MismatchError: on every rank, when the ranks' values or operations differ.
    """
    return _reduce(comm, value, op, "reduce()")


def batch_reduce(comm: MPI.Intracomm, values: Sequence, op: str = "sum") -> list:
    """Several values reduced at once, as ``reduce`` of their list: one agreement, then one
    ``Allreduce`` per kind of number for all of them. Call on every rank of ``comm``."""
    problem = None
    if not isinstance(values, (list, tuple)):
        problem = f"values must be a list or tuple of values, got {type(values).__name__}"
        values = []
    return list(_reduce(comm, list(values), op, "batch_reduce()", problem))


def _reduce(comm: MPI.Intracomm, value, op, what: str, problem: str | None = None):
    leaves, skeleton, tokens, error = _structure(value)
    error = problem or error or _check_op(op, leaves)
    small, buffers, payload = True, {}, None
    if error is None:
        try:
            small, buffers, payload = _outgoing(leaves, op)
        except Exception as exc:  # noqa: BLE001 - any failure must reach every worker
            error = f"its value cannot be reduced: {type(exc).__name__}: {exc}"
    try:
        gathered = agree_call(comm, what, error,
                              {"the operation": repr(op), "the structure": _signature(tokens)},
                              payload)
    except MismatchError as exc:
        if exc.field != "the structure":      # the same on every rank: all go on alike
            raise
        raise _first_difference(comm, tokens, exc) from None
    if small:            # every worker's values came with the agreement: in worker order
        combine = {"max": np.maximum, "min": np.minimum}.get(op, np.add)   # NaN propagates
        for kind in buffers:
            buffers[kind] = functools.reduce(combine, (g["buffers"][kind] for g in gathered))
    else:
        nan = {kind for g in gathered for kind in g["nan"]}
        for kind, buf in buffers.items():
            buffers[kind] = _allreduce(comm, buf, op, kind in nan)
    numbers_ = _python_ints(op, [g["ints"] for g in gathered], comm.Get_size())
    results = _results(leaves, buffers, numbers_, op, comm.Get_size())
    return _rebuild(skeleton, results.__getitem__)


def _outgoing(leaves: list[_Leaf], op: str) -> tuple[bool, dict, dict]:
    """(small, this worker's buffers by kind, what travels with the agreement)."""
    if op == "mean":     # an integer mean is summed in float64: it cannot wrap
        for leaf in leaves:
            if leaf.kind == torch.int64:
                leaf.kind = torch.float64
    small = _wire_bytes(leaves) <= SMALL_BYTES
    buffers = _buffers(leaves, small)
    nan = []             # kinds whose MPI maximum (minimum) would drop a NaN of this worker
    if not small and op in ("max", "min"):
        nan = [kind for kind, buf in buffers.items()
               if kind != str(torch.int64) and bool(np.isnan(np.asarray(buf)).any())]
    return small, buffers, {"buffers": buffers if small else None, "nan": nan,
                            "ints": [leaf.number for leaf in leaves if leaf.kind is None]}


def _allreduce(comm: MPI.Intracomm, buf, op: str, nan: bool) -> np.ndarray:
    """One kind's values reduced by MPI; ``nan``: some worker has a NaN that MPI's maximum
    or minimum would drop, so the elements where any worker has one are set to NaN."""
    if isinstance(buf, torch.Tensor):            # one tensor of this kind: read in place
        send = buf.numpy().reshape(-1)
        out = np.empty(send.size, dtype=send.dtype)
    else:
        send, out = MPI.IN_PLACE, buf
    if nan:
        where = np.isnan(out if send is MPI.IN_PLACE else send).astype(np.uint8)
        comm.Allreduce(MPI.IN_PLACE, where, op=MPI.MAX)
    if out.size:
        comm.Allreduce(send, out, op=_MPI_OPS[op])
    if nan:
        out[where.astype(bool)] = np.nan
    return out


def _python_ints(op: str, ints: list[list[int]], size: int) -> list:
    """The Python ints of every worker reduced as Python does (exact at any size)."""
    combine = {"max": max, "min": min}.get(op, sum)
    out = [combine(column) for column in zip(*ints)]
    return [total / size for total in out] if op == "mean" else out


def _check_op(op, leaves: list[_Leaf]) -> str | None:
    if not isinstance(op, str) or op not in OPS:
        return f"op must be one of {OPS}, got {op!r}"
    if op in ("max", "min"):
        for leaf in leaves:
            if leaf.dtype is not None and leaf.dtype.is_complex:
                return f"op={op!r} is not defined for complex values ({leaf.signature()})"
    return None


def _buffers(leaves: list[_Leaf], small: bool) -> dict[str, np.ndarray | torch.Tensor]:
    """Each kind's leaves in one new buffer, by kind's name. A large kind of one tensor
    already in host memory as that kind is not copied: the tensor itself, to be read."""
    out: dict[str, np.ndarray | torch.Tensor] = {}
    for kind in _KINDS:
        mine = [leaf.tensor.reshape(-1).to(device="cpu", dtype=kind)
                for leaf in leaves if leaf.kind == kind]
        if len(mine) == 1 and not small and mine[0].is_contiguous():
            out[str(kind)] = mine[0]
        elif mine:
            out[str(kind)] = torch.cat(mine).numpy()       # a copy: never the caller's memory
    return out


def _wire_bytes(leaves: list[_Leaf]) -> int:
    return sum(leaf.numel * torch.empty(0, dtype=leaf.kind).element_size() for leaf in leaves
               if leaf.kind is not None)


def _results(leaves: list[_Leaf], buffers: dict[str, np.ndarray], ints: list, op: str,
             size: int) -> list:
    """The reduced leaves, cut from the reduced buffers (Python ints: ``ints``), in leaf
    order."""
    results: list = [None] * len(leaves)
    python = iter(ints)
    for i, leaf in enumerate(leaves):
        if leaf.kind is None:
            results[i] = next(python)
    for kind in _KINDS:
        mine = [i for i, leaf in enumerate(leaves) if leaf.kind == kind]
        if mine:
            pieces = torch.split(torch.from_numpy(buffers[str(kind)]),
                                 [leaves[i].numel for i in mine])
            for i, piece in zip(mine, pieces):
                results[i] = _back(leaves[i], piece, op, size)
    return results


def _back(leaf: _Leaf, piece: torch.Tensor, op: str, size: int):
    """One reduced leaf in its own dtype, shape, device and type."""
    if op == "mean":
        integral = not (leaf.dtype.is_floating_point or leaf.dtype.is_complex)
        if integral and leaf.back == "bool":
            return float(piece.to(torch.float64).item() / size)
        if integral:
            out = (piece.to(torch.float64) / size).to(torch.get_default_dtype())
        else:
            out = (piece / size).to(leaf.dtype)
    elif leaf.dtype == torch.bool:
        out = piece != 0
    else:
        out = piece.to(leaf.dtype)
    out = out.reshape(leaf.shape)
    if leaf.back == "tensor":
        return out.to(leaf.device)
    if leaf.back == "ndarray":
        return out.numpy()
    if leaf.back == "numpy":
        return out.numpy()[()]
    return {"int": int, "float": float, "bool": bool}[leaf.back](out.item())


def broadcast(comm: MPI.Intracomm, value, src: int = 0):
    """Rank ``src``'s value on every rank of ``comm``. Call on every rank of ``comm``.

    Only ``src``'s value counts (the others may pass None): tensors, numbers, and any
    other picklable leaf (a string, None), in dicts, lists and tuples. Tensors arrive with
    ``src``'s dtypes and shapes, on this rank's device of ``src``'s device type (the CPU,
    or the current accelerator); their bytes travel in one ``Bcast``. ``src`` gets its own
    value back.

    Raises:
        ConfigError: on every rank, when ``src`` is not a worker index, or its value
            cannot be sent (a sparse tensor, a leaf that does not pickle).
        MismatchError: on every rank, when the ranks passed different ``src``.
    """
    size = comm.Get_size()
    error = None
    if isinstance(src, bool) or not isinstance(src, numbers.Integral) or not 0 <= src < size:
        error = f"src must be a worker index in range({size}), got {src!r}"
    agree_call(comm, "broadcast()", error, {"src": repr(src)})
    src, me = int(src), comm.Get_rank()
    layout = data = None
    if me == src:
        layout, data = _pack(value)
    layout = comm.bcast(layout, root=src)
    if isinstance(layout, str):
        raise ConfigError(f"broadcast(): worker {src}: {layout}", collective=True)
    skeleton, metas, nbytes = layout
    if me != src:
        data = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        comm.Bcast(data.numpy(), root=src)
    return value if me == src else _unpack(skeleton, metas, data)


class _Tensor(int):
    """The index of a tensor of a broadcast value, in its skeleton."""

    def __reduce__(self):
        return _Tensor, (int(self),)


def _pack(value) -> tuple[object, torch.Tensor | None]:
    """``(skeleton, tensor metadata, bytes)`` of ``src``'s value and those bytes, or why not."""
    tensors: list[torch.Tensor] = []

    def strip(v):
        if torch.is_tensor(v):
            if v.layout != torch.strided or v.is_quantized:
                what = "quantized" if v.is_quantized else str(v.layout)
                raise TypeError(f"a {what} tensor; broadcast dense tensors")
            tensors.append(v.detach())
            return _Tensor(len(tensors) - 1)
        if isinstance(v, Mapping):
            return _Node(type(v), [(k, strip(x)) for k, x in v.items()], list(v), _factory(v))
        if isinstance(v, (list, tuple)):
            return _Node(type(v), [strip(x) for x in v], None)
        return v
    try:
        skeleton = strip(value)
        pickle.dumps(skeleton)            # what bcast does: fail here, where every rank hears
        metas, flat, offset = [], [], 0
        for t in tensors:               # each at a multiple of 16 bytes: viewed in place there
            raw = t.contiguous().reshape(-1).view(torch.uint8).cpu()
            metas.append((t.dtype, tuple(t.shape), t.device.type, offset))
            pad = -len(raw) % _ALIGN
            flat += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
            offset += len(raw) + pad
    except (TypeError, AttributeError, RecursionError, pickle.PicklingError) as exc:
        return f"its value cannot be broadcast: {exc}", None
    except Exception as exc:  # noqa: BLE001 - any failure must reach every worker, not hang
        return f"its value cannot be broadcast: {type(exc).__name__}: {exc}", None
    data = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    return (skeleton, metas, data.numel()), data


def _local_device(device_type: str) -> torch.device:
    """This rank's device of a type: the CPU, or the current one of an accelerator."""
    module = getattr(torch, device_type, None)
    if device_type != "cpu" and module is not None and hasattr(module, "current_device"):
        return torch.device(device_type, module.current_device())
    return torch.device(device_type)


def _unpack(skeleton, metas: list, data: torch.Tensor):
    tensors = []
    for dtype, shape, device_type, offset in metas:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        piece = data[offset:offset + nbytes].view(dtype).reshape(shape)
        tensors.append(piece.to(_local_device(device_type)))
    return _rebuild(skeleton, lambda v: tensors[v] if isinstance(v, _Tensor) else v)
