"""Every refusal's exact message, in one process, where it is decided.

Set-up refusals are functions of the spec (``build_spec``, ``model_of``), of what the
workers gathered (``first_failure``) or of the backend (``backend_problem``): tested through
those. What needs a set-up optimizer runs on a private COMM_SELF on which this process is
worker 0 and ps 0 at once, the ps side's serve loop in a thread (``one_rank``). The
multi-rank jobs that prove every rank raises and nobody hangs are
tests/mpi/test_errors_reach_every_rank.py's (``refusals``) and tests/mpi/test_bad_input_jobs.py's.
"""
from __future__ import annotations

import importlib.util
import re
import sys
import threading
import time

import pytest
import torch
from mpi4py import MPI

# the public names first: they import the modules in an order without cycles
from mpisync import ClosedError, ConfigError, ModelMismatchError, SyncReplicasOptimizer
from mpisync.protocol.compare import first_failure, model_summary, setup_summary, versions
from mpisync.protocol.spec import Model, Options, build_spec, encode, model_of
from mpisync.ps.loop import _Serving, _setup
from mpisync.ps_ranks import RankLayout
from mpisync.runtime.progress import Poller
from mpisync.worker.allreduce import backend_problem
from mpisync.worker.devices import default_backend, gpu_identity

HOROVOD = importlib.util.find_spec("horovod") is not None
WORKER = "worker 0 (rank 0 on here)"
PS = "ps 0 (rank 0 on here)"
ALLREDUCE = ("dense='allreduce' averages the dense gradients of every worker in every step "
             "(an allreduce waits for all of them), so ")


def model(hidden: int = 32) -> torch.nn.Module:
    """tests/scripts/common.py's model (10 features, 3 classes)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 3))


def sgd(net, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)


class ScaledSGD(torch.optim.SGD):
    """Keeps a constructor argument as an attribute."""

    def __init__(self, params, lr, scale):
        super().__init__(params, lr=lr)
        self.scale = scale


class WorkersOnlySGD(torch.optim.SGD):
    """Removed from this module before a ps side decodes it: as if defined on workers only."""


# -- one process as worker 0 and ps 0 ------------------------------------------------------
class _Rank:
    """What SyncReplicasOptimizer (``ps=False``) and the ps serve loop read of a Cluster:
    rank 0 of a private COMM_SELF, the only worker and the only ps rank."""

    def __init__(self, p2p_comm, worker_comm, ps: bool):
        self.p2p_comm, self.workers_only = p2p_comm, worker_comm
        self.layout = RankLayout((0,), (0,))
        self.is_ps, self.is_chief = ps, not ps
        self.ps_index, self.worker_index = (0, None) if ps else (None, 0)
        self.label = PS if ps else WORKER
        self.num_workers = self.num_ps = 1
        self.coordinator_rank = self.rank = 0
        self.size, self.nodes = 1, ("here",)
        self.timeout, self.oversubscribed, self.losses = 20.0, True, None
        self.optimizers: list = []
        self.cuda_aware, self.device, self.closed = False, torch.device("cpu"), False

    def ps_rank(self, j: int) -> int:
        return 0


class _PsSide(threading.Thread):
    """ps 0's serve loop: sets up (or says why not) every optimizer worker 0 creates."""

    def __init__(self, comm):
        super().__init__(daemon=True)
        me = _Rank(comm, None, ps=True)
        self.serving = _Serving(me, Poller(comm, 20, me.label))
        self.stop, self.error = threading.Event(), None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.serving.turn():
                    time.sleep(1e-4)
        except BaseException as exc:  # noqa: BLE001 (the test reports it)
            self.error = exc


class OneRank:
    """Worker 0 of a job whose ps 0 is this process too; ``wrap`` makes an optimizer."""

    def __init__(self):
        self.p2p_comm, self.worker_comm = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
        self.cluster = _Rank(self.p2p_comm, self.worker_comm, ps=False)
        self.ps = _PsSide(self.p2p_comm)
        self.ps.start()

    def wrap(self, net, optimizer=None, **kw) -> SyncReplicasOptimizer:
        return SyncReplicasOptimizer(
            sgd(net) if optimizer is None else optimizer,
            named_parameters=net.named_parameters(), cluster=self.cluster,
            shared_memory=False, **kw)

    def end(self) -> None:
        for opt in self.cluster.optimizers:
            opt.close()
        self.ps.stop.set()
        self.ps.join(10)
        self.p2p_comm.Free()
        self.worker_comm.Free()
        assert self.ps.error is None, repr(self.ps.error)


@pytest.fixture
def one_rank():
    rank = OneRank()
    try:
        yield rank
    finally:
        rank.end()


def train(opt, net, steps: int, after_backward=None) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()


def refused(fn, kind: type = ConfigError) -> BaseException:
    with pytest.raises(kind) as info:
        fn()
    return info.value


# -- set-up refusals of the spec ------------------------------------------------------------
def _spec_error(optimizer, net_or_pairs, options: Options, num_workers: int = 2,
                num_ps: int = 1) -> str:
    pairs = (tuple(net_or_pairs.named_parameters()) if isinstance(net_or_pairs, torch.nn.Module)
             else tuple(net_or_pairs))
    with pytest.raises((ValueError, TypeError)) as info:
        build_spec(optimizer, Model(pairs), options, opt_id=0, num_workers=num_workers,
                   num_ps=num_ps)
    return str(info.value)


def _lbfgs(net):
    return torch.optim.LBFGS(net.parameters())


def _sparse_adam(net):
    return torch.optim.SparseAdam(net.parameters())


#: case: (the options, the wrapped optimizer's maker (None: SGD), the message)
SPEC_REFUSALS = {
    # tests/mpi/test_errors_reach_every_rank.py
    "replicas0": ({"replicas_to_aggregate": 0}, None,
                  "replicas_to_aggregate must be >= 1, got 0"),
    "async_replicas": ({"replicas_to_aggregate": 2, "asynchronous": True}, None,
                       ("asynchronous mode applies each gradient alone: replicas_to_aggregate "
                        "must be 1 (or unset), got 2")),
    "staleness_without_async": ({"max_staleness": 1}, None,
                                ("max_staleness bounds asynchronous training: pass "
                                 "asynchronous=True with it")),
    "ema_bad": ({"ema_decay": 1.0}, None, "ema_decay must be in [0, 1), got 1.0"),
    "lbfgs": ({}, _lbfgs,
              ("torch.optim.lbfgs.LBFGS.step requires a closure: it re-evaluates the model "
               "several times per step, which cannot run on the parameter servers, where the "
               "parameters live; use a first-order optimizer (SGD, Adam, ...) instead")),
    "sparseadam": ({}, _sparse_adam,
                   ("torch.optim.SparseAdam takes sparse gradients only, and parameter "
                    "'0.weight' gets a dense one (torch fails at its first step); give the "
                    "dense parameters an optimizer of their own")),
    # tests/mpi/test_errors_reach_every_rank.py, what dense="allreduce" cannot do (2 workers)
    "allreduce_replicas": ({"dense": "allreduce", "replicas_to_aggregate": 1}, None,
                           (ALLREDUCE + "backup workers do not apply: replicas_to_aggregate "
                            "must be the number of workers (2) or unset, got 1; use "
                            "dense='ps' for backup workers")),
    "allreduce_async": ({"dense": "allreduce", "asynchronous": True}, None,
                        (ALLREDUCE + "it cannot train asynchronously; use dense='ps' for "
                         "asynchronous training")),
    "allreduce_tokens": ({"dense": "allreduce", "num_tokens": 1}, None,
                         (ALLREDUCE + "no worker may run ahead of the others: num_tokens "
                          "must be 0 or unset, got 1")),
    "allreduce_bucket_bytes": ({"dense": "allreduce", "bucket_bytes": 0}, None,
                               "bucket_bytes must be >= 1, got 0"),
    # tests/mpi/test_bad_input_jobs.py
    "replicas_not_int": ({"replicas_to_aggregate": "2"}, None,
                         "replicas_to_aggregate must be an int, got '2'"),
    "total_not_workers": ({"total_num_replicas": 5}, None,
                          ("total_num_replicas=5 but the job has 2 worker ranks; start 5 "
                           "workers or leave total_num_replicas unset")),
    "nonfinite_unknown": ({"nonfinite": "ignore"}, None,
                          "nonfinite must be one of ('raise', 'skip'), got 'ignore'"),
    "nonfinite_skip_allreduce": ({"dense": "allreduce", "nonfinite": "skip"}, None,
                                 ("nonfinite='skip' needs dense='ps': with dense='allreduce' "
                                  "the workers step the dense parameters and the ps ranks the "
                                  "rest, each on its own, so no one skips the step whole; use "
                                  "nonfinite='raise' (checked on the workers too) or "
                                  "dense='ps'")),
}


@pytest.mark.parametrize("case", SPEC_REFUSALS)
def test_a_set_up_refusal_of_the_spec_says_exactly_what_is_wrong(case):
    options, make, message = SPEC_REFUSALS[case]
    net = model()
    optimizer = sgd(net) if make is None else make(net)
    assert _spec_error(optimizer, net, Options(**options)) == message


@pytest.mark.parametrize("pairs, message", [
    (lambda net: [("w", p) for p in net.parameters()],
     "name 'w' appears twice in named_parameters/named_buffers"),
    (lambda net: [], "named_parameters is empty"),
    (lambda net: net.to("meta").named_parameters(),
     ("'0.weight' is on the meta device (shapes only, no values); materialise the model on "
      "its device (cluster.device, e.g. model.to_empty(device=...) and an initialisation) "
      "before creating the SyncReplicasOptimizer")),
], ids=["duplicate_names", "empty_model", "meta_parameter"])
def test_a_model_the_spec_cannot_hold_is_refused_naming_it(pairs, message):
    net = model()
    optimizer = sgd(net)
    assert _spec_error(optimizer, pairs(net), Options()) == message


@pytest.mark.parametrize("named, message", [
    (lambda net: net.parameters(),
     ("named_parameters must yield (name, tensor) pairs, as model.named_parameters() does; "
      "item #0 is a Parameter (model.parameters() where model.named_parameters() belongs?)")),
    (lambda net: [*net.named_parameters(), ("temperature", 0.5)],
     "named_parameters item 'temperature' is a float, not a tensor"),
], ids=["named_parameters_not_pairs", "named_not_tensor"])
def test_named_parameters_that_are_not_named_tensors_are_described(named, message):
    assert model_of(named(model()))[1] == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_nccl_without_cuda_is_refused():
    assert backend_problem("nccl", MPI.COMM_SELF, 2) == (
        "allreduce_backend='nccl' needs CUDA and a torch built with NCCL; use "
        "allreduce_backend='mpi' for parameters on the CPU")


def test_nccl_on_a_gpu_two_workers_share_is_refused_naming_them():
    gpus = [("node1", "GPU-a"), ("node1", "GPU-b"), ("node2", "GPU-a"), ("node1", "GPU-b")]
    assert backend_problem("nccl", MPI.COMM_SELF, 4, gpus) == (
        "allreduce_backend='nccl' needs a GPU of its own for each worker, but workers 1 and "
        "3 share GPU GPU-b on node1 (NCCL refuses two ranks on one device): give each "
        "worker its own GPU (CUDA_VISIBLE_DEVICES), or leave allreduce_backend='auto', "
        "which averages through host memory where workers share a GPU")


@pytest.mark.parametrize("gpus, backend", [
    ([("a", "0"), ("a", "1")], "nccl"),                 # a GPU each
    ([("a", "0"), ("b", "0")], "nccl"),                 # one each, on two hosts
    ([("a", "0"), ("a", "0")], "mpi"),                  # shared: NCCL would refuse
    ([("a", "0"), None], "mpi"),                        # one worker on the CPU
    ([None, None], "mpi"),
    ([], "mpi"),
])
def test_auto_takes_nccl_only_where_every_worker_has_a_gpu_of_its_own(gpus, backend):
    assert default_backend("auto", gpus) == backend
    assert default_backend("horovod", gpus) == "horovod"      # what the user named stays
    assert gpu_identity([torch.zeros(2)]) is None               # the CPU: no GPU to name


@pytest.mark.skipif(HOROVOD, reason="horovod is installed here")
def test_horovod_that_is_not_installed_is_refused():
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE    # else the thread level is named
    assert backend_problem("horovod", MPI.COMM_SELF, 2) == (
        "allreduce_backend='horovod' needs horovod (make horovod installs it): No module "
        "named 'horovod'")


@pytest.mark.parametrize("case", ["replicas0", "async_replicas", "staleness_without_async",
                                  "ema_bad", "lbfgs", "sparseadam"])
def test_a_refused_set_up_is_raised_by_the_worker_said_by_the_ps_and_set_up_again(
        one_rank, capsys, case):
    options, make, message = SPEC_REFUSALS[case]
    net = model()
    exc = refused(lambda: one_rank.wrap(net, None if make is None else make(net), **options))
    assert str(exc) == f"{WORKER}: worker 0 (rank 0): {message}" and exc.collective
    opt = one_rank.wrap(net)               # the same worker sets up again, and trains
    train(opt, net, 2)
    opt.close()
    assert opt.global_step == 2
    assert (f"[mpisync] {PS}: ConfigError: setup failed on the workers: worker 0 (rank 0): "
            f"{message} (serving on until the workers leave or set up again)\n"
            ) in capsys.readouterr().err


# -- refusals that differ between workers ---------------------------------------------------
def _gathered(*setups, num_ps: int = 1) -> list:
    """What the workers' allgather holds at set-up: (error, model, set-up) of each worker;
    ``setups``: each worker's ``(net, optimizer of net, Options)``."""
    out = []
    for net, optimizer, options in setups:
        m = Model(tuple(net.named_parameters()))
        spec, routes = build_spec(optimizer, m, options, opt_id=0, num_workers=len(setups),
                                  num_ps=num_ps)
        out.append((None, model_summary(m), setup_summary(spec, routes)))
    return out


def _differing(text: str) -> str:
    return (f"workers set up the optimizer differently from worker 0: worker 1 (rank 1); "
            f"worker 1 has {text}. Every worker must create the same optimizer with the same "
            f"arguments and placement")


@pytest.mark.parametrize("hidden", [33, 16], ids=["mismatch", "orders_differ"])
def test_workers_with_different_models_are_refused_naming_the_first_difference(hidden):
    """A wider model on worker 1 (test_errors_reach_every_rank.py), or the optimizer of
    another model created first there (test_bad_input_jobs.py)."""
    a, b = model(32), model(hidden)
    assert first_failure(_gathered((a, sgd(a), Options()), (b, sgd(b), Options())), (0, 1)) == (
        ModelMismatchError, (f"worker 1 (rank 1) has parameter #0 = '0.weight' shape "
                             f"[{hidden}, 10] torch.float32 but worker 0 has '0.weight' shape "
                             f"[32, 10] torch.float32; every worker must build the same model"))


def test_a_placement_that_differs_between_workers_is_refused_naming_the_parameter():
    def placement(worker):
        return lambda name, nbytes, loads: worker % 2 if name == "2.weight" else 0
    a, b = model(), model()
    gathered = _gathered((a, sgd(a), Options(placement=placement(0))),
                         (b, sgd(b), Options(placement=placement(1))), num_ps=2)
    assert first_failure(gathered, (0, 1)) == (
        ConfigError, _differing("placement of '2.weight' = ps 1 where worker 0 has ps 0"))


def test_a_different_optimizer_class_is_refused_naming_both():
    a, b = model(), model()
    gathered = _gathered((a, sgd(a), Options()),
                         (b, torch.optim.Adam(b.parameters()), Options()))
    assert first_failure(gathered, (0, 1)) == (ConfigError, _differing(
        "optimizer class = torch.optim.adam.Adam where worker 0 has torch.optim.sgd.SGD"))


def test_a_different_learning_rate_is_refused_naming_both():
    a, b = model(), model()
    exc_type, text = first_failure(_gathered((a, sgd(a), Options()),
                                             (b, sgd(b, lr=0.2), Options())), (0, 1))
    assert exc_type is ConfigError
    assert re.fullmatch(re.escape(_differing("@")).replace(
        "@", r"optimizer kwargs = \{.*'lr': 0\.2.*\} where worker 0 has \{.*'lr': 0\.1.*\}"),
        text), text


def test_a_problem_one_worker_found_is_every_workers_error():
    a = model()
    gathered = _gathered((a, sgd(a), Options()), (a, sgd(a), Options()))
    gathered[1] = ("replicas_to_aggregate must be >= 1, got 0", *gathered[1][1:])
    assert first_failure(gathered, (0, 3)) == (
        ConfigError, "worker 1 (rank 3): replicas_to_aggregate must be >= 1, got 0")


def test_an_optimizer_class_only_the_workers_define_is_named_on_the_ps(monkeypatch):
    net = model()
    spec, _ = build_spec(WorkersOnlySGD(net.parameters(), lr=0.1),
                         Model(tuple(net.named_parameters())), Options(), opt_id=0,
                         num_workers=2, num_ps=1)
    data = encode(spec)
    monkeypatch.delattr(sys.modules[__name__], "WorkersOnlySGD")

    class Rank:
        label = "ps 0 (rank 2 on here)"

    with pytest.raises(ConfigError) as info:
        _setup(Rank(), Poller(None, 5, "ps 0"), ("spec", data, [None], {"mpisync": versions()}))
    assert re.fullmatch(r"ps 0 \(rank 2 on here\): cannot rebuild the workers' optimizer here: "
                        r".*'WorkersOnlySGD'.*\. Define the optimizer class where every rank "
                        r"runs it \(at module level, not only in the workers' branch\)",
                        str(info.value)), info.value


# -- refused after set-up, on a set-up optimizer --------------------------------------------
def test_a_second_optimizer_over_an_open_ones_parameter_is_refused(one_rank):
    net = model()
    first = one_rank.wrap(net)
    exc = refused(lambda: one_rank.wrap(net))
    assert str(exc) == (f"{WORKER}: worker 0 (rank 0): parameter '0.weight' is held by "
                        f"SyncReplicasOptimizer #0 too, which is open: the ps ranks would update "
                        f"it for each of them on its own; give each parameter to one optimizer "
                        f"(or close the other first)") and exc.collective
    train(first, net, 2)
    assert first.global_step == 2


def test_a_grad_scaler_is_refused_before_anything_is_sent(one_rank):
    net = model()
    opt = one_rank.wrap(net)
    train(opt, net, 1)
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(net(torch.randn(4, 10)).sum()).backward()
    exc = refused(lambda: scaler.step(opt))
    assert str(exc) == (f"{WORKER}: torch.amp.GradScaler is not supported yet: each worker would "
                        f"skip the steps its own gradients overflow in, and the workers would "
                        f"drift apart. Train in float32, or with bfloat16 autocast (no scaler "
                        f"needed)") and exc.collective
    assert opt.global_step == 1
    del opt.found_inf, opt.grad_scale          # what GradScaler.step left on the optimizer
    train(opt, net, 1)
    assert opt.global_step == 2


def test_add_param_group_after_wrapping_is_refused(one_rank):
    net = model()
    opt = one_rank.wrap(net)
    exc = refused(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}))
    assert str(exc) == (f"{WORKER}: add_param_group() after the SyncReplicasOptimizer was "
                        f"created; create the optimizer with every param group first (a group "
                        f"of parameters with requires_grad=False, whose .grad stays None, is "
                        f"skipped until they get gradients)") and exc.collective


def test_an_attribute_changed_after_wrapping_is_refused_at_the_next_step(one_rank):
    net = model()
    wrapped = ScaledSGD(net.parameters(), lr=0.1, scale=0.5)
    opt = one_rank.wrap(net, wrapped)
    train(opt, net, 1)
    wrapped.scale = 10.0
    exc = refused(lambda: train(opt, net, 1))
    assert str(exc) == (f"{WORKER}: the wrapped ScaledSGD's attribute 'scale' changed from 0.5 "
                        f"to 10.0 after the SyncReplicasOptimizer was created; the ps ranks "
                        f"rebuilt the optimizer with the old value. Keep values that change "
                        f"during training in param_groups: they travel with every step")
    assert opt.global_step == 1
    wrapped.scale = 0.5
    train(opt, net, 1)
    assert opt.global_step == 2


def test_averages_without_ema_decay_is_refused_on_the_worker_that_asks(one_rank):
    opt = one_rank.wrap(model())
    exc = refused(opt.averages)
    assert str(exc) == (f"{WORKER}: averages() needs a SyncReplicasOptimizer created with "
                        f"ema_decay")
    assert not exc.collective           # raised on one worker: uncaught, it ends the job


def test_step_inside_averaged_is_refused(one_rank):
    opt = one_rank.wrap(model(), ema_decay=0.5)
    with opt.averaged():
        exc = refused(opt.step, RuntimeError)
    assert str(exc) == (f"{WORKER}: step() inside averaged(): the model holds the moving "
                        f"averages there, not the parameters")
    assert not getattr(exc, "collective", False)


def test_step_after_close_is_refused(one_rank):
    opt = one_rank.wrap(model())
    opt.close()
    assert str(refused(opt.step, ClosedError)) == f"{WORKER}: step() called after close()"


def test_a_state_that_does_not_fit_is_refused_and_loses_nothing(one_rank):
    net = model()
    opt = one_rank.wrap(net)
    train(opt, net, 2)
    bad = opt.state_dict()
    bad["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
    exc = refused(lambda: opt.load_state_dict(bad))
    assert str(exc) == (f"{WORKER}: load_state_dict(): state 'momentum_buffer' of parameter #0 "
                        f"('0.weight') has shape [3, 3], the parameter [32, 10]") and exc.collective
    train(opt, net, 1)
    assert opt.global_step == 3


def test_a_model_converted_after_wrapping_with_allreduce_is_refused_naming_the_parameter(
        one_rank):
    net = model()
    opt = one_rank.wrap(net, dense="allreduce", allreduce_backend="mpi")
    train(opt, net, 1)
    exc = refused(lambda: train(opt, net, 1, after_backward=net.double), TypeError)
    assert str(exc) == (f"{WORKER}: parameter '2.bias' became a torch.float64 tensor after the "
                        f"optimizer was created (it was torch.float32); convert the model before "
                        f"creating the SyncReplicasOptimizer")
    net.float()
    train(opt, net, 1)
    assert opt.global_step == 2


class _SparseNet(torch.nn.Module):
    """tests/scripts/errors.py's: a sparse gradient from the functional form, not seen at
    set-up."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 10)
        self.out = torch.nn.Linear(10, 3)

    def forward(self, ids):
        return self.out(torch.nn.functional.embedding(ids, self.emb.weight, sparse=True).mean(1))


def test_a_sparse_gradient_is_refused_naming_the_parameter(one_rank):
    net = _SparseNet()
    one_rank.wrap(net)
    loss = net(torch.randint(0, 20, (4, 3))).sum()
    exc = refused(loss.backward, TypeError)          # as the gradient is handed to mpisync
    assert str(exc) == (f"{WORKER}: parameter 'emb.weight' has a sparse gradient "
                        f"(torch.sparse_coo) but is not the weight of an nn.Embedding or "
                        f"nn.EmbeddingBag with sparse=True, whose rows mpisync sends as rows; use "
                        f"such a module (or mpisync.Embedding), or a dense gradient")


# -- tests/mpi/test_bad_input_jobs.py's refusals at step(), before anything is sent ----------
def _append_param(net, opt):
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    return lambda: opt.param_groups[0]["params"].pop()


def _pop_param(net, opt):
    popped = opt.param_groups[0]["params"].pop()
    return lambda: opt.param_groups[0]["params"].append(popped)


def _to_double(net, opt):
    net[0].weight.data = net[0].weight.data.double()
    return lambda: setattr(net[0].weight, "data", net[0].weight.data.float())


def _wrong_grad_shape(net, opt):
    net[0].weight.grad.data = torch.ones(net[0].weight.shape[1:])   # .data: no shape check
    return lambda: None


GROUPS_CHANGED = ("the param groups changed after the SyncReplicasOptimizer was created ({}); "
                  "the ps ranks hold the parameters of the groups given at set-up: create the "
                  "optimizer with every param group and parameter (one with requires_grad=False, "
                  "or without a gradient, is skipped), and do not change "
                  "param_groups[i]['params']")


@pytest.mark.parametrize("spoil, kind, message", [
    (_append_param, ConfigError, GROUPS_CHANGED.format(
        "'a parameter not in named_parameters' added")),
    (_pop_param, ConfigError, GROUPS_CHANGED.format("'2.bias' removed")),
    (_to_double, TypeError, ("parameter '0.weight' became a torch.float64 tensor of shape "
                             "[32, 10] on cpu after the optimizer was created; mpisync holds it "
                             "as torch.float32 [32, 10] on cpu. Convert or move the model "
                             "before creating the SyncReplicasOptimizer")),
    (_wrong_grad_shape, ValueError, ("the gradient of parameter '0.weight' is torch.float32 "
                                     "[10], the parameter torch.float32 [32, 10]; .grad must "
                                     "have its parameter's shape and dtype")),
], ids=["groups_appended", "groups_removed", "dtype_changed", "grad_shape"])
def test_a_model_changed_under_the_optimizer_is_refused_at_step(one_rank, spoil, kind,
                                                                message):
    """Spoiled between backward() and step(): refused, nothing sent; repaired, it trains."""
    net = model()
    opt = one_rank.wrap(net)
    train(opt, net, 1)
    repairs = []
    exc = refused(lambda: train(opt, net, 1, after_backward=lambda: repairs.append(
        spoil(net, opt))), kind)
    assert str(exc) == f"{WORKER}: {message}"
    assert opt.global_step == 1
    repairs[0]()
    train(opt, net, 1)
    assert opt.global_step == 2


def test_a_worker_refused_for_a_model_it_converted_still_closes(one_rank):
    """``model.double()`` (as ``model.cpu()`` off a GPU) after wrapping: every step is
    refused, and ``close()`` still leaves the job, with a warning, instead of raising the
    refusal again while the ps ranks wait for the worker."""
    net = model()
    opt = one_rank.wrap(net)
    train(opt, net, 1)
    net.double()
    for _ in range(2):                  # the batch follows the model, as users write it
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.randn(16, 10).double()),
                                          torch.randint(0, 3, (16,))).backward()
        exc = refused(opt.step, TypeError)
        assert "became a torch.float64 tensor" in str(exc)
    with pytest.warns(RuntimeWarning, match=r"became a torch\.float64 tensor .*; closing "
                                            r"with the values of the last step"):
        opt.close()
    assert opt.closed and opt.global_step == 1


def test_a_model_built_before_mpisyncs_first_use_is_still_watched(one_rank):
    """``import mpisync`` installs nothing; the hook that notes which module holds each
    parameter comes with the first optimizer, and goes with the last one's ``close()``. A
    model built before that (its holders unknown to the hook, as here) is found among the
    live modules: ``model.to("meta")`` after wrapping is refused as for any other model."""
    from mpisync.protocol import holders
    net = model()
    for p in net.parameters():
        holders._registered.pop(id(p), None)
    opt = one_rank.wrap(net)
    train(opt, net, 1)
    net.to("meta")
    x, y = torch.randn(16, 10, device="meta"), torch.randint(0, 3, (16,), device="meta")
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    exc = refused(opt.step, ConfigError)
    assert "the model no longer holds parameters ['0.weight', '0.bias', '2.weight', " \
           "'2.bias'] of this SyncReplicasOptimizer: they were replaced" in str(exc), str(exc)
    assert opt.global_step == 1


def _torch_hooks() -> dict[str, int]:
    """The global hooks torch holds, by kind (those of every module and optimizer)."""
    from torch.nn.modules import module
    from torch.optim import optimizer
    return {name: len(hooks) for mod in (module, optimizer) for name, hooks in vars(mod).items()
            if name.startswith("_global_") and isinstance(hooks, dict) and hooks}


def _wrapped_schedulers() -> list[str]:
    """The scheduler classes whose ``__init__`` mpisync wrapped (to adopt schedulers)."""
    from torch.optim import lr_scheduler as lrs
    return [cls.__name__ for cls in (lrs.LRScheduler, lrs.SequentialLR, lrs.ChainedScheduler)
            if getattr(cls.__dict__["__init__"], "_mpisync_schedules_hook", False)]


def test_only_open_optimizers_hold_hooks_in_torch(one_rank):
    """Importing mpisync and every public name changes nothing in torch. An optimizer
    installs the parameter-registration hook and the schedulers' constructor hook when it
    is created (not when its set-up is refused); they stay while any optimizer is open and
    go with the last ``close()``."""
    import mpisync
    for name in mpisync.__all__:
        getattr(mpisync, name)
    assert _torch_hooks() == {} and _wrapped_schedulers() == []
    installed = {"_global_parameter_registration_hooks": 1}
    schedulers = ["LRScheduler", "SequentialLR", "ChainedScheduler"]
    refused(lambda: one_rank.wrap(model(), buffers="nope"), ValueError)
    assert _torch_hooks() == {} and _wrapped_schedulers() == []
    first_net, second_net = model(), model()
    first = one_rank.wrap(first_net)
    assert _torch_hooks() == installed and _wrapped_schedulers() == schedulers
    second = one_rank.wrap(second_net)
    first.close()
    assert _torch_hooks() == installed and _wrapped_schedulers() == schedulers
    sched = torch.optim.lr_scheduler.StepLR(second, step_size=2)
    assert sched in second._mpisync_schedules._records        # adopted
    train(second, second_net, 1)
    second.close()
    assert _torch_hooks() == {} and _wrapped_schedulers() == []
