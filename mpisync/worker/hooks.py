"""What an open optimizer installs in torch, counted with the other open ones."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

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
    back this optimizer's share once; later calls do nothing. What others installed for
    the optimizer's lifetime (``mpisync.Checkpointer``'s signal handlers) is given back
    with it: ``on_remove``.
    """

    def __init__(self) -> None:
        holders.watch()
        install_hooks()
        self.installed = True
        self._also: list[Callable[[], None]] = []

    def on_remove(self, give_back: Callable[[], None]) -> None:
        """Call ``give_back`` when the hooks are removed (at once if they were)."""
        if self.installed:
            self._also.append(give_back)
        else:
            give_back()

    def remove(self) -> None:
        """Give back this optimizer's share of the hooks (once)."""
        if self.installed:
            self.installed = False
            remove_hooks()
            holders.unwatch()
            while self._also:
                self._also.pop()()

    @contextlib.contextmanager
    def removed_on_error(self) -> Iterator[None]:
        """Within the block (the optimizer's set-up): an exception removes the hooks."""
        try:
            yield
        except BaseException:
            self.remove()
            raise
