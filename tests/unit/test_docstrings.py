"""Every public name of mpisync says what it is: a docstring, and annotations (one process).

The walk starts at ``mpisync.__all__`` (each name imports its module on first use) and
goes into the public submodules' ``__all__``; for every class it looks at the public
methods and properties the class and its mpisync bases define (what torch or the
standard library defines, and documents, is theirs). A docstring counts only where it is
the object's own: a class whose first statement is not a string shows its base's
docstring in ``help()``, and that is what this test refuses.

The same walk finds the public functions and methods (constructors included) whose
parameters, other than self/cls, or return have no annotation (``__init__`` may leave out
its ``-> None``); mypy in ``make lint`` checks their modules' bodies.
"""
from __future__ import annotations

import inspect
import types

import mpisync


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "mpisync"


def _own_doc(obj) -> str | None:
    """The docstring ``obj`` itself carries (a class: not its base's)."""
    if isinstance(obj, type):
        doc = vars(obj).get("__doc__")
    elif isinstance(obj, property):
        doc = obj.fget.__doc__ if obj.fget is not None else obj.__doc__
    elif isinstance(obj, (staticmethod, classmethod)):
        doc = obj.__func__.__doc__
    else:
        doc = getattr(obj, "__doc__", None)
    return doc if doc and doc.strip() else None


def _members(cls: type):
    """``(name, defining class, member)`` of the public methods and properties that ``cls`` and
    its mpisync bases define; a name defined lower in the MRO hides the same name above."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        for name, member in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if name.startswith("_") or not _ours(klass):
                continue
            if isinstance(member, (property, staticmethod, classmethod, types.FunctionType)):
                yield name, klass, member


def _public() -> dict[str, object]:
    """Every public object to check, by its dotted name."""
    found: dict[str, object] = {}
    for name in mpisync.__all__:
        obj = getattr(mpisync, name)
        if isinstance(obj, types.ModuleType):
            found[obj.__name__] = obj
            for inner in getattr(obj, "__all__", ()):
                found[f"{obj.__name__}.{inner}"] = getattr(obj, inner)
        else:
            found[f"mpisync.{name}"] = obj
    return found


def _undocumented() -> list[str]:
    missing: list[str] = []
    for dotted, obj in _public().items():
        if not (isinstance(obj, types.ModuleType) or inspect.isclass(obj)
                or inspect.isfunction(obj)) or not (isinstance(obj, types.ModuleType)
                                                    or _ours(obj)):
            continue                   # constants, and what mpisync takes from others
        if _own_doc(obj) is None:
            missing.append(dotted)
        if inspect.isclass(obj):
            missing += [f"{dotted}.{name}" + ("" if klass is obj else
                                              f" (defined in {klass.__qualname__})")
                        for name, klass, member in _members(obj) if _own_doc(member) is None]
    return sorted(set(missing))


def test_every_public_name_has_its_own_docstring():
    missing = _undocumented()
    assert not missing, (f"{len(missing)} public names of mpisync without a docstring of "
                         f"their own:\n  " + "\n  ".join(missing))


def test_the_optimizers_help_is_its_own():
    # the docstring is the class's first statement, so help() shows it, not torch's
    doc = inspect.getdoc(mpisync.SyncReplicasOptimizer)
    assert doc.startswith("Synchronous data-parallel training"), doc[:80]
    assert "Base class for all optimizers" not in doc


# -- annotations -----------------------------------------------------------------------------
def _function(member: object) -> tuple[object, bool] | None:
    """``(function, whether its first parameter is self/cls)`` of a method or property."""
    if isinstance(member, property):
        return member.fget, True
    if isinstance(member, staticmethod):
        return member.__func__, False
    if isinstance(member, classmethod):
        return member.__func__, True
    if isinstance(member, types.FunctionType):
        return member, True
    return None


def _unannotated(fn, bound: bool) -> list[str]:
    """The parameters of ``fn`` (but self/cls) and its return that have no annotation;
    ``__init__`` may leave out its return (None)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1 if bound else 0:]
    missing = [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD
                else "") + p.name for p in params if p.annotation is inspect.Parameter.empty]
    if fn.__name__ != "__init__" and sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _missing_annotations() -> list[str]:
    missing: list[str] = []
    for dotted, obj in _public().items():
        if inspect.isfunction(obj) and _ours(obj):
            found = _unannotated(obj, False)
            if found:
                missing.append(f"{dotted}: {', '.join(found)}")
        if not (inspect.isclass(obj) and _ours(obj)):
            continue
        members = list(_members(obj))
        init = next((klass for klass in obj.__mro__ if "__init__" in vars(klass)), object)
        if _ours(init):               # the constructor, where mpisync defines it
            members.append(("__init__", init, vars(init)["__init__"]))
        for name, klass, member in members:
            fn = _function(member)
            if fn is None:
                continue
            found = _unannotated(*fn)
            if found:
                where = "" if klass is obj else f" (defined in {klass.__qualname__})"
                missing.append(f"{dotted}.{name}{where}: {', '.join(found)}")
    return sorted(set(missing))


def test_every_public_function_is_annotated():
    # mypy (make lint) checks the bodies; this is the signatures a user's checker reads
    missing = _missing_annotations()
    assert not missing, (f"{len(missing)} public functions or methods of mpisync with "
                         f"parameters or a return not annotated:\n  " + "\n  ".join(missing))
