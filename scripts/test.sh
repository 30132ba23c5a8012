#!/usr/bin/env bash
# Set up, then run the whole check suite: ruff (lint + format), mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check src tests benchmarks scripts
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest -n "${LMPM_TEST_WORKERS:-2}" -q "$@"
