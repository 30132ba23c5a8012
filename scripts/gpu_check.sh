#!/usr/bin/env bash
# One prepared GPU check (docs/gpu.md): the test suite with the GPU-marked tests, every example on
# CUDA against the CPU, `lmpm check --device cuda`, the benchmarks' GPU cases; one report in --out.
#   scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--download-wheels DIR] [--dry-run] [--budget S]
# The interpreter: $PYTHON, else the project's .venv, else python3 (a GPU image with PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
exec "$py" -u scripts/gpu_check.py "$@"
