#!/usr/bin/env bash
# Trains with torchrun. Environment: NGPU (ranks; default = accelerators, or 2 CPU processes),
# CONFIG_FILE (default configs/debug_model.toml), LOG_RANK (ranks whose output is shown, default 0).
# Extra arguments are config overrides, e.g. NGPU=2 ./run_train.sh --training.steps 30
set -euo pipefail
cd "$(dirname "$0")"
PY=$(scripts/setup_env.sh)

CONFIG_FILE=${CONFIG_FILE:-configs/debug_model.toml}
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PY" -c "import torch; print(torch.accelerator.device_count() if torch.accelerator.is_available() else 0)")
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.accelerator.is_available() else 1)"; then
  # One thread per rank: several multi-threaded ranks on the same cores thrash.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# Catch configuration mistakes in one process, before starting NGPU of them.
"$PY" -m trainer.preflight --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@"

exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NGPU" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"
