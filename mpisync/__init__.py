"""mpisync: synchronous parameter-server training for PyTorch on MPI.

``import mpisync`` alone imports neither torch nor MPI, so that the launcher
(``python -m mpisync.launch``) starts at once; the first use of any public name
(``mpisync.init``, ``mpisync.SyncReplicasOptimizer``, ...) imports the whole package.
Neither changes anything global: an open ``SyncReplicasOptimizer`` holds the hooks it
needs in torch and removes them at ``close()`` (``mpisync.worker.hooks``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # what the first use of a public name imports (see _load)
    from . import placement
    from .checkpoint import Checkpointer, latest, load, plain_state, save
    from .data import WorkerSampler
    from .errors import (
        CapacityError,
        ClosedError,
        ConfigError,
        DeadlockError,
        MismatchError,
        ModelMismatchError,
        NonFiniteError,
        PeerError,
        ProtocolError,
        StallError,
        WorldTooSmallError,
    )
    from .metrics import Accuracy, Mean, Metric, Sum
    from .observe.watch import Progress
    from .optimizer import SyncReplicasOptimizer
    from .protocol import hashing
    from .protocol.partition import axis_size, fixed_size, min_max
    from .ps_ranks import Cluster, init
    from .runtime.roles import RankLayout
    from .tables.collection import EmbeddingBagCollection, KeyedTensor
    from .tables.embedding import Embedding, EmbeddingBag
    from .tables.hashtables import HashEmbedding, HashEmbeddingBag
    from .tables.rowwise import RowWiseAdagrad

# public submodule -> the module it is (relative to this package)
_SUBMODULES = {"hashing": "protocol.hashing", "placement": "placement"}
# public name -> the module that defines it (relative to this package)
_HOMES = {
    "Checkpointer": "checkpoint", "latest": "checkpoint", "load": "checkpoint",
    "plain_state": "checkpoint", "save": "checkpoint",
    "EmbeddingBagCollection": "tables.collection", "KeyedTensor": "tables.collection",
    "WorkerSampler": "data",
    "CapacityError": "errors", "ClosedError": "errors", "ConfigError": "errors",
    "DeadlockError": "errors", "MismatchError": "errors", "ModelMismatchError": "errors",
    "NonFiniteError": "errors", "PeerError": "errors", "ProtocolError": "errors",
    "StallError": "errors", "WorldTooSmallError": "errors",
    "HashEmbedding": "tables.hashtables", "HashEmbeddingBag": "tables.hashtables",
    "Accuracy": "metrics", "Mean": "metrics", "Metric": "metrics", "Sum": "metrics",
    "SyncReplicasOptimizer": "optimizer",
    "axis_size": "protocol.partition", "fixed_size": "protocol.partition",
    "min_max": "protocol.partition",
    "Cluster": "ps_ranks", "RankLayout": "runtime.roles", "init": "ps_ranks",
    "RowWiseAdagrad": "tables.rowwise",
    "Embedding": "tables.embedding", "EmbeddingBag": "tables.embedding",
    "Progress": "observe.watch",
}

__all__ = [
    "Accuracy",
    "CapacityError",
    "Checkpointer",
    "ClosedError",
    "Cluster",
    "ConfigError",
    "DeadlockError",
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "HashEmbedding",
    "HashEmbeddingBag",
    "KeyedTensor",
    "Mean",
    "Metric",
    "MismatchError",
    "ModelMismatchError",
    "NonFiniteError",
    "PeerError",
    "Progress",
    "ProtocolError",
    "RankLayout",
    "RowWiseAdagrad",
    "StallError",
    "Sum",
    "SyncReplicasOptimizer",
    "WorkerSampler",
    "WorldTooSmallError",
    "axis_size",
    "fixed_size",
    "hashing",
    "init",
    "latest",
    "load",
    "min_max",
    "placement",
    "plain_state",
    "save",
]
__version__ = "0.3.0"


def _load() -> None:
    """Import every module behind a public name, as an eager package would at import.

    All of them at once, as before; importing them installs nothing in torch.
    """
    for name, home in _SUBMODULES.items():
        globals()[name] = importlib.import_module(f".{home}", __name__)
    for name, home in _HOMES.items():
        globals()[name] = getattr(importlib.import_module(f".{home}", __name__), name)


def __getattr__(name: str):
    if name in _SUBMODULES:     # a submodule: itself (its own imports may be partial)
        return importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    if name in _HOMES:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
