#!/usr/bin/env sh
# What the browser test needs, installed only where missing (seconds when both are present):
# Debian's chromium from apt (never a browser download) and Playwright's Python client from PyPI.
set -eu
PY=${1:-.venv/bin/python}
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    # the package lists may be stale on a fresh machine: update only when the install fails
    $SUDO apt-get install -y -q chromium || { $SUDO apt-get update -q && $SUDO apt-get install -y -q chromium; }
fi
"$PY" -c "import playwright" 2>/dev/null ||
    "$PY" -m pip install --quiet --disable-pip-version-check "playwright>=1.45"
