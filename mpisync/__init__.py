"""mpisync: synchronous parameter-server training for PyTorch on MPI."""
from __future__ import annotations

from . import hashing, placement
from .checkpoint import Checkpointer, latest, load, plain_state, save
from .collection import EmbeddingBagCollection
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
from .hashtables import HashEmbedding, HashEmbeddingBag
from .metrics import Accuracy, Mean, Metric, Sum
from .optimizer import SyncReplicasOptimizer
from .partition import axis_size, fixed_size, min_max
from .ps_ranks import Cluster, RankLayout, init
from .rowwise import RowWiseAdagrad
from .tables import Embedding, EmbeddingBag
from .watch import Progress

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
