#!/usr/bin/env bash
# Install everything into .venv and run the whole test suite (pure, multi-process gloo, Ray end-to-end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Debian chromium for the dashboard's browser test (playwright drives it; no browser download).
bash scripts/browser-deps.sh || echo "test.sh: browser deps unavailable; the dashboard test will be skipped" >&2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
