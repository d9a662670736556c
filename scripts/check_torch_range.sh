#!/usr/bin/env bash
# Checks Tessera on the oldest torch it supports: builds a second environment with that torch from
# the package registry (its CUDA build, a few GiB, runs on CPUs too), installs Tessera into it,
# which must keep that torch, then runs the fast test tier, 2-rank parity launches and a
# ./run_train.sh. Ends with a table of what passed; exit 1 if anything failed.
#
#   scripts/check_torch_range.sh [--torch VERSION] [--env DIR] [--all]
#
#   --torch VERSION  the torch to check (default: the lowest pyproject.toml accepts, e.g. 2.11.0)
#   --env DIR        where the environment goes (default: .venv-torch-VERSION; reused when there)
#   --all            the whole test suite instead of the fast tier and the parity launches
set -euo pipefail
cd "$(dirname "$0")/.."
fail() {
  echo "error: $1" >&2
  exit 2
}
floor=$(grep -o '"torch>=[0-9.]*' pyproject.toml | cut -d'=' -f2)
version="$floor.0"
env_dir=
all=
while [ $# -gt 0 ]; do
  case "$1" in
  --torch) version=${2:?--torch needs a version, e.g. 2.11.0}; shift 2 ;;
  --env) env_dir=${2:?--env needs a folder}; shift 2 ;;
  --all) all=yes; shift ;;
  *) fail "$1: not an option of this script (--torch VERSION, --env DIR, --all)" ;;
  esac
done
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || fail "--torch: '$version' is not a release such as 2.11.0"
env_dir=${env_dir:-.venv-torch-$version}
py=$env_dir/bin/python

# 2-rank launches that compare against one process or another layout: FSDP2, DDP, SimpleFSDP with
# Inductor's bucketing, compiled TP, two pipeline schedules, bf16 TP, a restart from a checkpoint.
# (ZBVZeroBubble is refused on CPU ranks before torch 2.13, and its test skipped.)
PARITY=(
  "tests/distributed/test_dp_parity.py::test_losses_match[fsdp2-fsdp_2]"
  "tests/distributed/test_dp_parity.py::test_losses_match[fsdp2-ddp_2]"
  "tests/distributed/test_dp_parity.py::test_losses_match[simple_fsdp-fsdp_2]"
  "tests/distributed/test_compile.py::test_compiled_simple_fsdp[inductor-expected1]"
  "tests/distributed/test_compile_composition.py::test_compiled_matches_eager"
  "tests/distributed/test_pipeline.py::test_losses_match_single_process[1F1B]"
  "tests/distributed/test_pipeline.py::test_losses_match_single_process[Interleaved1F1B]"
  "tests/distributed/test_mixed_precision.py::test_bf16_losses_match_one_process[tp2]"
  "tests/distributed/test_fault_tolerance.py::test_killed_rank_restarts_from_the_last_checkpoint"
)

results=()
run_step() { # name, command...
  local name=$1 start=$SECONDS status=passed
  shift
  echo "== $name: $*"
  "$@" || status=FAILED
  results+=("$(printf '%-28s %-7s %5d s' "$name" "$status" $((SECONDS - start)))")
}

if [ ! -x "$py" ]; then
  python3 -m venv "$env_dir"
fi
installed=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ "${installed%%+*}" != "$version" ]; then
  echo "installing torch $version into $env_dir"
  "$py" -m pip install --quiet "torch==$version"
fi
# What a user with that torch does: install Tessera next to it. It must keep that torch.
run_step "install, keeping torch" env PYTHON="$py" scripts/setup_env.sh test
kept=$("$py" -c 'import torch; print(torch.__version__)')
[ "${kept%%+*}" = "$version" ] || results+=("torch $version was replaced by $kept: FAILED")

if [ -n "$all" ]; then
  run_step "whole suite" "$py" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider
else
  run_step "fast tier" "$py" -m pytest -q -n 2 --dist loadfile -m "not slow" -p no:cacheprovider
  run_step "2-rank parity launches" "$py" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "${PARITY[@]}"
fi
out=$(mktemp -d)
run_step "run_train.sh, 10 steps" env PYTHON="$py" ./run_train.sh --training.steps 10 --job.dump_folder "$out"
rm -rf "$out"

echo
echo "torch $kept ($env_dir), $(date -u +%Y-%m-%dT%H:%MZ)"
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q FAILED
