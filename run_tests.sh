#!/usr/bin/env bash
# Runs the test suite (installing what is missing first). Extra arguments go to pytest: test paths
# run just those (without any, pyproject's testpaths: the whole suite), e.g. -m "not slow" the fast tier.
set -euo pipefail
cd "$(dirname "$0")"
PY=$(scripts/setup_env.sh test)
# Two test files at a time (TEST_WORKERS, pytest-xdist; 0 = in this process): a launched test spends
# much of its time starting processes and waiting on collectives, so one file alone keeps about one
# of two cores busy. A file's tests stay on one worker, which shares the file's launches among them.
# Files go out in collection order (tests/conftest.py puts the launching ones first), not xdist's
# order of most tests first, which left the files of a few long launches to the end, one worker
# running them while the other had nothing left.
exec "$PY" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
