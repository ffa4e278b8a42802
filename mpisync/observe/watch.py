"""A progress display on the chief: a tqdm bar in a terminal, plain log lines otherwise."""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from .. import environ

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

__all__ = ["Progress"]

DEFAULT_EVERY = 100


class Watched(Protocol):
    """What the display reads of a ``SyncReplicasOptimizer`` (its step hook, its global
    step, the cluster, the set-up it agreed), so that this module needs no import of it."""

    cluster: Any
    global_step: int
    @property
    def spec(self) -> Any: ...

    def register_step_post_hook(self, hook: Any) -> Any: ...


def _env_setting(every: int | None, enabled: bool) -> tuple[int | None, bool]:
    """``MPISYNC_PROGRESS``: 0/off/false turns it off; a number sets the line interval."""
    env = os.environ.get("MPISYNC_PROGRESS")
    if env is None:
        return every, enabled
    value = env.strip().lower()
    if value in ("", *environ.OFF_WORDS):
        return every, False
    return environ.count("MPISYNC_PROGRESS"), enabled


class Progress:
    """Shows training progress on the chief: step, global step, loss, steps/s, examples/s.

    Create it on every worker after the optimizer (it does nothing off the chief)::

        progress = mpisync.Progress(opt, total=epochs * steps_per_epoch, batch_size=64)
        for x, y in loader:
            ...
            opt.step()                      # the display advances by itself
            progress.report(loss=loss)      # optional: the loss (and examples=)
        progress.close()                    # or use it as a context manager

    When ``file`` (default ``sys.stderr``) is a terminal and tqdm is installed, it is a
    tqdm bar; otherwise (a batch job's log, tqdm missing) a plain line every ``every``
    steps and one at ``close()``. ``enabled=False``, or ``MPISYNC_PROGRESS=0`` in the
    environment, turns it off; ``MPISYNC_PROGRESS=N`` sets ``every``.

    The count starts at ``opt.global_step``: made after ``Checkpointer.resume()``, it goes
    on from the step the run resumed at (``step 1001/2000`` after resuming at 1000),
    and ``total`` is the whole run's.

    Args:
        opt: the ``SyncReplicasOptimizer``; every ``opt.step()`` counts one step (a torch
            step post-hook), whether or not its gradient was taken.
        total: the steps of the whole run (counted from 0, not from the step a resumed
            run starts at), for the bar's length and ETA.
        batch_size: examples in this worker's batch; examples/s counts the examples of
            the gradients applied per second (``replicas_to_aggregate`` gradients a
            global step), each with the chief's batch size (or ``report(examples=)``).
        every: steps between plain lines (default 100).
        enabled: False turns the display off.
        file: where to write (default ``sys.stderr``).
        desc: the bar's label.
    """

    def __init__(self, opt: Watched, total: int | None = None,
                 batch_size: int | None = None, *, every: int | None = None,
                 enabled: bool = True, file: TextIO | None = None,
                 desc: str = "train") -> None:
        every, enabled = _env_setting(every, enabled)
        self.every = every or DEFAULT_EVERY
        self.opt = opt
        self.total = total
        self.batch_size = batch_size
        self.desc = desc
        self.active = bool(enabled) and opt.cluster.is_chief
        self.steps = max(opt.global_step, 0)        # a resumed run counts on from there
        self._hook = None
        self._bar = None
        if not self.active:
            return
        self.file = sys.stderr if file is None else file
        spec = opt.spec
        self._per_step = 1 if spec.asynchronous else spec.replicas_to_aggregate
        # a tensor stays on its device until shown
        self._loss_sum: torch.Tensor | float | None = None
        self._loss_count = 0
        self._examples = 0
        self._examples_steps = 0
        self._start = self._shown_at = time.perf_counter()
        self._shown_steps = self.steps
        self._shown_global = max(opt.global_step, 0)
        self._due = False              # shown at the next report() (with this step's loss)
        if _is_terminal(self.file):
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="step", file=self.file,
                                 dynamic_ncols=True, mininterval=0.25, initial=self.steps)
        self._hook = opt.register_step_post_hook(self._on_step)

    # -- what the training loop calls -----------------------------------------------------
    def report(self, loss: torch.Tensor | float | None = None,
               examples: int | None = None) -> None:
        """This step's loss (a number or a tensor, read only when shown) and examples."""
        if not self.active:
            return
        if loss is not None:
            if hasattr(loss, "detach"):
                loss = loss.detach()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1
        if examples is not None:
            self._examples += examples
            self._examples_steps += 1
        if self._due:
            self._show()

    def close(self) -> None:
        """Stop counting; the bar closes, or a last line is written."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            if self._bar is not None:
                self._bar.set_postfix_str(self._postfix(time.perf_counter()), refresh=False)
                self._bar.close()
            elif self._due or self.steps != self._shown_steps:
                self._line(time.perf_counter())
            self._due = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- display --------------------------------------------------------------------------
    def _on_step(self, opt: object, args: object, kwargs: object) -> None:
        if self._due:                  # no report() since the last step: show it now
            self._show()
        self.steps += 1
        if self._bar is not None:
            self._bar.update(1)
            self._due = time.perf_counter() - self._shown_at >= self._bar.mininterval
        else:
            self._due = self.steps % self.every == 0

    def _show(self) -> None:
        self._due = False
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(now))
        else:
            self._line(now)

    def _rates(self, now: float) -> tuple[float, float | None]:
        """(steps/s, examples/s) since the last time they were shown."""
        seconds = max(now - self._shown_at, 1e-9)
        steps_per_s = (self.steps - self._shown_steps) / seconds
        per_batch = (self._examples / self._examples_steps if self._examples_steps
                     else self.batch_size)
        global_steps = max(self.opt.global_step, 0) - self._shown_global
        examples = None if per_batch is None else (
            per_batch * self._per_step * global_steps / seconds)
        return steps_per_s, examples

    def _loss(self) -> float | None:
        if not self._loss_count:
            return None
        total = self._loss_sum
        assert total is not None       # report() added _loss_count losses to it
        value = float(total.item() if hasattr(total, "item") else total) / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        return value

    def _mark(self, now: float) -> None:
        self._shown_at, self._shown_steps = now, self.steps
        self._shown_global = max(self.opt.global_step, 0)
        self._examples = self._examples_steps = 0

    def _postfix(self, now: float) -> str:
        _, examples = self._rates(now)
        loss = self._loss()
        parts = [f"global step {self.opt.global_step}"]
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if examples is not None:
            parts.append(f"{examples:.0f} examples/s")
        self._mark(now)
        return ", ".join(parts)

    def _line(self, now: float) -> None:
        steps_per_s, examples = self._rates(now)
        loss = self._loss()
        total = f"/{self.total}" if self.total else ""
        text = (f"[mpisync] {self.desc}: step {self.steps}{total}  global step "
                f"{self.opt.global_step}")
        if loss is not None:
            text += f"  loss {loss:.4g}"
        text += f"  {steps_per_s:.2f} steps/s"
        if examples is not None:
            text += f"  {examples:.0f} examples/s"
        text += f"  elapsed {now - self._start:.1f} s"
        self._mark(now)
        print(text, file=self.file, flush=True)


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False
