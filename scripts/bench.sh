#!/usr/bin/env bash
# Every benchmark's quick mode and one table: claim, goal, measured, pass/fail (see benchmarks/__main__.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m benchmarks "$@"
