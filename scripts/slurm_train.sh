#!/usr/bin/env bash
# Multi-node training under SLURM: one run_train.sh (one torchrun agent) per node, joined by
# torchrun's c10d rendezvous on the first node of the allocation.
#   sbatch --nodes 2 scripts/slurm_train.sh --training.steps 1000 --job.dump_folder /shared/run1
# Environment: NGPU (ranks per node), CONFIG_FILE, MAX_RESTARTS, RDZV_PORT (default 29500).
#SBATCH --job-name=tessera
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

fail() {
  echo "error: $1" >&2
  exit 2
}
# Outside an allocation there are no nodes to read (bash would end on an unbound variable, exit 1).
for variable in SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_JOB_NUM_NODES; do
  [ -n "${!variable:-}" ] ||
    fail "$variable is not set: submit this script with sbatch (./run_train.sh trains on this node alone)"
done
# Checked here, where it is set: run_train.sh would name RDZV_ENDPOINT, which the user did not set.
RDZV_PORT=${RDZV_PORT:-29500}
[[ "$RDZV_PORT" =~ ^[0-9]{1,5}$ ]] && ((10#$RDZV_PORT >= 1 && 10#$RDZV_PORT <= 65535)) ||
  fail "RDZV_PORT: '$RDZV_PORT' is not a port (1 to 65535)"

export NNODES=$SLURM_JOB_NUM_NODES
# One node needs no rendezvous: run_train.sh would warn that the endpoint goes unused.
if [ "$NNODES" -gt 1 ]; then
  # awk reads the whole list: `head -n 1` would exit early and, under pipefail, a long list would
  # end the script with SIGPIPE (141).
  head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
  export RDZV_ENDPOINT="$head_node:$RDZV_PORT"
  export RDZV_ID="tessera-$SLURM_JOB_ID"
fi

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
# sbatch runs a copy of this script from its spool folder, so Tessera's folder is the one the job
# was submitted from; elsewhere srun failed on every node to start ./run_train.sh.
[ -x run_train.sh ] ||
  fail "SLURM_SUBMIT_DIR: $PWD has no run_train.sh; submit the job from Tessera's folder (sbatch scripts/slurm_train.sh there)"
# One run_train.sh per node whatever sbatch was given (--ntasks-per-node 8, as Megatron's jobs ask,
# would start 8 agents per node against a rendezvous that waits for NNODES).
srun --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0 ./run_train.sh "$@"
