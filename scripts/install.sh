#!/usr/bin/env bash
# Create .venv and install Elastron with its test dependencies. Safe to re-run (skips when up to date).
# torch is installed first with an exact pin: on a CPU machine that resolves to the local CPU wheel
# instead of a multi-GB CUDA download; on a GPU machine the same pin gives the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "install: Python >= 3.11 not found; install python3.11 and retry" >&2; exit 1; }
stamp="$VENV/.elastron-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
echo "installing into $VENV with $($PY --version) (torch==2.13.0 first, then the project) ..."
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[dev]'
touch "$stamp"
echo "installed: $("$VENV/bin/python" -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)')"
