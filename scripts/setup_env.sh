#!/usr/bin/env bash
# Prints the path of a Python interpreter that has Tessera's dependencies, installing them into
# ./.venv first when they are missing. Usage: scripts/setup_env.sh [extra,...]   (e.g. "test")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
modules="torch torchdata tensorboard safetensors sentencepiece tiktoken tokenizers matplotlib datasets pyarrow"
[ -n "$extras" ] && [[ ",$extras," == *",test,"* ]] && modules="$modules pytest xdist ruff transformers wandb torchao torchft lm_eval accelerate"
[ -n "$extras" ] && [[ ",$extras," == *",ft,"* ]] && modules="$modules torchft"

# The torch releases pyproject.toml accepts, e.g. torch>=2.11,<2.14: any installed one is kept.
torch_range=$(grep -o '"torch>=[0-9.]*,<[0-9.]*"' pyproject.toml | tr -d '"')
# What is installed when no torch in that range is: the newest release tested.
torch_default=2.13.0

torch_in_range() {
  "$1" - "$torch_range" <<'PY' >/dev/null 2>&1
import importlib.metadata, re, sys
def release(version):
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version)[0].split("."))
low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", sys.argv[1]).groups()
assert release(low) <= release(importlib.metadata.version("torch")) < release(high)
PY
}

has_deps() {
  # Finds the modules without importing them: this runs before every launch.
  torch_in_range "$1" && "$1" - "$modules" <<'PY' >/dev/null 2>&1
import importlib.util, sys
assert all(importlib.util.find_spec(name) for name in sys.argv[1].split())
PY
}

torch_version() {
  "$1" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null
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
  installed=$(torch_version "$py") || true
  if [ -n "$installed" ] && ! torch_in_range "$py"; then
    # Another program's torch is not ours to replace; ./.venv's is.
    [ -z "${PYTHON:-}" ] ||
      { echo "error: PYTHON: $py has torch $installed; Tessera needs $torch_range (or leave PYTHON unset for ./.venv)" >&2; exit 2; }
    installed=
  fi
  prefix=$("$py" -c 'import sys; print(sys.prefix)')
  "$py" -m pip install --quiet --upgrade pip >&2 || true
  if [ -n "$installed" ]; then
    echo "installing dependencies into $prefix (keeping its torch $installed)" >&2
  else
    echo "installing dependencies into $prefix (torch $torch_default)" >&2
    "$py" -m pip install --quiet "torch==$torch_default" >&2
  fi
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  "$py" -m pip install --quiet -e "$spec" >&2
  has_deps "$py" || { echo "error: dependencies are still missing after installing into $py" >&2; exit 1; }
fi
echo "$py"
