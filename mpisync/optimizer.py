"""SyncReplicasOptimizer: the worker side of synchronous parameter-server training."""
from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Iterable
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from . import placement as placement_mod
from .accumulate import REDUCTIONS
from .errors import ClosedError, ConfigError, ModelMismatchError, ProtocolError
from .progress import Poller, spin_seconds
from .wire import (
    PARAM_HEADER_BYTES,
    TOKEN_WORDS,
    GradHeader,
    HyperSchema,
    Kind,
    Tag,
    build_layouts,
    tensor_view,
)

__all__ = ["SyncReplicasOptimizer"]


class SyncReplicasOptimizer(torch.optim.Optimizer):
    """Synchronous data-parallel training with the model held on parameter-server ranks.

    Each ``step()`` sends, to every ps rank, one fused buffer holding the gradients that
    rank owns; the ps ranks average the first ``replicas_to_aggregate`` gradients computed
    at the current global step (later and older ones are dropped and counted), apply the
    wrapped optimizer, whose state lives there, and send the new parameters back. The
    coordinator (ps 0) then hands out the token: the new global step. ``step()`` returns
    once this worker holds the token and the parameters of that step.

    The model's parameters become views into the fused receive buffers, so the pull
    lands in the model directly; after ``zero_grad(set_to_none=False)`` the gradients
    are views into the send buffers too, so ``backward()`` writes what ``step()`` sends.
    Construction, ``state_dict()``, ``load_state_dict()`` and ``close()`` must be called
    on every worker; ``step()`` too (a worker that skips it holds a step up).

    Args:
        optimizer: any ``torch.optim`` optimizer over the model's parameters; it is rebuilt
            on the ps ranks over each shard (its class, defaults and param groups).
        named_parameters: ``model.named_parameters()``; names must match on every worker.
        replicas_to_aggregate: gradients averaged per step (default: the number of workers).
        total_num_replicas: the number of workers (default and only valid value: the number
            of worker ranks); more workers than ``replicas_to_aggregate`` are backups.
        num_tokens: extra gradients per step that workers may compute on the same
            parameters before the step is applied (default ``max(0, to_aggregate - total)``;
            fewer than that cannot complete a step).
        placement: ``"greedy_sorted"`` (default), ``"greedy"``, ``"round_robin"`` or a
            callable, see ``mpisync.placement.plan``.
        cluster: what ``mpisync.init()`` returned (default: the last one).
        reduction: ``"mean"`` (default: equal to training on the combined batch) or ``"sum"``.
        deterministic: also make torch's kernels deterministic on every rank; gradients
            are always reduced in worker order, so strict-sync runs repeat bitwise.
        ema_decay: keep an exponential moving average of every floating-point parameter on
            the ps ranks, updated after each applied step (``average = decay * average +
            (1 - decay) * parameter``); read it with ``averages()`` or ``averaged()``.
        ema_num_updates: use ``min(ema_decay, (1 + t) / (10 + t))`` after the t-th step, as
            TensorFlow's ``ExponentialMovingAverage(decay, num_updates=global_step)``.
        asynchronous: asynchronous training instead: the ps ranks apply every gradient as
            its own step, in arrival order, whatever step it was computed at, and send the
            pushing worker the new parameters at once. ``replicas_to_aggregate`` is 1.
        max_staleness: with ``asynchronous``, a worker may be at most this many applied
            gradients ahead of the slowest worker that has not closed; beyond that its
            ``step()`` waits for the slowest to catch up (default: unbounded).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 replicas_to_aggregate: int | None = None,
                 total_num_replicas: int | None = None,
                 num_tokens: int | None = None,
                 placement: str | Callable = "greedy_sorted",
                 cluster=None, reduction: str = "mean", deterministic: bool = False,
                 ema_decay: float | None = None, ema_num_updates: bool = False,
                 asynchronous: bool = False, max_staleness: int | None = None):
        from .ps_ranks import _current
        cluster = _current if cluster is None else cluster
        if cluster is None:
            raise RuntimeError("call mpisync.init() on every rank before creating a "
                               "SyncReplicasOptimizer")
        if cluster.is_ps:
            raise RuntimeError(f"{cluster.label}: SyncReplicasOptimizer is for workers; "
                               f"ps ranks call cluster.serve()")
        self.cluster = cluster
        self._closed = False
        self._averaged = False
        self._opt = optimizer
        named = list(named_parameters)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        poller = self._poller = Poller(cluster.p2p_comm, cluster.timeout, cluster.label,
                                       spin_seconds(cluster.oversubscribed))
        W = cluster.num_workers
        R = replicas_to_aggregate
        if R is None:
            R = 1 if asynchronous else W
        total = W if total_num_replicas is None else total_num_replicas

        error = None
        try:
            self._validate(optimizer, named, R, total, num_tokens, reduction, placement,
                           ema_decay, asynchronous, max_staleness)
        except (ValueError, TypeError) as exc:
            error = str(exc)
        summary = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        gathered = cluster.worker_comm.allgather((error, summary))
        failure = _first_failure(gathered)
        if failure is None:
            self._setup(optimizer, R, placement, reduction, deterministic,
                        max(0, R - total) if num_tokens is None else num_tokens,
                        ema_decay, ema_num_updates, asynchronous, max_staleness)
        if cluster.is_chief:
            for j in range(cluster.num_ps):
                payload = ("error", failure) if failure else ("spec", self._spec_for(j))
                cluster.p2p_comm.send(payload, dest=cluster.ps_rank(j), tag=Tag.SETUP)
        if failure is not None:
            exc_type, text = failure
            raise exc_type(f"{cluster.label}: {text}", collective=True)

        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups    # shared: schedulers edit them
        self.defaults = optimizer.defaults
        self.stopped = False
        self.global_step = -1
        self._seq = 0
        self._final_stats = None
        self._wait_s = 0.0
        self._steps = 0
        self._pull(poller)
        atexit.register(self._atexit)

    # -- set-up -------------------------------------------------------------------------
    @staticmethod
    def _validate(optimizer, named, R, total, num_tokens, reduction, placement,
                  ema_decay, asynchronous, max_staleness) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, SyncReplicasOptimizer):
            raise TypeError("optimizer is already a SyncReplicasOptimizer")
        for name, value in (("replicas_to_aggregate", R), ("total_num_replicas", total)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        from .ps_ranks import _current
        W = _current.num_workers
        if total != W:
            raise ValueError(f"total_num_replicas={total} but the job has {W} worker ranks; "
                             f"start {total} workers or leave total_num_replicas unset")
        if num_tokens is not None:
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
                raise TypeError(f"num_tokens must be an int, got {num_tokens!r}")
            if num_tokens < max(0, R - total):
                raise ValueError(
                    f"num_tokens={num_tokens} is too few: each step needs {R} gradients from "
                    f"{total} workers, so num_tokens must be >= {R - total}")
        if asynchronous and R != 1:
            raise ValueError(f"asynchronous mode applies each gradient alone: "
                             f"replicas_to_aggregate must be 1 (or unset), got {R}")
        if asynchronous and num_tokens:
            raise ValueError(f"asynchronous mode hands out one token per applied gradient: "
                             f"num_tokens must be unset, got {num_tokens}")
        if max_staleness is not None:
            if not asynchronous:
                raise ValueError("max_staleness bounds asynchronous training: pass "
                                 "asynchronous=True with it")
            if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
                raise TypeError(f"max_staleness must be an int, got {max_staleness!r}")
            if max_staleness < 0:
                raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if ema_decay is not None:
            if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)):
                raise TypeError(f"ema_decay must be a float, got {ema_decay!r}")
            if not 0.0 <= ema_decay < 1.0:
                raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not (callable(placement) or placement in placement_mod.STRATEGIES):
            raise ValueError(f"placement must be one of {placement_mod.STRATEGIES} or a "
                             f"callable, got {placement!r}")
        if not named:
            raise ValueError("named_parameters is empty")
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        names = set()
        for name, p in named:
            if name in names:
                raise ValueError(f"parameter name {name!r} appears twice")
            names.add(name)
            if id(p) not in in_opt:
                raise ValueError(f"parameter {name!r} is not in the optimizer's param_groups")
            if p.device.type != "cpu":
                raise ValueError(f"parameter {name!r} is on {p.device}; mpisync keeps "
                                 f"parameters in CPU memory")
        ids = {id(p) for _, p in named}
        if len(in_opt - ids):
            raise ValueError(f"the optimizer holds {len(in_opt - ids)} parameter(s) that are "
                             f"not in named_parameters")

    def _setup(self, optimizer, R, placement, reduction, deterministic, num_tokens,
               ema_decay, ema_num_updates, asynchronous, max_staleness) -> None:
        cluster = self.cluster
        if deterministic:
            torch.use_deterministic_algorithms(True)
        shapes = [tuple(p.shape) for p in self._params]
        dtypes = [p.dtype for p in self._params]
        sizes = [p.numel() * p.element_size() for p in self._params]
        self.plan = placement_mod.plan(self._names, sizes, cluster.num_ps, placement)
        self._layouts = build_layouts(self._names, shapes, dtypes, self.plan.owners,
                                      cluster.num_ps)
        self._schema = HyperSchema.from_groups(optimizer.param_groups)
        index = {n: i for i, n in enumerate(self._names)}
        name_of = {id(p): n for n, p in zip(self._names, self._params)}
        self._spec = {
            "names": self._names, "shapes": shapes, "dtypes": dtypes,
            "owners": self.plan.owners, "schema": self._schema,
            "opt_cls": type(optimizer), "opt_kwargs": _init_kwargs(optimizer),
            "groups": [({k: v for k, v in g.items() if k != "params"},
                        [name_of[id(p)] for p in g["params"]])
                       for g in optimizer.param_groups],
            "replicas_to_aggregate": R, "num_tokens": num_tokens, "reduction": reduction,
            "deterministic": deterministic, "global_step": 0,
            "ema_decay": None if ema_decay is None else float(ema_decay),
            "ema_num_updates": bool(ema_num_updates),
            "asynchronous": bool(asynchronous), "max_staleness": max_staleness,
        }
        comm = cluster.p2p_comm
        self._shards = []
        for j, layout in enumerate(self._layouts):
            header = GradHeader(self._schema.width, len(layout.entries))
            gbuf = np.zeros(header.nbytes + layout.nbytes, np.uint8)
            pbuf = np.zeros(PARAM_HEADER_BYTES + layout.nbytes, np.uint8)
            gt, pt = torch.from_numpy(gbuf), torch.from_numpy(pbuf)
            fields, hyper, mask = header.views(gbuf)
            idx = [index[e.name] for e in layout.entries]
            for e, i in zip(layout.entries, idx):
                p = self._params[i]
                pview = tensor_view(pt, PARAM_HEADER_BYTES, e.dtype, e.offset, e.nbytes, e.shape)
                pview.copy_(p.data)
                p.data = pview                      # the pull lands in the model
                p.grad = tensor_view(gt, header.nbytes, e.dtype, e.offset, e.nbytes, e.shape)
            self._shards.append({
                "gbuf": gbuf, "pbuf": pbuf, "fields": fields, "hyper": hyper, "mask": mask,
                "idx": np.array(idx, np.int64),
                "pfields": pbuf[:PARAM_HEADER_BYTES].view(np.int64),
                "regions": [tensor_view(gt, header.nbytes, d, off, n)
                            for d, off, n in layout.regions],
                "send": comm.Send_init([gbuf, MPI.BYTE], dest=cluster.ps_rank(j), tag=Tag.GRAD),
                "recv": comm.Recv_init([pbuf, MPI.BYTE], source=cluster.ps_rank(j),
                                       tag=Tag.PARAMS),
            })
        self._grad_views = [p.grad for p in self._params]
        self._has_grad = np.ones(len(self._params), np.uint8)
        self._token = np.zeros(TOKEN_WORDS, np.int64)
        self._token_req = comm.Recv_init([self._token, MPI.BYTE],
                                         source=cluster.coordinator_rank, tag=Tag.TOKEN)
        self._sends = [s["send"] for s in self._shards]
        self._recvs = [s["recv"] for s in self._shards]
        self._bytes_per_ps = [s["gbuf"].nbytes for s in self._shards]

    def _group_order(self) -> list[str]:
        """Parameter names in param-group order: how torch numbers them in a state_dict."""
        name_of = {id(p): n for n, p in zip(self._names, self._params)}
        return [name_of[id(p)] for g in self.param_groups for p in g["params"]]

    def _spec_for(self, j: int) -> dict:
        layout = self._layouts[j]
        data = np.zeros(layout.nbytes, np.uint8)
        pbuf = self._shards[j]["pbuf"]
        data[:] = pbuf[PARAM_HEADER_BYTES:]
        return dict(self._spec, shard_data=data)

    # -- the step -----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, with torch's meaning of ``set_to_none``.

        ``set_to_none=False`` zeroes the fused send buffers in place and keeps ``.grad``
        pointing into them, so ``backward()`` writes straight into what ``step()`` sends:
        no copy at all. With ``set_to_none=True`` (torch's default) ``.grad`` becomes None,
        a parameter that then gets no gradient is skipped on the ps exactly as torch
        would, and ``step()`` copies each new gradient into the send buffer once.
        """
        self._check_open("zero_grad")
        if set_to_none:
            for p in self._params:
                p.grad = None
            return
        for p, view in zip(self._params, self._grad_views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        for shard in self._shards:
            for region in shard["regions"]:
                region.zero_()

    def step(self, closure: Callable | None = None):
        """Push this worker's gradients, wait for the token, pull the new parameters.

        After training is over (``self.stopped``: other workers closed and no step can
        complete) it does nothing. Returns the closure's loss, if a closure is given.
        """
        self._check_open("step")
        if self._averaged:
            raise RuntimeError(f"{self.cluster.label}: step() inside averaged(): the model "
                               f"holds the moving averages there, not the parameters")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stopped:
            return loss
        self._gather_grads()
        seq = self._seq = self._seq + 1
        hyper = self._shards[0]["hyper"]
        self._schema.encode(self.param_groups, hyper)     # once, then copied to each shard
        for shard in self._shards:
            f = shard["fields"]
            f[0], f[1], f[2], f[3] = Kind.GRAD, self.global_step, self.cluster.worker_index, seq
            if shard["hyper"] is not hyper:
                shard["hyper"][:] = hyper
            np.take(self._has_grad, shard["idx"], out=shard["mask"])
        MPI.Prequest.Startall(self._sends)
        self._pull(self._poller)
        self._steps += 1
        return loss

    def _gather_grads(self) -> None:
        """Put every gradient in its send buffer and note which parameters have one."""
        has = self._has_grad
        for i, p in enumerate(self._params):
            g, view = p.grad, self._grad_views[i]
            if g is None:
                if has[i]:
                    view.zero_()       # absent: zeros, so the other workers' sum is exact
                    has[i] = 0
                continue
            if g.data_ptr() != view.data_ptr():
                if g.is_sparse:
                    raise TypeError(f"{self.cluster.label}: parameter {self._names[i]!r} has "
                                    f"a sparse gradient; use nn.Embedding(sparse=False)")
                view.copy_(g)          # deliberate: the gradient was made outside our buffer
                p.grad = view
            has[i] = 1

    def _pull(self, poller: Poller) -> None:
        """Wait for the token; with it come the parameters of the new global step."""
        start = time.perf_counter()
        self._token_req.Start()
        MPI.Prequest.Startall(self._recvs)
        poller.wait_all([self._token_req],
                        lambda: f"the token after step {self.global_step}")
        kind, step, params_follow = (int(x) for x in self._token[:3])
        if kind == Kind.GO and params_follow:
            poller.wait_all(self._recvs, lambda: f"the parameters of step {step}")
            for j, shard in enumerate(self._shards):
                if shard["pfields"][1] != step:
                    raise ProtocolError(f"{self.cluster.label}: ps {j} sent parameters of "
                                        f"step {shard['pfields'][1]} with token {step}")
        else:
            for r in self._recvs:
                r.Cancel()
            MPI.Request.Waitall(self._recvs)
            if kind == Kind.STOP:
                self.stopped = True
            elif kind != Kind.GO:
                raise ProtocolError(f"{self.cluster.label}: unknown token kind {kind}")
        poller.wait_all(self._sends, lambda: "gradient sends")
        self.global_step = step
        self._wait_s += time.perf_counter() - start

    # -- everything else ----------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{self.cluster.label}: {what}() called after close()")

    def _request(self, *req):
        self.cluster.p2p_comm.send(req, dest=self.cluster.coordinator_rank, tag=Tag.REQ)

    @property
    def stats(self) -> dict:
        """Step statistics from the coordinator, plus this worker's own figures.

        Keys: global_step, steps, gradients_applied, gradients_dropped, taken_per_worker,
        dropped_per_worker, per_step (each step's taken and dropped workers), and for this
        worker: local_steps, token_wait_s and bytes_per_ps (bytes pushed per step to each ps).
        """
        if self._closed:
            stats = dict(self._final_stats)
        else:
            self._request("stats")
            stats = self._poller.wait_message(self.cluster.coordinator_rank, Tag.INFO,
                                              lambda: "statistics from ps 0")
        stats.update(local_steps=self._steps, token_wait_s=self._wait_s,
                     bytes_per_ps=list(self._bytes_per_ps))
        return stats

    def _from_every_ps(self, what: str, describe: str) -> list:
        """Ask ps 0 for ``what``; every ps answers with its piece, at one global step."""
        self._request(what)
        return [self._poller.wait_message(self.cluster.ps_rank(j), Tag.INFO,
                                          lambda j=j: f"{describe} from ps {j}")
                for j in range(self.cluster.num_ps)]

    def state_dict(self) -> dict:
        """The optimizer state of the whole model, as a plain torch optimizer would hold it.

        Same schema as ``torch.optim.Optimizer.state_dict()`` (parameters numbered in
        param-group order), plus an ``"mpisync"`` entry with the global step, the plan's
        digest and, with ``ema_decay``, the moving averages (``{name: tensor}``).
        """
        self._check_open("state_dict")
        by_name, averages = {}, {}
        for state, avg in self._from_every_ps("state", "optimizer state"):
            by_name.update(state)
            averages.update(avg)
        local = torch.optim.Optimizer.state_dict(self._opt)
        order = self._group_order()
        local["state"] = {i: by_name[n] for i, n in enumerate(order) if n in by_name}
        local["mpisync"] = {"global_step": self.global_step, "plan": self.plan.digest()}
        if self._spec["ema_decay"] is not None:
            local["mpisync"]["averages"] = {n: averages[n] for n in self._names if n in averages}
        return local

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state (from ``state_dict()`` or a plain torch optimizer).

        Call on every worker, before training continues. Moving averages missing from
        ``state_dict`` restart from the current parameters.
        """
        self._check_open("load_state_dict")
        self._check_state(state_dict)
        groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        extra = state_dict.get("mpisync", {})
        step = extra.get("global_step", self.global_step)
        order = self._group_order()
        if self.cluster.is_chief:
            pieces = [{"state": {}, "averages": {}, "param_groups": groups, "global_step": step}
                      for _ in range(self.cluster.num_ps)]
            for i, st in state_dict["state"].items():
                name = order[int(i)]
                pieces[self.plan.owner(name)]["state"][name] = st
            for name, value in extra.get("averages", {}).items():
                pieces[self.plan.owner(name)]["averages"][name] = value
            self._request("load", pieces, step)
            err = self._poller.wait_message(self.cluster.coordinator_rank, Tag.INFO,
                                            lambda: "ps 0's answer to load_state_dict")
            if err is not None:
                raise err
        barrier = self.cluster.worker_comm.Ibarrier()
        self._poller.wait_all([barrier], lambda: "every worker's load_state_dict()")
        self._request("resync")
        self._pull(self._poller)

    def _check_state(self, state_dict: dict) -> None:
        """Refuse a state that does not fit this model, before anything is changed or sent.

        Every worker checks the same state, so every worker raises the same ConfigError.
        """
        def fail(what: str):
            raise ConfigError(f"{self.cluster.label}: load_state_dict(): {what}",
                              collective=True)

        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
            fail("expected a dict with 'state' and 'param_groups', as state_dict() returns")
        if len(groups) != len(self.param_groups):
            fail(f"the state has {len(groups)} param groups, the optimizer "
                 f"{len(self.param_groups)}")
        for g, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if len(saved.get("params", ())) != len(mine["params"]):
                fail(f"param group {g} has {len(saved.get('params', ()))} parameters in the "
                     f"state, {len(mine['params'])} in the optimizer")
        order = self._group_order()
        shape_of = {n: tuple(p.shape) for n, p in zip(self._names, self._params)}
        for i, st in state_dict["state"].items():
            if not 0 <= int(i) < len(order):
                fail(f"state for parameter #{i}, but the optimizer has {len(order)}")
            name = order[int(i)]
            for key, value in st.items():
                if torch.is_tensor(value) and value.dim() > 0 \
                        and tuple(value.shape) != shape_of[name]:
                    fail(f"state {key!r} of parameter #{i} ({name!r}) has shape "
                         f"{list(value.shape)}, the parameter {list(shape_of[name])}")
        for name, value in state_dict.get("mpisync", {}).get("averages", {}).items():
            if name not in shape_of or tuple(value.shape) != shape_of[name]:
                fail(f"moving average {name!r} with shape {list(value.shape)} does not match "
                     f"a parameter of the model")

    def averages(self) -> dict[str, torch.Tensor]:
        """The moving averages of the floating-point parameters, ``{name: tensor}``.

        They are those of the newest global step, in ``named_parameters`` order, pulled
        from the ps ranks (copies). Any single worker may call it, for example the chief
        before it evaluates; the others keep training meanwhile.

        Raises:
            ConfigError: the optimizer was created without ``ema_decay``.
        """
        self._check_open("averages")
        if self._spec["ema_decay"] is None:
            raise ConfigError(f"{self.cluster.label}: averages() needs a "
                              f"SyncReplicasOptimizer created with ema_decay")
        got = {}
        for part in self._from_every_ps("averages", "parameter averages"):
            got.update(part)
        return {n: got[n] for n in self._names if n in got}

    @contextlib.contextmanager
    def averaged(self):
        """Within the block the model's parameters hold their moving averages.

        For evaluation: ``with opt.averaged(): accuracy = evaluate(model)``. The parameters
        are restored when the block ends; ``step()`` inside it is an error. Yields what
        ``averages()`` returns.
        """
        averages = self.averages()
        pairs = [(p, averages[n]) for n, p in zip(self._names, self._params) if n in averages]
        with torch.no_grad():
            saved = [p.detach().clone() for p, _ in pairs]
            for p, avg in pairs:
                p.copy_(avg)
        self._averaged = True
        try:
            yield averages
        finally:
            self._averaged = False
            with torch.no_grad():
                for (p, _), old in zip(pairs, saved):
                    p.copy_(old)

    def close(self) -> None:
        """Leave the job: the ps ranks stop once every worker closed. Call on every worker."""
        if self._closed:
            return
        comm = self.cluster.p2p_comm
        bye = np.zeros(8, np.int64)
        bye[0], bye[1], bye[2] = Kind.CLOSE, self.global_step, self.cluster.worker_index
        for j in range(self.cluster.num_ps):
            comm.Send([bye, MPI.BYTE], dest=self.cluster.ps_rank(j), tag=Tag.GRAD)
        self._final_stats = self._poller.wait_message(self.cluster.coordinator_rank, Tag.INFO,
                                                      lambda: "the final statistics")
        for req in self._sends + self._recvs + [self._token_req]:
            req.Free()
        self._closed = True

    def _atexit(self) -> None:
        if not self._closed and MPI.Is_initialized() and not MPI.Is_finalized():
            self.close()


def _init_kwargs(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults that its constructor accepts."""
    import inspect

    sig = inspect.signature(type(optimizer).__init__)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in sig.parameters}


def _first_failure(gathered: list) -> tuple[type, str] | None:
    """The first error any worker saw, or the first model mismatch against worker 0."""
    for w, (error, _) in enumerate(gathered):
        if error is not None:
            return ConfigError, f"worker {w} (rank {w}): {error}"
    ref = gathered[0][1]
    for w, (_, summary) in enumerate(gathered[1:], start=1):
        if summary == ref:
            continue
        for i in range(max(len(ref), len(summary))):
            a = ref[i] if i < len(ref) else None
            b = summary[i] if i < len(summary) else None
            if a != b:
                return ModelMismatchError, (
                    f"worker {w} (rank {w}) has parameter #{i} = {_describe(b)} but worker 0 "
                    f"has {_describe(a)}; every worker must build the same model")
    return None


def _describe(entry) -> str:
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name!r} shape {list(shape)} {dtype}"
