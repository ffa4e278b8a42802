"""Rebuild a worker's optimizer over a parameter server's tensors, exactly, or refuse clearly.

A worker builds ``cls(model.parameters(), ...)``; each ps holds a subset of the parameters,
by name, and must run the same update on them. :func:`recipe_of` records what rebuilds the
optimizer (its class, constructor arguments, attributes and param groups), checks on the
worker, over stand-in tensors, that the recipe gives back an optimizer configured like the
user's, and raises :class:`~mpisync.errors.ConfigError` naming what cannot be rebuilt
otherwise. :meth:`OptimizerRecipe.build` runs on a ps.
"""
from __future__ import annotations

import cmath
import copy
import enum
import hashlib
import inspect
import pickle
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["TORCH_BOOKKEEPING", "OptimizerRecipe", "changed_settings", "recipe_of",
           "settings_of"]

#: Attributes that ``torch.optim.Optimizer`` (or torch's LR schedulers and AMP support) keeps on
#: every optimizer (and mpisync on the optimizers it joins, ``_mpisync_schedules``): they are
#: not configuration, so they are neither compared nor copied. An
#: instance attribute ``step`` is ignored only when it is an LR scheduler's step counter wrapper.
TORCH_BOOKKEEPING = frozenset({
    "defaults",
    "state",
    "param_groups",
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
    "_zero_grad_profile_name",
    "_warned_capturable_if_run_uncaptured",
    "_opt_called",
    "_step_supports_amp_scaling",
    "_need_device_dtype_check_for_fused",
    "_mpisync_schedules",   # an optimizer joined in a SyncReplicasOptimizer: its schedulers
})

_CONSTRUCTIONS = ("call", "new")
_MAX_DEPTH = 32
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_SEQUENCES = (tuple, list, set, frozenset)
_MAPPINGS = (dict, OrderedDict)
_SUMMARY_VALUES = 16  # tensors with more elements are summarized by a digest of their bytes


@dataclass(frozen=True)
class OptimizerRecipe:
    """What rebuilds a worker's optimizer over another process's tensors.

    Attributes:
        cls: the optimizer class, imported on the ps ranks by module and qualified name.
        kwargs: with ``construct == "call"``, the keyword arguments of ``cls(groups, **kwargs)``;
            with ``construct == "new"``, the ``defaults`` given to ``Optimizer.__init__``.
        attrs: attributes set after construction (deep-copied by every build).
        groups: per param group, ``(hyper-parameters, member names)``; the hyper-parameters
            are every key of the group but ``"params"``.
        construct: ``"call"`` runs the constructor; ``"new"`` makes the object with
            ``cls.__new__`` and ``torch.optim.Optimizer.__init__``, for a class whose
            constructor cannot be called again from the recorded arguments.

    Compare two recipes with :meth:`summary`: ``==`` compares the dicts, which fails on
    tensors with more than one element.
    """

    cls: type
    kwargs: dict
    attrs: dict
    groups: tuple
    construct: str = "call"

    def __post_init__(self):
        if self.construct not in _CONSTRUCTIONS:
            raise ValueError(f"construct is {self.construct!r}, expected one of {_CONSTRUCTIONS}")

    def build(self, params_by_name: dict[str, torch.Tensor]) -> torch.optim.Optimizer | None:
        """The optimizer over the given tensors, configured like the worker's.

        Groups keep their order and hyper-parameters, with only the members present in
        ``params_by_name`` (a group may end up empty); names the recipe does not hold
        (parameters outside the optimizer) are ignored.

        Args:
            params_by_name: a subset of the recipe's parameter names, each with its tensor,
                or a list of tensors (the shards of a partitioned parameter held here).

        Returns:
            The new optimizer, or None when none of the recipe's names is present.

        Raises:
            Whatever the optimizer's constructor raises over this subset of its parameters.
        """
        tensors = [[t for n in names if n in params_by_name
                    for t in _as_list(params_by_name[n])] for _, names in self.groups]
        if not any(tensors):
            return None
        return self._construct(tensors)

    def summary(self) -> dict[str, str]:
        """Plain, comparable text per field, to tell which field differs between two recipes.

        Keys: ``class``, ``construct``, ``kwargs``, ``attrs``, ``groups`` (their count), and
        per group ``group {i} hyper-parameters`` and ``group {i} members`` (the member count
        and a digest of the names). Floats and small tensors are written exactly.
        """
        fields = {
            "class": _path(self.cls),
            "construct": self.construct,
            "kwargs": _describe(self.kwargs),
            "attrs": _describe(self.attrs),
            "groups": str(len(self.groups)),
        }
        for i, (hyper, names) in enumerate(self.groups):
            digest = hashlib.sha256("\0".join(names).encode()).hexdigest()[:12]
            fields[f"group {i} hyper-parameters"] = _describe(hyper)
            fields[f"group {i} members"] = f"{len(names)} parameters (names digest {digest})"
        return fields

    def _construct(self, tensors: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        """The optimizer over ``tensors`` (one list per group, in the recipe's order)."""
        hypers = [copy.deepcopy(hyper) for hyper, _ in self.groups]
        groups = [{**hyper, "params": members} for hyper, members in zip(hypers, tensors)]
        if self.construct == "call":
            optimizer = self.cls(groups, **copy.deepcopy(self.kwargs))
        else:
            optimizer = self.cls.__new__(self.cls)
            torch.optim.Optimizer.__init__(optimizer, groups, copy.deepcopy(self.kwargs))
        for group, hyper in zip(optimizer.param_groups, hypers):
            for key in [k for k in group if k != "params" and k not in hyper]:
                del group[key]
            group.update(hyper)
        for name, value in copy.deepcopy(self.attrs).items():
            setattr(optimizer, name, value)
        return optimizer


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def recipe_of(optimizer: torch.optim.Optimizer, name_of: dict[int, str]) -> OptimizerRecipe:
    """The recipe that rebuilds ``optimizer``, checked by rebuilding it over stand-in tensors.

    The constructor is called again with the ``defaults`` entries it accepts; attributes
    that then differ from the user's are recorded, when they are plain data, and set after
    construction. When that call fails, the object is made with ``cls.__new__`` and
    ``Optimizer.__init__`` and all of the user's attributes are copied. Parameter tensors
    are never copied into the recipe.

    Args:
        optimizer: the user's optimizer.
        name_of: ``id(param) -> name`` for every parameter in its groups.

    Returns:
        The recipe; it survives pickling.

    Raises:
        ConfigError: naming the optimizer class and the reason, when it cannot be rebuilt
            exactly (a step that needs a closure, a class that cannot be imported by name,
            an attribute that is not plain data or does not pickle, an unnamed parameter).
    """
    cls = type(optimizer)
    label = _path(cls)
    _check_first_order(cls, label)
    _check_importable(cls, label)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    storages = {_storage_ptr(p) for p in params} - {0}
    groups = _groups_of(optimizer, name_of, storages, label)
    stand_ins = {name_of[id(p)]: _stand_in(p) for p in params}
    alias = {_storage_ptr(p): _storage_ptr(stand_ins[name_of[id(p)]]) for p in params}
    alias.pop(0, None)
    try:
        recipe = _recipe_by_call(optimizer, groups, stand_ins, alias, storages)
    except _CallFailed as failure:
        recipe = _recipe_by_new(optimizer, groups, storages, failure.reason)
    _verify(recipe, optimizer, stand_ins, alias, label)
    return recipe


def settings_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the optimizer's attributes that hold plain values (no tensors).

    The ps ranks rebuild the optimizer with them at set-up; ``changed_settings`` tells
    which were changed on the worker since.
    """
    from .multi import JointOptimizer
    if isinstance(optimizer, JointOptimizer):   # each inner optimizer's, as "{i}.{name}"
        return {f"{i}.{k}": v for i, opt in enumerate(optimizer.optimizers)
                for k, v in settings_of(opt).items()}
    return {k: copy.deepcopy(v) for k, v in _config_attrs(optimizer).items()
            if not _holds_tensor(v, 0)}


def changed_settings(settings: dict[str, Any], optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the attributes in ``settings`` whose value on ``optimizer`` differs now."""
    from .multi import JointOptimizer
    if isinstance(optimizer, JointOptimizer):
        return [f"{i}.{k}" for i, opt in enumerate(optimizer.optimizers)
                for k in changed_settings({k.split(".", 1)[1]: v for k, v in settings.items()
                                           if k.split(".", 1)[0] == str(i)}, opt)]
    now = vars(optimizer)
    return [k for k, v in settings.items() if k not in now or not _same(now[k], v, {})]


def _holds_tensor(value: Any, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > _MAX_DEPTH:
        return False
    if isinstance(value, dict):
        value = list(value.keys()) + list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(x, depth + 1) for x in value)
    return False


class _CallFailed(Exception):
    """Calling the constructor again does not rebuild the optimizer; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _check_first_order(cls: type, label: str) -> None:
    """Refuse an optimizer whose ``step`` requires a closure."""
    try:
        signature = inspect.signature(cls.step)
    except (TypeError, ValueError):
        return
    closure = signature.parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(
            f"{label}.step requires a closure: it re-evaluates the model several times per "
            "step, which cannot run on the parameter servers, where the parameters live; "
            "use a first-order optimizer (SGD, Adam, ...) instead")


def _check_importable(cls: type, label: str) -> None:
    """Refuse a class that the ps ranks cannot import by module and qualified name."""
    if "<locals>" in cls.__qualname__:
        raise ConfigError(
            f"{label} is defined inside a function, so the ps ranks cannot import it; "
            "define the optimizer class at module level")
    if not _by_reference(cls):
        raise ConfigError(
            f"{label} cannot be imported as {cls.__module__}.{cls.__qualname__}, so the ps "
            "ranks cannot find it; define the optimizer class at module level")


def _groups_of(optimizer: torch.optim.Optimizer, name_of: dict[int, str], storages: set[int],
               label: str) -> tuple:
    """Each param group as ``(deep copy of its hyper-parameters, member names)``."""
    groups, seen = [], set()
    for g, group in enumerate(optimizer.param_groups):
        names = []
        for i, p in enumerate(group["params"]):
            name = name_of.get(id(p))
            if name is None:
                raise ConfigError(f"{label}: parameter {i} of param group {g} (shape "
                                  f"{tuple(p.shape)}) has no name in name_of")
            if name in seen:
                raise ConfigError(f"{label}: two parameters are both named {name!r}")
            seen.add(name)
            names.append(name)
        hyper = {k: v for k, v in group.items() if k != "params"}
        for key, value in hyper.items():
            _require_plain(value, f"hyper-parameter {key!r} of param group {g}", storages, label)
        groups.append((copy.deepcopy(hyper), tuple(names)))
    return tuple(groups)


def _recipe_by_call(optimizer: torch.optim.Optimizer, groups: tuple,
                    stand_ins: dict[str, torch.Tensor], alias: dict[int, int],
                    storages: set[int]) -> OptimizerRecipe:
    """The recipe that calls the constructor; raises _CallFailed when that cannot work."""
    cls, label = type(optimizer), _path(type(optimizer))
    kwargs = copy.deepcopy(_accepted(cls, optimizer.defaults))
    bare = OptimizerRecipe(cls, kwargs, {}, groups, "call")
    try:
        probe = bare._construct(_tensors_of(groups, stand_ins))
    except Exception as exc:
        raise _CallFailed(f"calling {label}(params, **{sorted(kwargs)}) raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if not _same(probe.defaults, optimizer.defaults, alias):
        raise _CallFailed(f"calling {label}(params, **{sorted(kwargs)}) gives other defaults")
    ours, theirs = _config_attrs(optimizer), _config_attrs(probe)
    extra = sorted(set(theirs) - set(ours))
    if extra:
        raise _CallFailed(f"calling {label}(params, ...) sets attributes {extra} that the "
                          "optimizer does not have")
    attrs = {}
    for name, value in ours.items():
        if name in theirs and _same(value, theirs[name], alias):
            continue
        _require_plain(value, f"attribute {name!r}", storages, label)
        attrs[name] = copy.deepcopy(value)
    return OptimizerRecipe(cls, kwargs, attrs, groups, "call")


def _recipe_by_new(optimizer: torch.optim.Optimizer, groups: tuple, storages: set[int],
                   call_failure: str) -> OptimizerRecipe:
    """The recipe that makes the object with ``__new__`` and copies every attribute."""
    cls, label = type(optimizer), _path(type(optimizer))
    values = {"defaults": optimizer.defaults, **_config_attrs(optimizer)}
    for name, value in values.items():
        reason = _not_plain(value, storages, 0)
        if reason is not None:
            raise ConfigError(
                f"{label} cannot be rebuilt: {call_failure}; and copying its attributes "
                f"instead fails: attribute {name!r} holds {reason} (value of type "
                f"{type(value).__name__}), which the ps ranks cannot rebuild")
    attrs = copy.deepcopy(_config_attrs(optimizer))
    return OptimizerRecipe(cls, copy.deepcopy(optimizer.defaults), attrs, groups, "new")


def _verify(recipe: OptimizerRecipe, optimizer: torch.optim.Optimizer,
            stand_ins: dict[str, torch.Tensor], alias: dict[int, int], label: str) -> None:
    """Rebuild over the stand-ins and check that the result matches; check that it pickles."""
    for field, value in [*(("attribute " + repr(k), v) for k, v in recipe.attrs.items()),
                         ("constructor arguments", recipe.kwargs),
                         ("param groups", recipe.groups)]:
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise ConfigError(f"{label}: {field} ({type(value).__name__}) cannot be pickled "
                              f"({exc}), so the ps ranks cannot rebuild it") from exc
    try:
        probe = recipe._construct(_tensors_of(recipe.groups, stand_ins))
    except Exception as exc:
        raise ConfigError(f"{label} cannot be rebuilt: {type(exc).__name__}: {exc}") from exc
    ours, theirs = _config_attrs(optimizer), _config_attrs(probe)
    differing = sorted(n for n in set(ours) | set(theirs)
                       if n not in ours or n not in theirs or not _same(ours[n], theirs[n], alias))
    if differing:
        raise ConfigError(f"{label}: the rebuilt optimizer differs in attributes {differing}, "
                          "so the ps ranks cannot rebuild it")
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    rebuilt = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
    if not (_same(hypers, rebuilt, alias) and _same(optimizer.defaults, probe.defaults, alias)):
        raise ConfigError(f"{label}: the rebuilt optimizer's param groups or defaults differ "
                          "from the original's, so the ps ranks cannot rebuild it")


def _accepted(cls: type, defaults: dict) -> dict:
    """The entries of ``defaults`` that ``cls.__init__`` accepts by keyword."""
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return dict(defaults)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if parameters and parameters[0].kind in positional:
        parameters = parameters[1:]  # the params argument
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(defaults)
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in parameters if p.kind in by_keyword}
    return {k: v for k, v in defaults.items() if k in names}


def _config_attrs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The instance attributes that are configuration, not torch's bookkeeping."""
    attrs = {k: v for k, v in vars(optimizer).items() if k not in TORCH_BOOKKEEPING}
    if getattr(attrs.get("step"), "_wrapped_by_lr_sched", False):
        del attrs["step"]  # an LR scheduler's wrapper that counts optimizer steps
    return attrs


def _tensors_of(groups: tuple, tensors: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per group, the tensors of its members."""
    return [[tensors[n] for n in names] for _, names in groups]


def _stand_in(p: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor like ``p``, requiring grad when ``p`` does."""
    stand_in = torch.empty_like(p)
    if p.requires_grad:
        stand_in.requires_grad_(True)
    return stand_in


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for an empty or storage-less tensor)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _path(obj: Any) -> str:
    """``module.qualname`` of a class or function."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _by_reference(obj: Any) -> bool:
    """True when pickle stores ``obj`` by reference and finds the same object again."""
    try:
        return pickle.loads(pickle.dumps(obj)) is obj
    except Exception:  # noqa: BLE001 - any failure means "not by reference"
        return False


def _require_plain(value: Any, what: str, storages: set[int], label: str) -> None:
    """Raise ConfigError unless ``value`` is plain data that the ps ranks can rebuild."""
    reason = _not_plain(value, storages, 0)
    if reason is not None:
        raise ConfigError(
            f"{label}: {what} holds {reason} (value of type {type(value).__name__}), which the "
            "ps ranks cannot rebuild; keep only plain data (numbers, strings, CPU tensors, "
            "module-level functions, containers of these) in the optimizer's configuration")


def _not_plain(value: Any, storages: set[int], depth: int) -> str | None:
    """None when ``value`` is plain data; otherwise a description of the offending part."""
    if depth > _MAX_DEPTH:
        return f"containers nested more than {_MAX_DEPTH} deep"
    if isinstance(value, torch.Tensor):
        return _tensor_not_plain(value, storages)
    if isinstance(value, _SCALARS) or type(value) is torch.Size:
        return None
    if type(value) in _SEQUENCES:
        items = list(value)
    elif type(value) in _MAPPINGS:
        items = [x for item in value.items() for x in item]
    elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        if _by_reference(value):
            return None
        return f"{_path(value)} (not importable by module and name)"
    else:
        return f"a {type(value).__module__}.{type(value).__qualname__}"
    for item in items:
        reason = _not_plain(item, storages, depth + 1)
        if reason is not None:
            return reason
    return None


def _tensor_not_plain(t: torch.Tensor, storages: set[int]) -> str | None:
    """None for a CPU tensor that is not part of the model; otherwise what it is."""
    if type(t) is not torch.Tensor:
        return f"a {type(t).__qualname__} (only plain torch.Tensor is copied)"
    if t.device.type != "cpu":
        return f"a tensor on {t.device} (only CPU tensors travel to the ps ranks)"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor"
    if t.grad_fn is not None:
        return "a tensor attached to an autograd graph"
    if _storage_ptr(t) in storages:
        return "a tensor sharing storage with one of the optimizer's parameters"
    return None


def _same(a: Any, b: Any, alias: dict[int, int], depth: int = 0) -> bool:
    """Whether ``a`` (the user's) equals ``b`` (a probe's); see ``_same_tensor`` for tensors.

    Containers compare item by item, in order; NaN matches NaN; any failure to compare
    counts as different.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _same_tensor(a, b, alias)
    if depth > _MAX_DEPTH or type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return len(a) == len(b) and all(_same(x, y, alias, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            _same(ka, kb, alias, depth + 1) and _same(va, vb, alias, depth + 1)
            for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, (float, complex)) and cmath.isnan(a) and cmath.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - user objects may raise anything from ==; unequal
        return False


def _same_tensor(a: torch.Tensor, b: torch.Tensor, alias: dict[int, int]) -> bool:
    """Tensors equal in value (NaN matching NaN), or the same view of corresponding storages.

    A tensor on one of the user's parameters matches a probe tensor that is the same view of
    that parameter's stand-in (the stand-in may be a plain tensor where the user's is an
    ``nn.Parameter``).
    """
    layout = (a.dtype, a.shape, a.device, a.layout)
    if layout != (b.dtype, b.shape, b.device, b.layout):
        return False
    ptr = _storage_ptr(a)
    if ptr not in alias and type(a) is not type(b):
        return False
    if ptr in alias:
        return (_storage_ptr(b) == alias[ptr] and a.storage_offset() == b.storage_offset()
                and a.stride() == b.stride())
    try:
        if torch.equal(a, b):
            return True
        if not (a.is_floating_point() or a.is_complex()):
            return False
        nan_a, nan_b = a.isnan(), b.isnan()
        return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])
    except RuntimeError:
        return False


def _describe(value: Any, depth: int = 0) -> str:
    """Exact, deterministic text for a plain value (containers sorted where unordered)."""
    if depth > _MAX_DEPTH:
        return "..."
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, dict):
        items = sorted(f"{_describe(k, depth + 1)}: {_describe(v, depth + 1)}"
                       for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_describe(v, depth + 1) for v in value)) + "}"
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        inner = ", ".join(_describe(v, depth + 1) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, enum.Enum):
        return f"{_path(type(value))}.{value.name}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _path(value)
    return repr(value)


def _describe_tensor(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and values (or a digest of its bytes when large)."""
    head = f"tensor(dtype={t.dtype}, shape={tuple(t.shape)}"
    if t.layout != torch.strided:
        return f"{head}, layout={t.layout})"
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() <= _SUMMARY_VALUES:
        return f"{head}, values={flat.tolist()})"
    raw = flat.view(torch.uint8).numpy().tobytes()
    return f"{head}, sha256={hashlib.sha256(raw).hexdigest()[:16]})"
