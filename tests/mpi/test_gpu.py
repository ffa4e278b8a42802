"""Workers on a CUDA GPU, the ps ranks on the CPU (marked ``gpu``: skipped without CUDA).

Two workers share one GPU (``CUDA_VISIBLE_DEVICES=0``) with one ps rank: their training
equals one process on the GPU with both batches together (SGD with momentum, Adam), with
and without a backup worker; a model split over the CPU and the GPU; ``mpisync.Embedding``
on a GPU worker; ``dense="allreduce"`` over NCCL with a GPU per worker, through host
memory where they share one, and NCCL on a shared GPU refused; a parameter moved after
set-up refused;
the digits example reaching its accuracy line. CI has no GPU: there each test is skipped
with the reason (``pytest -ra`` prints it).
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from mpi_helpers import SCRIPTS, run_mpi

sys.path.insert(0, str(SCRIPTS))
import gpu_train
from tables import BY_NAME, GPU_CASES, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")]

ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}    # several workers share it
TOLERANCE = 1e-5


def single(tmp_path, workers: int, *args) -> dict:
    out = tmp_path / "single.pt"
    gpu_train.single(gpu_train.parse(["--single", str(workers), "--dump", str(out),
                                      *map(str, args)]))
    return torch.load(out)


def distributed(tmp_path, workers: int, *args):
    out = tmp_path / "dist.pt"
    run = run_mpi("gpu_train.py", workers, 1, ["--dump", out, *args], env=ONE_GPU,
                  timeout=240)
    return torch.load(out), run


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("opt, shared_memory", [("sgd", "1"), ("adam", "1"),
                                                ("adam", "0")])
def test_two_workers_on_one_gpu_equal_one_process_on_the_gpu(tmp_path, opt, shared_memory):
    # shared memory off (0): the buckets go over MPI, sent from backward's hooks, which CUDA
    # runs on autograd's device thread
    out = tmp_path / "dist.pt"
    run = run_mpi("gpu_train.py", 2, 1, ["--dump", out, "--opt", opt],
                  env=dict(ONE_GPU, MPISYNC_SHARED_MEMORY=shared_memory), timeout=240)
    got = torch.load(out)
    assert max_diff(got, single(tmp_path, 2, "--opt", opt)) <= TOLERANCE
    workers = run.by_worker()
    assert {w["global_step"] for w in workers.values()} == {12}
    assert {w["devices"] == ["cuda:0"] for w in workers.values()} == {True}
    assert {(w["staged"], w["pinned"]) for w in workers.values()} == {(4, True)}
    assert len({w["checksum"] for w in workers.values()}) == 1


def test_a_backup_worker_on_the_gpu_equals_the_replayed_steps(tmp_path):
    got, run = distributed(tmp_path, 3, "--opt", "adam", "--backup")
    (ps,) = run.ps()
    taken = [r["taken"] for r in ps["stats"]["per_step"] if r["step"] < 12]
    assert len(taken) == 12 and all(len(t) == 2 for t in taken)
    assert ps["stats"]["gradients_dropped"] >= 1          # the slow one was left behind
    want = single(tmp_path, 3, "--opt", "adam", "--replay", json.dumps(taken))
    assert max_diff(got, want) <= TOLERANCE


def test_a_model_split_over_the_cpu_and_the_gpu(tmp_path):
    got, run = distributed(tmp_path, 2, "--opt", "adam", "--split")
    assert max_diff(got, single(tmp_path, 2, "--opt", "adam", "--split")) <= TOLERANCE
    assert {tuple(w["devices"]) for w in run.by_worker().values()} == {("cpu", "cuda:0")}


def test_dense_allreduce_on_a_shared_gpu_averages_through_host_memory(tmp_path):
    # NCCL refuses two ranks on one device: "auto" takes MPI where workers share a GPU
    got, run = distributed(tmp_path, 2, "--opt", "sgd", "--dense", "allreduce")
    assert max_diff(got, single(tmp_path, 2, "--opt", "sgd")) <= TOLERANCE
    assert {w["backend"] for w in run.by_worker().values()} == {"_MpiReducer"}


def test_dense_allreduce_with_a_gpu_per_worker_averages_over_nccl(tmp_path):
    workers = min(2, torch.cuda.device_count())      # one worker where the machine has one
    out = tmp_path / "dist.pt"
    run = run_mpi("gpu_train.py", workers, 1, ["--dump", out, "--opt", "sgd", "--dense",
                                               "allreduce"],
                  env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(workers)))},
                  timeout=240)
    assert max_diff(torch.load(out), single(tmp_path, workers, "--opt", "sgd")) <= TOLERANCE
    assert {w["backend"] for w in run.by_worker().values()} == {"_NcclReducer"}


def test_nccl_on_a_shared_gpu_is_refused_on_every_worker():
    run = run_mpi("gpu_train.py", 2, 1, ["--dense", "allreduce", "--backend", "nccl"],
                  env=ONE_GPU, timeout=180)
    assert sorted(run.by_worker()) == [0, 1], run.describe()
    for w, record in run.by_worker().items():
        assert record["collective"] is True, record
        assert record["error"].startswith(f"worker {w} (rank {w}"), record
        assert "worker 0 (rank 0): allreduce_backend='nccl' needs a GPU of its own for " \
            "each worker, but workers 0 and 1 share GPU" in record["error"], record
        assert "leave allreduce_backend='auto'" in record["error"], record


def test_a_parameter_moved_off_its_gpu_after_set_up_is_refused_on_every_worker():
    run = run_mpi("gpu_train.py", 2, 1, ["--move"], env=ONE_GPU, timeout=180)
    assert sorted(run.by_worker()) == [0, 1], run.describe()
    for w, record in run.by_worker().items():
        assert record["error"].startswith(f"worker {w} (rank {w}"), record
        assert "moved from cuda:0 to cpu after the SyncReplicasOptimizer was created" \
            in record["error"], record


def test_embedding_rows_come_to_the_gpu_worker():
    run = run_mpi("tables.py", 3, 2, [c.name for c in GPU_CASES], env=ONE_GPU, timeout=300)
    by_case = run.by_case()
    for case in GPU_CASES:
        ref = reference(BY_NAME[case.name])
        assert sorted(by_case[case.name]) == [0, 1, 2], (case.name, run.describe())
        for w, got in by_case[case.name].items():
            diff = (torch.tensor(got["table"]) - torch.tensor(ref["table"])).abs().max().item()
            assert diff <= TOLERANCE, (case.name, w, diff)
            for a, b in zip(got["head"], ref["head"]):
                assert (torch.tensor(a) - torch.tensor(b)).abs().max().item() <= TOLERANCE


def test_the_digits_example_reaches_its_accuracy_on_the_gpu():
    from test_example import check_digits, run_example
    check_digits(run_example("digits.py", 300, env=ONE_GPU))
