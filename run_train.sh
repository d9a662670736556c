#!/usr/bin/env bash
# Trains with torchrun. Environment:
#   NGPU          ranks per node (default: the accelerators, or 2 CPU processes)
#   CONFIG_FILE   default configs/debug_model.toml
#   LOG_RANK      ranks whose output is shown (default 0)
#   MAX_RESTARTS  times torchrun restarts the whole group after a rank dies (default 3); with
#                 checkpoint.enable each attempt resumes from the newest complete checkpoint
#   NNODES, RDZV_ENDPOINT (host:port of node 0), RDZV_ID   multi-node jobs (c10d rendezvous)
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

NNODES=${NNODES:-1}
# Catch configuration mistakes in one process, before starting all of them.
"$PY" -m trainer.preflight --world-size "$((NGPU * NNODES))" --job.config_file "$CONFIG_FILE" "$@"

if [ "$NNODES" -gt 1 ]; then
  : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the first node for a multi-node job}"
  RENDEZVOUS=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-tessera}")
else
  RENDEZVOUS=(--standalone)
fi

exec "$PY" -m torch.distributed.run "${RENDEZVOUS[@]}" --nproc-per-node="$NGPU" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"
