#!/usr/bin/env bash
# Launch an mpisync job on WORKERS + PS MPI ranks (see docs/guides/launching.md).
#
# Usage:
#   launch/mpirun.sh --workers 4 --ps 2 [--hosts a:3,b:3] [--timeout 600] -- python train.py
#
# PYTHON picks the interpreter (default python3; e.g. PYTHON=.venv/bin/python). The
# mpiexec command line is built and printed by mpisync.launch.
exec "${PYTHON:-python3}" -m mpisync.launch "$@"
