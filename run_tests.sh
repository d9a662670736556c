#!/usr/bin/env bash
# Runs the test suite (installing what is missing first). Extra arguments go to pytest: test paths
# run just those (without any, pyproject's testpaths: the whole suite), e.g. -m "not slow" the fast tier.
set -euo pipefail
cd "$(dirname "$0")"
PY=$(scripts/setup_env.sh test)
exec "$PY" -m pytest "$@"
