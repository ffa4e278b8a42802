"""What a checkpoint carries besides the model and the optimizer, so that a resumed job
draws the same batches and random numbers as one that never stopped.

Per worker (``"worker_states"``, one entry per worker in the order of the workers'
communicator)::

    {"worker_index": int,
     "rng": {"torch": torch.get_rng_state(),                 # a uint8 tensor
             "cuda": [a uint8 tensor per device] or None,   # None: CUDA not initialised
             "numpy": {"bit_generator", "key", "pos", "has_gauss", "cached_gaussian"}
                      or None,                               # None: NumPy not installed
             "random": {"version", "internal", "gauss_next"}},  # Python's random
     "samplers": [sampler.state_dict() for every live WorkerSampler, in creation order]}

and, once for the job (``"schedulers"``, the chief's)::

    [{"class": type name, "state": scheduler.state_dict()} for every top-level scheduler
     the optimizer adopted (``mpisync.worker.schedule``), in the order they were built]

Everything is numbers, strings, lists, dicts and tensors: ``torch.load(path,
weights_only=True)`` reads it. The encoders and decoders here are pure functions; the
``capture_*`` and ``restore_*`` functions read and set this process's state.
"""
from __future__ import annotations

import os
import random
import sys
import warnings
from typing import Any

import torch

from .data import live_samplers

__all__ = ["START_OVER_NO_RESUME", "START_OVER_WARNING", "capture_rng", "capture_worker",
           "decode_numpy", "decode_random", "encode_numpy", "encode_random", "restore_rng", "restore_schedulers", "restore_worker",
           "scheduler_states", "schedulers_of", "warn_if_restarts_start_over"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


# -- pure encoders and decoders ------------------------------------------------------------
def encode_numpy(state: tuple) -> dict:
    """``numpy.random.get_state()`` (the legacy tuple) as plain values."""
    name, key, pos, has_gauss, cached = state
    return {"bit_generator": str(name), "key": [int(k) for k in key], "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def decode_numpy(state: dict) -> tuple:
    """The tuple ``numpy.random.set_state()`` takes, from ``encode_numpy``'s dict."""
    numpy = _numpy()
    key: Any = list(state["key"])
    if numpy is not None:
        key = numpy.asarray(key, dtype=numpy.uint32)
    return (state["bit_generator"], key, int(state["pos"]), int(state["has_gauss"]),
            float(state["cached_gaussian"]))


def encode_random(state: tuple) -> dict:
    """``random.getstate()`` as plain values."""
    version, internal, gauss_next = state
    return {"version": int(version), "internal": [int(v) for v in internal],
            "gauss_next": None if gauss_next is None else float(gauss_next)}


def decode_random(state: dict) -> tuple:
    """The tuple ``random.setstate()`` takes, from ``encode_random``'s dict."""
    gauss_next = state["gauss_next"]
    return (int(state["version"]), tuple(int(v) for v in state["internal"]),
            None if gauss_next is None else float(gauss_next))


# -- this process --------------------------------------------------------------------------
def capture_rng() -> dict:
    """This process's random number generators: torch's CPU one, CUDA's (if initialised),
    NumPy's global one (if installed) and Python's ``random``."""
    numpy = _numpy()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda,
            "numpy": None if numpy is None else encode_numpy(numpy.random.get_state()),
            "random": encode_random(random.getstate())}


def restore_rng(state: dict) -> None:
    """Set the generators ``capture_rng`` read; CUDA's on the devices this process has
    (none when CUDA is not available), NumPy's when it is installed."""
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).clone())
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(s, dtype=torch.uint8).clone(), device)
    numpy = _numpy()
    if state.get("numpy") is not None and numpy is not None:
        numpy.random.set_state(decode_numpy(state["numpy"]))
    random.setstate(decode_random(state["random"]))


def capture_worker(worker_index: int) -> dict:
    """This worker's entry of ``"worker_states"``: its generators and its samplers."""
    return {"worker_index": int(worker_index), "rng": capture_rng(),
            "samplers": [s.state_dict() for s in live_samplers()]}


def restore_worker(entry: dict, label: str) -> None:
    """Set this worker's generators and live samplers from its saved ``entry``.

    Samplers are matched by creation order; when this process has another number of
    live ``WorkerSampler`` objects than were saved, none is restored and a warning
    (naming ``label``, this worker) says so.
    """
    samplers = live_samplers()
    saved = entry.get("samplers") or []
    if len(saved) == len(samplers):
        for sampler, state in zip(samplers, saved):
            sampler.load_state_dict(state)
    else:
        warnings.warn(f"{label}: the checkpoint holds {len(saved)} WorkerSampler state(s), "
                      f"this worker has {len(samplers)} WorkerSampler(s): their positions "
                      f"are not restored (build the samplers before loading)", stacklevel=3)
    restore_rng(entry["rng"])


def schedulers_of(opt: Any) -> list:
    """The top-level schedulers ``opt`` adopted, in the order they were built."""
    schedules = getattr(opt, "_mpisync_schedules", None)
    return [] if schedules is None else schedules.schedulers()


def scheduler_states(opt: Any) -> list[dict]:
    """``[{"class", "state"}]`` of every top-level scheduler ``opt`` adopted."""
    return [{"class": type(s).__name__, "state": s.state_dict()} for s in schedulers_of(opt)]


def restore_schedulers(opt: Any, saved: list[dict], label: str) -> None:
    """Load each saved scheduler state into ``opt``'s scheduler built in its place.

    When the schedulers built over ``opt`` are not those saved (another number, or
    other classes in that order) none is loaded and a warning (naming ``label``) says so.
    """
    live = schedulers_of(opt)
    mine = [type(s).__name__ for s in live]
    theirs = [str(s.get("class")) for s in saved]
    if mine != theirs:
        warnings.warn(f"{label}: the checkpoint holds the state of the schedulers {theirs}, "
                      f"the optimizer has {mine}: none is restored (build the same "
                      f"schedulers over the optimizer before loading)", stacklevel=3)
        return
    for scheduler, s in zip(live, saved):
        scheduler.load_state_dict(s["state"])


#: What the chief of a job under ``--restarts`` says when nothing would resume it.
START_OVER_WARNING = (
    "this job runs under `python -m mpisync.launch --restarts` (MPISYNC_ATTEMPT={attempt}) "
    "but made no mpisync.Checkpointer and loaded no checkpoint before its first step: "
    "unless it saves and loads checkpoints by hand, an attempt after a failure starts "
    "again from step 0. Make "
    "`ckpt = mpisync.Checkpointer(dir, model, opt, every_steps=...)`, call `ckpt.resume()` "
    "before training and `ckpt.maybe_save()` after each step")


#: ... and when it made a Checkpointer but did not call its ``resume()``.
START_OVER_NO_RESUME = (
    "this job runs under `python -m mpisync.launch --restarts` (MPISYNC_ATTEMPT={attempt}) "
    "and made an mpisync.Checkpointer, but did not call its resume() before the first step: "
    "an attempt after a failure starts again from step 0 and writes its checkpoints over "
    "the first attempt's. Call `ckpt.resume()` before training")


def warn_if_restarts_start_over(opt, environ=None) -> bool:
    """After the first ``step()`` of ``opt``: under ``python -m mpisync.launch --restarts``
    (``MPISYNC_ATTEMPT`` set), the chief of the first attempt warns, once, where no
    checkpoint was loaded into ``opt`` and no ``Checkpointer``'s ``resume()`` was called
    (``opt._resumable``; which of the two it says: ``opt._checkpointed``), at the line of
    the program that stepped. Returns whether it
    warned."""
    environ = os.environ if environ is None else environ
    attempt = environ.get("MPISYNC_ATTEMPT")
    if attempt not in ("0", "") or opt._resumable or not opt.cluster.is_chief:
        return False
    text = START_OVER_NO_RESUME if opt._checkpointed else START_OVER_WARNING
    warnings.warn(f"{opt.cluster.label}: " + text.format(attempt=attempt),
                  RuntimeWarning, stacklevel=_program_level())
    return True


_NOT_THE_PROGRAM = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _program_level() -> int:
    """The ``stacklevel`` of the first frame outside mpisync and torch, for a warning given
    by this module's caller (the line of the user's program that stepped)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_NOT_THE_PROGRAM):
        frame, level = frame.f_back, level + 1
    return level
