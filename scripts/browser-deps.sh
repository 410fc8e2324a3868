#!/usr/bin/env bash
# Browser test dependencies: Debian's chromium (apt-get, if missing) and Playwright for Python in .venv.
# Playwright drives the system chromium through executable_path; `playwright install` (which downloads
# its own browser builds) is never run. Safe to re-run. Exits non-zero with one line saying what failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null 2>&1; then
    echo "browser-deps: chromium is missing and this user cannot run apt-get (not root, no sudo)" >&2; exit 1
  fi
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  echo "browser-deps: installing Debian chromium with apt-get ..."
  $SUDO apt-get update -qq || { echo "browser-deps: apt-get update failed" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null \
    || { echo "browser-deps: apt-get install chromium failed" >&2; exit 1; }
fi
if ! "$VENV/bin/python" -c 'import playwright' 2>/dev/null; then
  echo "browser-deps: pip-installing playwright into $VENV (no browser download) ..."
  "$VENV/bin/python" -m pip install -q 'playwright>=1.45' \
    || { echo "browser-deps: pip install playwright failed" >&2; exit 1; }
fi
echo "browser-deps: $(chromium --version 2>/dev/null | head -1), playwright $("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("playwright"))')"
