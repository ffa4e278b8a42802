"""One-process tests of the job spec: validation in one place, encoding, agreement."""
from __future__ import annotations

import pickle

import pytest
import torch

from mpisync.accumulate import REDUCTIONS
from mpisync.errors import ConfigError, ModelMismatchError
from mpisync.protocol.compare import (
    first_difference,
    first_failure,
    model_difference,
    model_summary,
    setup_summary,
)
from mpisync.protocol.spec import SPEC_VERSION, Model, Options, build_spec, decode, encode


def spec_of(opt=None, model=None, num_workers=2, num_ps=2, **options):
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                              torch.nn.Linear(3, 2))
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = model or Model(tuple(net.named_parameters()), tuple(net.named_buffers()))
    return build_spec(opt, model, Options(**options), opt_id=0, num_workers=num_workers,
                      num_ps=num_ps)


# -- the checks that used to live in StepCoordinator and ShardAccumulator too -------------
@pytest.mark.parametrize("replicas_to_aggregate", [0, -1])
def test_replicas_to_aggregate_below_one_is_rejected(replicas_to_aggregate):
    with pytest.raises(ValueError, match=rf"replicas_to_aggregate must be >= 1, got "
                                         rf"{replicas_to_aggregate}"):
        spec_of(replicas_to_aggregate=replicas_to_aggregate)


@pytest.mark.parametrize("num_workers, replicas_to_aggregate, num_tokens", [
    (2, 4, 1), (2, 4, 0), (1, 3, 1), (3, 5, 0)])
def test_too_few_tokens_for_fewer_workers_than_gradients(num_workers, replicas_to_aggregate,
                                                         num_tokens):
    needed = replicas_to_aggregate - num_workers
    with pytest.raises(ValueError) as err:
        spec_of(num_workers=num_workers, replicas_to_aggregate=replicas_to_aggregate,
                num_tokens=num_tokens)
    msg = str(err.value)
    # the message names the observed value, the shape of the job and the fix
    assert f"num_tokens={num_tokens}" in msg
    assert f"{replicas_to_aggregate} gradients from {num_workers} workers" in msg
    assert f"num_tokens must be >= {needed}" in msg


@pytest.mark.parametrize("num_workers, replicas_to_aggregate, num_tokens", [
    (2, 4, 2), (2, 4, 5), (3, 3, 0), (5, 3, 0), (1, 1, 0), (1, 3, 2)])
def test_enough_tokens_are_accepted(num_workers, replicas_to_aggregate, num_tokens):
    spec, _ = spec_of(num_workers=num_workers, replicas_to_aggregate=replicas_to_aggregate,
                      num_tokens=num_tokens)
    assert (spec.num_workers, spec.replicas_to_aggregate, spec.num_tokens) == (
        num_workers, replicas_to_aggregate, num_tokens)


def test_default_num_tokens_is_just_enough():
    spec, _ = spec_of(num_workers=2, replicas_to_aggregate=5)
    assert spec.num_tokens == 3


def test_negative_num_tokens_is_rejected():
    with pytest.raises(ValueError, match="num_tokens=-1"):
        spec_of(num_workers=3, replicas_to_aggregate=3, num_tokens=-1)


def test_negative_num_tokens_message_names_the_real_minimum():
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0\b"):
        spec_of(num_workers=5, replicas_to_aggregate=3, num_tokens=-1)


@pytest.mark.parametrize("options, match", [
    ({"replicas_to_aggregate": 2}, "replicas_to_aggregate must be 1"),
    ({"num_tokens": 1}, "num_tokens must be unset"),
    ({"max_staleness": -1}, "max_staleness must be >= 0, got -1"),
])
def test_async_arguments_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        spec_of(asynchronous=True, **options)


def test_max_staleness_needs_async():
    with pytest.raises(ValueError, match="max_staleness bounds asynchronous training"):
        spec_of(max_staleness=1)


def test_an_unknown_reduction_is_rejected():
    with pytest.raises(ValueError, match=r"reduction must be one of \('mean', 'sum'\), "
                                         r"got 'max'"):
        spec_of(reduction="max")
    assert REDUCTIONS == ("mean", "sum")


@pytest.mark.parametrize("options, error, match", [
    ({"total_num_replicas": 3}, ValueError, "total_num_replicas=3 but the job has 2 worker"),
    ({"replicas_to_aggregate": True}, TypeError, "replicas_to_aggregate must be an int"),
    ({"ema_decay": 1.0}, ValueError, r"ema_decay must be in \[0, 1\), got 1.0"),
    ({"ema_decay": "0.9"}, TypeError, "ema_decay must be a float"),
    ({"placement": "nearest"}, ValueError, "placement must be one of"),
    ({"buffers": "sum"}, ValueError, r"buffers must be one of \('broadcast', 'mean', 'local'\)"),
    ({"schedule": "epoch"}, ValueError, "schedule must be one of"),
])
def test_bad_options_name_the_value_and_the_choices(options, error, match):
    with pytest.raises(error, match=match):
        spec_of(**options)


def test_bad_models_are_refused_before_anything_is_sent():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="named_parameters is empty"):
        spec_of(opt, Model(()))
    with pytest.raises(ValueError, match="'weight' appears twice"):
        spec_of(opt, Model((("weight", net.weight), ("weight", net.bias))))
    with pytest.raises(ValueError, match="optimizer holds 1 parameter"):
        spec_of(opt, Model((("weight", net.weight),)))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        spec_of(object(), Model(tuple(net.named_parameters())))
    with pytest.raises(ConfigError, match="LBFGS"):
        spec_of(torch.optim.LBFGS(net.parameters()), Model(tuple(net.named_parameters())))


# -- what the spec holds ------------------------------------------------------------------
def test_frozen_parameters_are_routed_replicated_and_buffers_to_the_ps():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(net[1].parameters())          # fine-tuning: net[0] is frozen
    model = Model(tuple(net.named_parameters()), tuple(net.named_buffers()))
    spec, routes = spec_of(opt, model)
    assert spec.names == ("1.weight", "1.bias")
    assert routes.names("replicated") == ["0.weight", "0.bias"]
    assert [b[0] for b in spec.buffers] == ["1.running_mean", "1.running_var",
                                            "1.num_batches_tracked"]
    assert spec.buffers[2][2] == torch.int64
    local, _ = spec_of(opt, model, buffers="local")
    assert local.buffers == ()


def test_spec_round_trips_and_refuses_another_version():
    spec, _ = spec_of(ema_decay=0.5)
    again = decode(encode(spec))
    assert again.names == spec.names and again.owners == spec.owners
    assert again.ema_decay == 0.5 and again.hyper == spec.hyper
    assert again.digest() == spec.digest()
    _, fields = pickle.loads(encode(spec))
    with pytest.raises(ValueError, match="every rank must run the same mpisync"):
        decode(pickle.dumps(("mpisync.spec/0", fields)))
    del fields["reduction"]
    with pytest.raises(ValueError, match=r"fields \['reduction'\]"):
        decode(pickle.dumps((SPEC_VERSION, fields)))


# -- agreement between workers ------------------------------------------------------------
def test_a_placement_that_differs_names_the_workers_and_the_first_parameter():
    spec, routes = spec_of(placement="round_robin")
    other, other_routes = spec_of(placement=lambda name, nbytes, loads: 1)
    mine = setup_summary(spec, routes)
    gathered = [(None, (), mine), (None, (), mine), (None, (), setup_summary(other, other_routes))]
    exc_type, text = first_failure(gathered, (0, 1, 2))
    assert exc_type is ConfigError
    assert "worker 2 (rank 2)" in text and "worker 1 (rank 1)" not in text
    assert "placement of '0.weight' = ps 1 where worker 0 has ps 0" in text


def test_different_optimizers_or_hyper_parameters_are_named():
    net = torch.nn.Linear(3, 2)
    model = Model(tuple(net.named_parameters()))
    a = setup_summary(*spec_of(torch.optim.SGD(net.parameters(), lr=0.1), model))
    b = setup_summary(*spec_of(torch.optim.SGD(net.parameters(), lr=0.2), model))
    c = setup_summary(*spec_of(torch.optim.Adam(net.parameters(), lr=0.1), model))
    assert "'lr': 0.2" in first_difference(a, b) and "'lr': 0.1" in first_difference(a, b)
    assert "Adam" in first_difference(a, c)
    assert first_difference(a, a) is None


def test_model_differences_name_the_parameter():
    a = model_summary(Model((("w", torch.zeros(3, 2)),)))
    b = model_summary(Model((("w", torch.zeros(3, 3)),)))
    assert model_difference(a, b).startswith("parameter #0 = 'w' shape [3, 3] torch.float32 "
                                             "but worker 0 has 'w' shape [3, 2]")
    assert model_difference(a, a) is None
    gathered = [(None, a, {}), (None, b, {})]
    exc_type, text = first_failure(gathered, (0, 5))
    assert exc_type is ModelMismatchError
    assert text.startswith("worker 1 (rank 5) has parameter #0")
    errors = [(None, a, {}), ("num_tokens=1 is too few", a, {})]
    assert first_failure(errors, (0, 1)) == (ConfigError,
                                              "worker 1 (rank 1): num_tokens=1 is too few")


# -- tables and partitioning at set-up --------------------------------------------------------
@pytest.mark.parametrize("cls", [c for c in (getattr(torch.optim, "Adafactor", None),
                                             getattr(torch.optim, "Muon", None)) if c])
def test_an_optimizer_of_whole_tensors_refuses_shards(cls):
    import mpisync

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Linear(8, 3, bias=False))
    model = Model(tuple(net.named_parameters()))
    opt = cls(net.parameters(), lr=0.01)
    build_spec(opt, model, Options(), opt_id=0, num_workers=2, num_ps=2)   # whole: fine
    with pytest.raises(ValueError, match=rf"{cls.__name__} updates each tensor as a whole, "
                                         r"and parameter '0\.weight' would be split"):
        build_spec(opt, model, Options(partitioner=mpisync.fixed_size(2)), opt_id=0,
                   num_workers=2, num_ps=2)


@pytest.mark.parametrize("watched", [False, True], ids=["searched", "registered"])
def test_a_sparse_embedding_tied_to_a_linear_layer_is_still_found(watched):
    """Found among the live modules, or by the registration hook an open optimizer keeps."""
    from mpisync.protocol import holders
    from mpisync.protocol.tables import sparse_modules

    if watched:
        holders.watch()
    try:
        emb = torch.nn.Embedding(10, 4, sparse=True)
        out = torch.nn.Linear(4, 10)
        out.weight = emb.weight                       # weight tying, after the embedding
        assert (id(emb.weight) in holders._registered) == watched
        assert sparse_modules([emb.weight, out.bias]) == {id(emb.weight): emb}
        dense = torch.nn.Embedding(10, 4)
        assert sparse_modules([dense.weight]) == {}
    finally:
        if watched:
            holders.unwatch()
    assert not holders.watching() and not holders._registered


def test_a_module_whose_init_failed_does_not_stop_the_search():
    """A module whose ``__init__`` raised before ``Module.__init__`` ran has no
    ``_parameters``; while it lingers in memory (a traceback, a cycle) the search among
    the live modules passes it by and still finds the holders."""
    from mpisync.protocol import holders
    from mpisync.protocol.tables import sparse_modules

    class Broken(torch.nn.Sequential):
        def __init__(self):
            raise ValueError("a layer that cannot be built")

    try:
        Broken()
    except ValueError as exc:
        kept = exc                                    # its traceback keeps the module
    lingering = [o for o in kept.__traceback__.tb_next.tb_frame.f_locals.values()
                 if isinstance(o, Broken)]
    assert lingering and "_parameters" not in vars(lingering[0])
    emb = torch.nn.Embedding(10, 4, sparse=True)
    assert not holders.watching()                     # found by searching the live objects
    assert sparse_modules([emb.weight]) == {id(emb.weight): emb}


def test_workers_that_run_another_mpisync_are_named_at_set_up():
    from mpisync.protocol.compare import versions

    spec, routes = spec_of()
    mine = setup_summary(spec, routes)
    assert mine["mpisync"] == versions()
    theirs = dict(mine, mpisync="0.0.1 (wire format 1)")
    exc_type, text = first_failure([(None, (), mine), (None, (), theirs)], (0, 1))
    assert exc_type is ConfigError
    assert f"worker 1 has mpisync = 0.0.1 (wire format 1) where worker 0 has {versions()}" in text
