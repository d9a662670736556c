#!/usr/bin/env bash
# Runs the whole test suite (installing what is missing first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
PY=$(scripts/setup_env.sh test)
exec "$PY" -m pytest tests "$@"
