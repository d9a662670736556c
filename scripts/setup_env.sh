#!/usr/bin/env bash
# Prints the path of a Python interpreter that has Tessera's dependencies, installing them into
# ./.venv first when they are missing. Usage: scripts/setup_env.sh [extra,...]   (e.g. "test")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
modules="torch torchdata tensorboard safetensors sentencepiece tiktoken matplotlib"
[ -n "$extras" ] && [[ ",$extras," == *",test,"* ]] && modules="$modules pytest ruff"

has_deps() {
  "$1" - "$modules" <<'PY' >/dev/null 2>&1
import importlib, sys
for name in sys.argv[1].split():
    importlib.import_module(name)
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
PY
}

if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=.venv/bin/python
  echo "creating .venv" >&2
  python3 -m venv .venv >&2
fi

if ! has_deps "$py"; then
  echo "installing dependencies into $("$py" -c 'import sys; print(sys.prefix)') (torch pinned to 2.13.0)" >&2
  "$py" -m pip install --quiet --upgrade pip >&2 || true
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  "$py" -m pip install --quiet -e "$spec" >&2
  has_deps "$py" || { echo "error: dependencies are still missing after installing into $py" >&2; exit 1; }
fi
echo "$py"
