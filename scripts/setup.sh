#!/usr/bin/env bash
# Create .venv (if missing) and install LMPM with the pinned CPU torch. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned here (the library itself only asks for a range): 2.13.0 is the local CPU build.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev,ray,hf]" 2>&1 | { grep -v "^WARNING: Location" || true; }
