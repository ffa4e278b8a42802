"""Learning-rate schedulers kept at the global step, as in TensorFlow's synchronous training.

A hyper-parameter is a function of the global step: the number of updates the parameter
servers have applied. In strict synchronous training one ``opt.step()`` is one global step,
so torch's schedulers need nothing. With backup workers, K-batch or asynchronous updates
one ``opt.step()`` call covers 0, 1 or several global steps, and a scheduler stepped after
every ``opt.step()`` (a *per-iteration* scheduler) must move by that many positions.

:func:`install_hooks` makes every scheduler built over an optimizer that carries a
:class:`Schedules` (as its ``_mpisync_schedules`` attribute) adopted by it: the scheduler's
class becomes a subclass of its own class whose ``step()`` applies these rules, with the
scheduler's ``__dict__``, and so its ``state_dict()``, left exactly as torch makes them.
Importing this module changes nothing in torch: an open ``SyncReplicasOptimizer`` holds
the hooks (``mpisync.worker.hooks``), and :func:`remove_hooks` takes them back.

A user call ``sched.step()`` with no arguments on a top-level scheduler, with ``n`` the
number of ``opt.step()`` calls since that scheduler's previous call, ``g`` the global step
now and ``g_last`` the global step the scheduler was last brought to:

* mode ``"local"``: torch's ``step()`` once, whatever the global step did;
* mode ``"global_step"``: torch's ``step()`` ``g - g_last`` times (0 or more);
* mode ``"auto"``: when ``n == 1`` the scheduler is stepped per iteration and follows the
  global step (``g - g_last`` times); otherwise (``n == 0`` or ``n >= 2``, e.g. once per
  epoch) its unit is the user's own call, and it steps once.

A scheduler never moves back: after :meth:`Schedules.advance_to` has taken it past ``g``,
the user's call steps it 0 times.

Calls with arguments (``sched.step(epoch)``), calls made while a scheduler is being built,
and calls a scheduler's own ``step()`` makes on others (a composite such as
``SequentialLR`` or ``ChainedScheduler`` on its children) run torch's ``step()`` once,
unchanged. ``ReduceLROnPlateau`` is never adopted.
"""
from __future__ import annotations

import copyreg
import functools
import operator
import threading
import weakref
from typing import Any, Callable

from torch.optim import lr_scheduler

__all__ = ["MODES", "Schedules", "install_hooks", "remove_hooks"]

MODES = ("auto", "global_step", "local")

# The optimizer attribute that holds its Schedules.
_ATTRIBUTE = "_mpisync_schedules"
# Set on the wrapped __init__ functions, so that install_hooks() wraps each only once.
_HOOK_FLAG = "_mpisync_schedules_hook"
# The classes whose __init__ install_hooks() wraps, and how many calls keep them wrapped.
_HOOKED = (lr_scheduler.LRScheduler, lr_scheduler.SequentialLR, lr_scheduler.ChainedScheduler)
_installed = 0

# How many scheduler constructors run in this thread: step() calls they make pass through.
_building = threading.local()

# Original scheduler class -> its adopted subclass, and back.
_ADOPTED: dict[type, type] = {}
_ORIGINAL: dict[type, type] = {}


def install_hooks() -> None:
    """Make schedulers built over an optimizer with a :class:`Schedules` adopted by it.

    Wraps the ``__init__`` of ``LRScheduler``, ``SequentialLR`` and ``ChainedScheduler``
    (the latter two do not call ``LRScheduler.__init__``): once the original ``__init__``
    returns, a scheduler whose ``optimizer`` has an attribute ``_mpisync_schedules`` is
    passed to its ``adopt()``. Other schedulers cost one ``getattr`` when built and are
    otherwise untouched. Calls are counted: the first wraps, the others only count, and
    the wrapping stays until as many :func:`remove_hooks` calls came.
    """
    global _installed
    if _installed == 0:
        for cls in _HOOKED:
            init = cls.__dict__["__init__"]
            if not getattr(init, _HOOK_FLAG, False):
                cls.__init__ = _hooked_init(init)
    _installed += 1


def remove_hooks() -> None:
    """Undo one :func:`install_hooks`; the last gives the classes their own ``__init__``.

    Schedulers adopted meanwhile stay adopted (their class is a subclass of their own).

    Raises:
        RuntimeError: more calls than :func:`install_hooks` had.
    """
    global _installed
    if _installed == 0:
        raise RuntimeError("remove_hooks() without install_hooks()")
    _installed -= 1
    if _installed == 0:
        for cls in _HOOKED:
            init = cls.__dict__["__init__"]
            if getattr(init, _HOOK_FLAG, False):
                cls.__init__ = init.__wrapped__


def _hooked_init(init: Callable[..., None]) -> Callable[..., None]:
    """Return ``init`` followed by the adoption of the new scheduler."""

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _building.depth = getattr(_building, "depth", 0) + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _building.depth -= 1
        schedules = getattr(getattr(self, "optimizer", None), _ATTRIBUTE, None)
        if schedules is not None:
            schedules.adopt(self)

    setattr(__init__, _HOOK_FLAG, True)
    return __init__


def _adopted_class(cls: type) -> type:
    """Return the cached subclass of scheduler class ``cls`` whose ``step()`` is routed.

    The subclass has the name, qualified name, module and docstring of ``cls``, adds no
    instance attribute (``__slots__ = ()``), and pickles and copies its instances as
    instances of ``cls``: a copy or a pickle of an adopted scheduler is a plain torch one.
    """
    adopted = _ADOPTED.get(cls)
    if adopted is not None:
        return adopted
    original_step = cls.step

    @functools.wraps(original_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        schedules = getattr(self.optimizer, _ATTRIBUTE, None)
        if schedules is None:
            return original_step(self, *args, **kwargs)
        return schedules._route(self, original_step, args, kwargs)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        func, args, *rest = super(adopted, self).__reduce_ex__(protocol)
        if func is copyreg.__newobj__:  # pickle insists its class be the object's own
            return (cls.__new__, (cls, *args[1:]), *rest)
        if args and args[0] is adopted:  # copyreg._reconstructor(cls, base, state)
            args = (cls, *args[1:])
        return (func, args, *rest)

    adopted = type(cls.__name__, (cls,), {
        "__slots__": (),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__reduce_ex__": __reduce_ex__,
        "step": step,
    })
    _ADOPTED[cls] = adopted
    _ORIGINAL[adopted] = cls
    return adopted


class _Record:
    """What a :class:`Schedules` knows about one adopted scheduler."""

    __slots__ = ("global_step", "num_steps", "original_step", "per_iteration", "top_level")

    def __init__(self, global_step: int, num_steps: int, original_step: Callable[..., Any]):
        self.global_step = global_step  # the global step the scheduler stands at
        self.num_steps = num_steps  # Schedules.num_steps at the scheduler's last user call
        self.original_step = original_step
        self.per_iteration: bool | None = None  # classification at the last user call
        self.top_level = True  # False once a composite holding it is adopted


class Schedules:
    """The learning-rate schedulers attached to one optimizer, kept at the global step.

    The optimizer carries it as ``optimizer._mpisync_schedules``; with
    :func:`install_hooks` called, every scheduler built over that optimizer is adopted.
    The optimizer calls :meth:`note_step` at the end of every ``step()``.

    Args:
        mode: ``"auto"`` (a scheduler stepped after every ``opt.step()`` follows the global
            step, one stepped less often counts its own calls), ``"global_step"`` (every
            scheduler follows the global step) or ``"local"`` (every scheduler counts its
            own calls, as in torch).
        global_step: the global step when the schedulers are built (non-zero when
            resuming from a checkpoint); an adopted scheduler stands at this step.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`, or ``global_step`` is negative.
        TypeError: ``global_step`` is not an integer.
    """

    def __init__(self, mode: str = "auto", global_step: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        global_step = operator.index(global_step)
        if global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {global_step}")
        self._mode = mode
        self._global_step = global_step
        self._num_steps = 0  # note_step() calls so far
        self._depth = 0  # > 0 while a scheduler's own step() runs under this object
        self._records: weakref.WeakKeyDictionary[Any, _Record] = weakref.WeakKeyDictionary()

    @property
    def mode(self) -> str:
        """One of :data:`MODES`."""
        return self._mode

    @property
    def global_step(self) -> int:
        """The latest global step given to :meth:`note_step` (or to the constructor)."""
        return self._global_step

    def adopt(self, scheduler: lr_scheduler.LRScheduler) -> None:
        """Route ``scheduler.step()`` through this object; its children stop being top-level.

        The scheduler's class is swapped for a cached subclass of its own class, so
        ``isinstance`` checks, ``type(scheduler).__name__`` and ``state_dict()`` are as
        before. The scheduler stands at the current global step. Adopting a scheduler again
        only refreshes which schedulers its ``_schedulers`` hold. ``ReduceLROnPlateau``
        (stepped with a metric, never by position) is left as it is.

        Raises:
            TypeError: ``scheduler`` is not a torch ``LRScheduler``.
            ValueError: ``scheduler.optimizer._mpisync_schedules`` is not this object.
        """
        if not isinstance(scheduler, lr_scheduler.LRScheduler):
            raise TypeError(f"expected a torch LRScheduler, got {type(scheduler).__name__}")
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            return
        if getattr(scheduler.optimizer, _ATTRIBUTE, None) is not self:
            raise ValueError(
                f"the optimizer of this {type(scheduler).__name__} does not carry this "
                f"Schedules; set optimizer.{_ATTRIBUTE} before building the scheduler")
        if scheduler not in self._records:
            original_class = _ORIGINAL.get(type(scheduler), type(scheduler))
            scheduler.__class__ = _adopted_class(original_class)
            self._records[scheduler] = _Record(
                self._global_step, self._num_steps, original_class.step)
        for child in getattr(scheduler, "_schedulers", ()):
            record = self._records.get(child)
            if record is not None:
                record.top_level = False

    def schedulers(self) -> list[lr_scheduler.LRScheduler]:
        """The top-level adopted schedulers alive, in the order they were adopted (what a
        checkpoint saves and restores; a composite's children are in its own state)."""
        return [s for s, record in self._records.items() if record.top_level]

    def note_step(self, global_step: int) -> None:
        """Record the end of one ``opt.step()``; ``global_step`` is the global step now.

        Called once per local step, whether or not the global step moved.

        Raises:
            ValueError: ``global_step`` is below the previous one.
        """
        global_step = operator.index(global_step)
        if global_step < self._global_step:
            raise ValueError(f"global_step must not decrease: got {global_step} "
                             f"after {self._global_step}")
        self._global_step = global_step
        self._num_steps += 1

    def rebase(self, global_step: int) -> None:
        """The global step was set (a state was loaded): every scheduler stands at it now.

        Neither counts as a step nor moves a scheduler; the step after it is one step.
        """
        global_step = operator.index(global_step)
        self._global_step = global_step
        for record in self._records.values():
            record.global_step = global_step

    def advance_to(self, global_step: int) -> None:
        """Bring every top-level scheduler that follows the global step to ``global_step``.

        Used inside ``opt.step()`` when the update is applied at a later global step than
        the last one noted (asynchronous mode); the user's next ``sched.step()`` then adds
        only the global steps that remain. In mode ``"global_step"`` every scheduler
        follows the global step; in mode ``"auto"`` those last called per iteration do,
        and those not called yet are left alone; in mode ``"local"`` none does.

        Raises:
            ValueError: a scheduler that follows the global step already stands past
                ``global_step`` (nothing is changed then).
        """
        global_step = operator.index(global_step)
        due = [(scheduler, record) for scheduler, record in self._records.items()
               if record.top_level and self._follows(record)]
        for scheduler, record in due:
            if global_step < record.global_step:
                raise ValueError(
                    f"cannot move {type(scheduler).__name__} back from global step "
                    f"{record.global_step} to {global_step}")
        for scheduler, record in due:
            times = global_step - record.global_step
            record.global_step = global_step
            self._run(scheduler, record.original_step, times, (), {})

    @property
    def follows_global_step(self) -> bool:
        """Whether at least one adopted scheduler is advanced with the global step.

        True in mode ``"global_step"`` once a scheduler is adopted, and in mode ``"auto"``
        once a scheduler's last call was classified per iteration.
        """
        return any(self._follows(record) for record in self._records.values())

    def _follows(self, record: _Record) -> bool:
        """Whether the scheduler of ``record`` moves with the global step."""
        if self._mode == "global_step":
            return True
        return self._mode == "auto" and record.per_iteration is True

    def _route(self, scheduler: Any, original_step: Callable[..., Any],
               args: tuple, kwargs: dict) -> None:
        """Run ``scheduler.step(*args, **kwargs)`` by the rules in the module docstring."""
        record = self._records.get(scheduler)
        if (args or kwargs or record is None or not record.top_level or self._depth
                or getattr(scheduler, "_is_initial", False) or getattr(_building, "depth", 0)):
            self._run(scheduler, original_step, 1, args, kwargs)
            return
        calls = self._num_steps - record.num_steps
        if self._mode == "auto":
            record.per_iteration = calls == 1
        else:
            record.per_iteration = self._mode == "global_step"
        times = max(0, self._global_step - record.global_step) if record.per_iteration else 1
        record.num_steps = self._num_steps
        record.global_step = max(record.global_step, self._global_step)
        self._run(scheduler, original_step, times, (), {})

    def _run(self, scheduler: Any, original_step: Callable[..., Any], times: int,
             args: tuple, kwargs: dict) -> None:
        """Call torch's ``step()`` ``times`` times; nested ``step()`` calls pass through."""
        self._depth += 1
        try:
            for _ in range(times):
                original_step(scheduler, *args, **kwargs)
        finally:
            self._depth -= 1
