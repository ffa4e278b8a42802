#!/usr/bin/env bash
# The GPU tests and the GPU benchmark on a machine with a CUDA GPU, offline:
#
#     bash benchmarks/gpu_check.sh [WHEELS] [OUT]
#
# PYTHON (default python3) must have a CUDA build of torch, numpy, scikit-learn and pytest.
# MPI comes from the wheels in WHEELS (default .whl; `pip download mpi4py mpich` for that
# Python elsewhere when the machine has no package index). A virtualenv in /tmp gets them,
# sees PYTHON's packages and this checkout, and runs `pytest -m gpu tests/mpi/test_gpu.py`
# and `benchmarks/gpu_bench.py --gpus 1`. OUT (default $OUT, else gpu-check) receives
# pytest.log, bench.log, gpu_bench.json and env.txt.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
wheels=$(cd "${1:-.whl}" && pwd)
out=${2:-${OUT:-gpu-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
venv=${MPISYNC_GPU_VENV:-/tmp/mpisync-gpu-venv}

"$py" -m venv "$venv" || exit 1
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl || exit 1
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# PYTHON's own packages (torch with CUDA) after the venv's, then this checkout
"$py" -c "import site; print('\n'.join(site.getsitepackages()))" >"$site/base.pth"
echo "$here" >"$site/mpisync-checkout.pth"
vpy=$venv/bin/python
cd "$here" || exit 1

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$vpy" -c "import torch, mpi4py, numpy, sklearn; from mpi4py import MPI
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.device_count())
print('mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0])
print('numpy', numpy.__version__, 'sklearn', sklearn.__version__)" 2>&1
    nproc
    # can two ranks share one GPU in an NCCL group? (NCCL refuses duplicate devices)
    timeout 90 "$venv/bin/mpiexec" -n 2 "$vpy" -c "import torch
from mpi4py import MPI
from mpisync.worker.devices import nccl_group
dev = torch.device('cuda', 0); torch.cuda.set_device(dev)
nccl_group(MPI.COMM_WORLD, dev)
t = torch.ones(4, device=dev); torch.distributed.all_reduce(t); torch.cuda.synchronize()
print('rank', MPI.COMM_WORLD.Get_rank(), 'nccl on one shared GPU:', t.tolist())" 2>&1 | tail -5
} | tee "$out/env.txt"

export PYTHONUNBUFFERED=1
status=0
timeout "${PYTEST_TIMEOUT:-330}" "$vpy" -m pytest -m gpu tests/mpi/test_gpu.py -v -ra ${PYTEST_ARGS:-} \
    -p no:cacheprovider -p no:xdist --timeout 240 2>&1 | tee "$out/pytest.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "${BENCH_TIMEOUT:-240}" "$vpy" benchmarks/gpu_bench.py --gpus 1 \
    --json-out "$out/gpu_bench.json" 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
