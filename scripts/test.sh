#!/usr/bin/env bash
# Install everything into .venv and run the whole test suite (pure, multi-process gloo, Ray end-to-end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -ra "$@"
