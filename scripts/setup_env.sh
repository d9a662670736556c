#!/usr/bin/env bash
# Prints the path of a Python interpreter that has Tessera's dependencies, installing them into
# ./.venv first when they are missing. Usage: scripts/setup_env.sh [extra,...]   (e.g. "test")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
modules="torch torchdata tensorboard safetensors sentencepiece tiktoken tokenizers matplotlib datasets pyarrow"
[ -n "$extras" ] && [[ ",$extras," == *",test,"* ]] && modules="$modules pytest xdist ruff transformers wandb torchao"

has_deps() {
  # Finds the modules without importing them: this runs before every launch.
  "$1" - "$modules" <<'PY' >/dev/null 2>&1
import importlib.metadata, importlib.util, sys
assert all(importlib.util.find_spec(name) for name in sys.argv[1].split())
assert importlib.metadata.version("torch").startswith("2.13.0")
PY
}

if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
  [ "$("$py" -c 'import sys; print(sys.version_info >= (3, 10))' 2>/dev/null)" = True ] ||
    { echo "error: PYTHON: '$py' is not a Python 3.10 or newer interpreter" >&2; exit 2; }
elif [ -x .venv/bin/python ]; then
  py=$PWD/.venv/bin/python
else
  py=$PWD/.venv/bin/python
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
