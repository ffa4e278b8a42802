"""The package's folders and the rules between them, read from the sources (one process).

Every module of ``mpisync`` is parsed (not imported) and each of its imports, at any
depth (functions included) and relative ones resolved, is checked against the rules of
the layout:

- ``worker/`` and ``ps/`` never import each other, and ``worker/`` never imports
  ``tables/``: what both sides need lives in ``protocol/`` or ``runtime/``.
- ``protocol/`` imports only ``native/`` and ``runtime/``, and the two pure cores the
  design card keeps at the top level, ``placement`` and ``accumulate``.
- ``runtime/`` imports only ``protocol/wire``; ``native/`` imports nothing of mpisync;
  ``observe/`` imports only ``runtime/``.
- ``ps/`` imports ``protocol/``, ``runtime/``, ``native/``, the pure row math of
  ``tables/`` (``rowopt``, ``rowwise``) and ``accumulate`` (the step's accumulators).
- ``worker/`` imports ``protocol/``, ``runtime/``, ``native/``.
- ``tables/`` imports ``worker/`` (its transport), ``protocol/``, ``runtime/``, ``native/``.
- ``worker/`` and ``ps/`` both record into ``observe/timeline`` (the per-rank recorder,
  which imports nothing of mpisync but ``environ``).
- ``errors`` and ``environ`` import nothing else of mpisync, and the package root imports
  nothing outside ``if TYPE_CHECKING`` (its names load lazily): these three are allowed
  from anywhere (``protocol/spec`` reads the root's ``__version__``).
- The top level (``optimizer``, ``ps_ranks``, ``checkpoint``, ...) imports anything.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpisync"

WINGS = ("protocol", "worker", "ps", "tables", "native", "runtime", "observe")
#: Modules that import nothing else of mpisync: allowed from every folder.
LEAVES = ("mpisync", "mpisync.errors", "mpisync.environ")
#: The pure cores the design card keeps at the top level.
CORES = ("mpisync.accumulate", "mpisync.placement")
RECORDER = "mpisync.observe.timeline"
#: What each folder may import besides itself and the leaves (a module or a folder).
ALLOWED = {
    "protocol": ("mpisync.native", "mpisync.runtime", *CORES),
    "runtime": ("mpisync.protocol.wire",),
    "native": (),
    "observe": ("mpisync.runtime",),
    "worker": ("mpisync.protocol", "mpisync.runtime", "mpisync.native", RECORDER),
    "ps": ("mpisync.protocol", "mpisync.runtime", "mpisync.native", "mpisync.tables.rowopt",
           "mpisync.tables.rowwise", "mpisync.accumulate", RECORDER),
    "tables": ("mpisync.worker", "mpisync.protocol", "mpisync.runtime", "mpisync.native"),
}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.imported}: {self.rule}"


def module_name(path: str) -> str:
    """``mpisync/ps/shard.py`` -> ``mpisync.ps.shard`` (a package: its ``__init__``'s name)."""
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def is_module(name: str, root: Path = ROOT) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: str, source: str, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` for every mpisync module that ``source`` (the file at ``path``,
    relative to the repository) imports, at any depth, relative imports resolved; ``from
    a import b`` names ``a.b`` where that is a module, else ``a``."""
    own = module_name(path)
    package = own if path.endswith("__init__.py") else own.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if is_module(sub, root) else base))
    return [(line, m) for line, m in found if m == "mpisync" or m.startswith("mpisync.")]


def wing_of(module: str) -> str:
    """The folder of ``module`` (``""``: the top level)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in WINGS else ""


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def rule_broken(importer: str, imported: str) -> str | None:
    """Which rule ``importer`` importing ``imported`` breaks, or None."""
    here, there = wing_of(importer), wing_of(imported)
    if importer in LEAVES[1:] and imported not in LEAVES:
        return f"{importer} is a leaf: it imports nothing of mpisync but errors"
    if not here or here == there or imported in LEAVES:
        return None
    if {here, there} == {"worker", "ps"}:
        return "worker/ and ps/ never import each other"
    if here == "worker" and there == "tables":
        return "worker/ never imports tables/"
    if _within(imported, ALLOWED[here]):
        return None
    if not ALLOWED[here]:
        return f"{here}/ imports nothing of mpisync but errors, environ"
    allowed = ", ".join(p.removeprefix("mpisync.") for p in ALLOWED[here])
    return f"{here}/ imports only {allowed} (and errors, environ)"


def check_source(path: str, source: str, root: Path = ROOT) -> list[Violation]:
    """The imports of ``source`` (the file at ``path``) that break a rule."""
    importer = module_name(path)
    out = []
    for line, imported in imports_of(path, source, root):
        rule = rule_broken(importer, imported)
        if rule is not None:
            out.append(Violation(path, line, imported, rule))
    return out


def package_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py"))


def test_every_folder_is_a_package_and_known():
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert folders == sorted(WINGS)


def test_imports_follow_the_wing_rules():
    broken = []
    for path in package_files():
        broken += check_source(path, (ROOT / path).read_text())
    assert not broken, "imports that break the layout:\n" + "\n".join(map(str, broken))


def test_the_root_imports_nothing_at_import():
    """``mpisync/__init__.py`` imports mpisync modules only under ``if TYPE_CHECKING``."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom):
                assert not sub.level and not (sub.module or "").startswith("mpisync"), \
                    f"mpisync/__init__.py:{sub.lineno} imports {sub.module} at import"


@pytest.mark.parametrize("path,source,imported,rule", [
    ("mpisync/worker/channels.py", "from ..ps.shard import layouts_of\n",
     "mpisync.ps.shard", "worker/ and ps/ never import each other"),
    ("mpisync/ps/shard.py", "def f():\n    from ..worker import channels\n",
     "mpisync.worker.channels", "worker/ and ps/ never import each other"),
    ("mpisync/worker/rows.py", "from ..tables.embedding import Embedding\n",
     "mpisync.tables.embedding", "worker/ never imports tables/"),
    ("mpisync/protocol/spec.py", "from ..worker import allreduce\n",
     "mpisync.worker.allreduce", "protocol/ imports only"),
    ("mpisync/runtime/progress.py", "from ..protocol.spec import JobSpec\n",
     "mpisync.protocol.spec", "runtime/ imports only"),
    ("mpisync/native/kernels.py", "import mpisync.runtime.shm\n",
     "mpisync.runtime.shm", "native/ imports nothing of mpisync"),
    ("mpisync/ps/rows.py", "from ..tables.embedding import TableParameter\n",
     "mpisync.tables.embedding", "ps/ imports only"),
    ("mpisync/errors.py", "from .protocol import wire\n",
     "mpisync.protocol.wire", "a leaf"),
])
def test_a_broken_rule_is_named(path, source, imported, rule):
    """A synthetic module that breaks a rule: the check names the file, line and rule."""
    (found,) = check_source(path, "import os\n" + source)
    assert (found.path, found.imported) == (path, imported)
    assert found.line == source.count("\n") + 1    # its last line (after "import os")
    assert rule in found.rule
    assert str(found).startswith(f"{path}:{found.line}: imports {imported}: ")


def test_allowed_imports_pass():
    assert not check_source("mpisync/worker/channels.py",
                            "from ..protocol.layouts import layouts_of\n"
                            "from ..runtime import shm\nfrom .. import errors, environ\n")
    assert not check_source("mpisync/ps/rows.py", "from ..tables.rowopt import apply_rows\n")
    assert not check_source("mpisync/optimizer.py", "from .ps.steplog import log_path\n")


def test_import_mpisync_imports_neither_torch_nor_mpi():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = ("import mpisync, sys; assert mpisync.__file__.startswith(sys.argv[1]); "
            "assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mpi4py'))")
    proc = subprocess.run([sys.executable, "-c", code, str(PACKAGE)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_resolves():
    import mpisync

    for name in mpisync.__all__:
        assert getattr(mpisync, name) is not None, name
    assert mpisync.hashing.__name__ == "mpisync.protocol.hashing"
    assert mpisync.placement.__name__ == "mpisync.placement"
    assert set(mpisync.__all__) <= set(dir(mpisync))      # what completion offers
    with pytest.raises(AttributeError, match="^module 'mpisync' has no attribute 'Optimiser'$"):
        _ = mpisync.Optimiser


# -- header fields by name -----------------------------------------------------------------
#: Where header layouts are defined: the one module that may index a header by number.
WIRE = "mpisync/protocol/wire.py"
#: Names that hold a header (or a message read like one) in mpisync: the variables and
#: attributes, and the functions that return views of one.
HEADER_NAMES = frozenset({"fields", "pfields", "param_fields", "notice", "ctl", "token", "tok",
                          "msg", "bye", "head", "header", "words", "timing", "views",
                          "timing_view", "hyper_views"})
HEADER_SUFFIXES = ("buf", "_fields", "_header", "_notice", "_token", "_words")


def _header_name(node: ast.expr) -> str | None:
    """The identifier an indexed expression goes by: ``x`` -> x, ``a.b.x`` -> x, ``f(..)``
    and ``a.f(..)`` -> f; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _header_name(node.func)
    return None


def _is_int_literal(node: ast.expr | None) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _literal_index(index: ast.expr) -> bool:
    """An int literal, a slice with an int literal bound or step, or a tuple holding one."""
    if isinstance(index, ast.Slice):
        return any(_is_int_literal(x) for x in (index.lower, index.upper, index.step))
    if isinstance(index, ast.Tuple):
        return any(_literal_index(e) for e in index.elts)
    return _is_int_literal(index)


def header_indexing(source: str, path: str = "<source>") -> list[str]:
    """``path:line: expression`` for every subscript of a header by an integer literal.

    Caught: a subscript (read, write or ``del``) whose index is an int literal (``-1``
    included), a slice with an int literal bound or step (``x[5:7]``, ``x[:3]``) or a
    tuple holding one, of an expression that goes by a header's name (``_header_name``):
    one of ``HEADER_NAMES`` or ending in one of ``HEADER_SUFFIXES``. Not caught: indices
    computed from literals (``x[1 + n]``), names bound to ints, or headers under other
    names; those are left to review.
    """
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, ast.Subscript) or not _literal_index(node.slice):
            continue
        name = _header_name(node.value)
        if name is not None and (name in HEADER_NAMES or name.endswith(HEADER_SUFFIXES)):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_header_is_indexed_by_number_outside_wire():
    found = []
    for path in package_files():
        if path != WIRE:
            found += header_indexing((ROOT / path).read_text(encoding="utf-8"), path)
    assert not found, ("header fields are read and written by name (protocol/wire.py's "
                       "*Field classes): " + "; ".join(found))


@pytest.mark.parametrize("line", [
    "kind = int(slot.fields[0])",
    "fields[4] = flags",
    "f(ctl[3])",
    "self.token_buf[3] = 1",
    "x = notice[-1]",
    "bye[5:7] = other",
    "words[:3] = (0, 0, n)",
    "mask = self.header.views(buf)[3]",
    "t = timing_view(fields)[0]",
    "mark = int(buf[:8].view(np.int64)[0])",
    "a, b = msg[0], msg[1]",
    "del self.send_buf[0]",
])
def test_header_indexing_catches_numbers(line):
    found = header_indexing(line, "synthetic.py")
    assert len(found) >= 1 and found[0].startswith("synthetic.py:1: ")


@pytest.mark.parametrize("line", [
    "kind = int(slot.fields[GradField.KIND])",
    "fields[GradField.TIMING:GradField.TIMING_STOP] = other",
    "codes[pos], words[pos] = leaf",
    "msg[HyperField.WORDS + width:] = 0",
    "first = shapes[0]",
    "rest = ps_ranks[1:]",
    "x = fields[i]",
])
def test_header_indexing_passes_names(line):
    assert header_indexing(line) == []
