#!/usr/bin/env bash
# The GPU check (issue 24): the example on cuda with nccl, a stop/resume round
# trip compared bitwise, and async blocking with pinned-memory staging against a
# bare device-to-host copy; one table. Under 5 minutes on one GPU.
#   bench/gpu_check.sh          # on a machine with CUDA GPUs
#   bench/gpu_check.sh --dry    # on the CPU with gloo, tiny (the test suite runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_check.py "$@"
