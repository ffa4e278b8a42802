"""mpisync: synchronous parameter-server training for PyTorch on MPI."""
from __future__ import annotations

from . import placement
from .errors import (
    ClosedError,
    ConfigError,
    DeadlockError,
    ModelMismatchError,
    PeerError,
    ProtocolError,
    StallError,
    WorldTooSmallError,
)
from .optimizer import SyncReplicasOptimizer
from .ps_ranks import Cluster, RankLayout, init

__all__ = [
    "ClosedError",
    "Cluster",
    "ConfigError",
    "DeadlockError",
    "ModelMismatchError",
    "PeerError",
    "ProtocolError",
    "RankLayout",
    "StallError",
    "SyncReplicasOptimizer",
    "WorldTooSmallError",
    "init",
    "placement",
]
__version__ = "0.2.0"
