#!/usr/bin/env bash
# Installs what the browser test (tests/e2e/test_tensorboard_browser.py) needs, when it is missing:
# Chromium and its chromedriver (Debian packages, as root) and the selenium package for the
# interpreter. Does nothing when all three are there. Usage: scripts/install_browser.sh [python]
# (default: $PYTHON, else the interpreter scripts/setup_env.sh prints). Exits 1 with one line
# saying what to install when it cannot install it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-${PYTHON:-}}"
[ -n "$py" ] || py=$(scripts/setup_env.sh test)
chromium=/usr/bin/chromium
chromedriver=/usr/bin/chromedriver

has_driver() { "$py" -c "import selenium" >/dev/null 2>&1; }

if [ ! -x "$chromium" ] || [ ! -x "$chromedriver" ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: $chromium or $chromedriver is missing; install them as root: apt-get install -y chromium chromium-driver" >&2
    exit 1
  fi
  echo "installing chromium and chromium-driver (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -q && apt-get install -y -q chromium chromium-driver; } >&2 || {
    echo "error: apt-get could not install chromium chromium-driver (see above)" >&2
    exit 1
  }
fi

if ! has_driver; then
  echo "installing selenium into $("$py" -c 'import sys; print(sys.prefix)')" >&2
  "$py" -m pip install --quiet "selenium>=4.11" >&2 || true
  has_driver || { echo "error: the selenium package is missing in $py; install it: $py -m pip install selenium" >&2; exit 1; }
fi
