"""mpisync: synchronous parameter-server training for PyTorch on MPI."""
from __future__ import annotations

from . import hashing, placement
from .checkpoint import Checkpointer, latest, load, plain_state, save
from .collection import EmbeddingBagCollection
from .errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    DeadlockError,
    ModelMismatchError,
    NonFiniteError,
    PeerError,
    ProtocolError,
    StallError,
    WorldTooSmallError,
)
from .hashtables import HashEmbedding, HashEmbeddingBag
from .optimizer import SyncReplicasOptimizer
from .partition import axis_size, fixed_size, min_max
from .ps_ranks import Cluster, RankLayout, init
from .rowwise import RowWiseAdagrad
from .tables import Embedding, EmbeddingBag
from .watch import Progress

__all__ = [
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
    "ModelMismatchError",
    "NonFiniteError",
    "PeerError",
    "Progress",
    "ProtocolError",
    "RankLayout",
    "RowWiseAdagrad",
    "StallError",
    "SyncReplicasOptimizer",
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
