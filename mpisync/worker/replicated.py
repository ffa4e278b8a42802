"""Parameters no optimizer group holds: the chief's values, broadcast to every worker."""
from __future__ import annotations

import torch
from mpi4py import MPI

from .devices import raw_bytes

__all__ = ["ReplicatedChannel"]


class ReplicatedChannel:
    """Parameters no optimizer group holds: the chief's values, broadcast once."""

    def __init__(self, worker_comm: MPI.Comm, tensors: list[torch.Tensor]):
        self.worker_comm = worker_comm
        self.tensors = tensors

    def setup(self) -> None:
        """Every worker takes the chief's values (collective over the workers)."""
        with torch.no_grad():
            for t in self.tensors:
                data = t.detach()
                if data.is_contiguous() and data.device.type == "cpu":
                    self.worker_comm.Bcast([raw_bytes(data), MPI.BYTE], root=0)
                else:              # strided, or on a device: through a host copy
                    buf = data.contiguous().cpu()
                    self.worker_comm.Bcast([raw_bytes(buf), MPI.BYTE], root=0)
                    data.copy_(buf)
