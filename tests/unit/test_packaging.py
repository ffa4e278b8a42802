"""What a user installs (one process): one version, the license, the typing marker and the
``mpisyncrun`` console script, read from setup.py without building or installing."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import mpisync

ROOT = Path(__file__).resolve().parents[2]


def setup_keywords() -> dict:
    """The keyword arguments of setup.py's ``setup()`` call that are literals."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "id", None) == "setup"]
    found = {}
    for kw in call.keywords:
        try:
            found[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            found[kw.arg] = None        # computed at build time (version, long_description)
    return found


def test_the_version_has_one_source():
    # setup.py reads mpisync/__init__.py; no other file of the package states it
    assert "version" in setup_keywords() and setup_keywords()["version"] is None
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    assert out[-1] == mpisync.__version__
    stated = [p.relative_to(ROOT).as_posix() for p in (ROOT / "mpisync").rglob("*.py")
              if f'"{mpisync.__version__}"' in p.read_text()]
    assert stated == ["mpisync/__init__.py"]


def test_the_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    kw = setup_keywords()
    assert kw["license"] == "Apache-2.0" and kw["license_files"] == ["LICENSE"]


def test_metadata_a_user_reads():
    kw = setup_keywords()
    assert kw["python_requires"] == ">=3.10"
    assert kw["long_description_content_type"] == "text/markdown"
    assert "Typing :: Typed" in kw["classifiers"]
    assert "url" not in kw and "project_urls" not in kw     # none exist yet
    assert "horovod" not in kw["extras_require"]            # built by `make horovod`
    assert "mypy" in " ".join(kw["extras_require"]["test"])


def test_the_typing_marker_ships():
    assert (ROOT / "mpisync" / "py.typed").is_file()
    assert "py.typed" in setup_keywords()["package_data"]["mpisync"]


def test_the_console_script_is_the_launchers_main(capsys):
    (script,) = setup_keywords()["entry_points"]["console_scripts"]
    name, target = (s.strip() for s in script.split("="))
    module, function = target.split(":")
    assert name == "mpisyncrun"
    main = getattr(importlib.import_module(module), function)
    assert main is importlib.import_module("mpisync.launch").main
    with pytest.raises(SystemExit) as done:       # what the installed script runs
        main(["--help"])
    assert done.value.code == 0
    assert "--workers" in capsys.readouterr().out
