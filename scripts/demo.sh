#!/usr/bin/env bash
# Install everything into .venv and run the main job: `elastron demo` on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/elastron demo "$@"
