#!/usr/bin/env bash
# The GPU check (docs/performance.md#gpu-check): bench/gpu_check.py under $PYTHON, else python3,
# with the repository on PYTHONPATH. Usage: scripts/gpu_check.sh [--rehearse] [--out DIR] ... (--help)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$repo/bench/gpu_check.py" "$@"
