"""What an open optimizer installs in torch, counted with the other open ones."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..protocol import holders
from .schedule import install_hooks, remove_hooks

__all__ = ["TorchHooks"]


class TorchHooks:
    """The process-wide hooks one ``SyncReplicasOptimizer`` needs while it is open.

    Installed when made: torch's parameter-registration hook that keeps the registry of
    ``mpisync.protocol.holders`` (which module holds each parameter), and the wrapped
    scheduler constructors that let the optimizer adopt the schedulers built over it
    (``mpisync.worker.schedule``). Both are counted: each stays while any open optimizer
    holds it, and the last ``remove()`` leaves torch as it was before. ``remove()`` gives
    back this optimizer's share once; later calls do nothing.
    """

    def __init__(self) -> None:
        holders.watch()
        install_hooks()
        self.installed = True

    def remove(self) -> None:
        """Give back this optimizer's share of the hooks (once)."""
        if self.installed:
            self.installed = False
            remove_hooks()
            holders.unwatch()

    @contextlib.contextmanager
    def removed_on_error(self) -> Iterator[None]:
        """Within the block (the optimizer's set-up): an exception removes the hooks."""
        try:
            yield
        except BaseException:
            self.remove()
            raise
