#!/usr/bin/env bash
# Trains with torchrun. Environment:
#   NGPU          ranks per node (default: the accelerators, or 2 CPU processes)
#   CONFIG_FILE   default configs/debug_model.toml (of this folder; relative paths are read from the
#                 folder the script is started in)
#   LOG_RANK      ranks whose output is shown (default 0)
#   MAX_RESTARTS  times torchrun restarts the whole group after a rank dies (default 3); with
#                 checkpoint.enable each attempt resumes from the newest complete checkpoint
#   NNODES, RDZV_ENDPOINT (host:port of node 0), RDZV_ID   multi-node jobs (c10d rendezvous);
#                 NNODES=MIN:MAX an elastic job: when a node is lost it goes on with the nodes left
#                 (at least MIN), from the newest checkpoint at the same global batch (docs/checkpoints.md)
#   TORCHFT_LIGHTHOUSE  http://host:port of torchft's lighthouse, with fault_tolerance.enable (one
#                 run_train.sh per replica group: docs/fault-tolerance.md)
#   COMM_MODE     fake: a dry run in one process playing rank 0 of NNODES x NGPU ranks (fake process
#                 group and tensors: real model sizes, no memory), printing its peak memory
# Extra arguments are config overrides, e.g. NGPU=2 ./run_train.sh --training.steps 30
set -euo pipefail
# Paths the user gives (CONFIG_FILE, options) are read from where the script is started; its own
# files from its folder.
HERE=$(cd "$(dirname "$0")" && pwd)

fail() {
  echo "error: $1" >&2
  exit 2
}
check_log_rank() { # the ranks per node
  for rank in ${LOG_RANK//,/ }; do
    [ "$rank" -lt "$1" ] || fail "LOG_RANK: $rank is not a local rank of this node's $1 (0 to $(($1 - 1)))"
  done
}
CONFIG_FILE_GIVEN=${CONFIG_FILE:+yes}
CONFIG_FILE=${CONFIG_FILE:-$HERE/configs/debug_model.toml}
NNODES=${NNODES:-1}
[[ "$NNODES" =~ ^[0-9]+(:[0-9]+)?$ ]] || fail "NNODES: '$NNODES' is not a number of nodes"
MIN_NODES=$((10#${NNODES%:*})) MAX_NODES=$((10#${NNODES#*:}))
[ "$MIN_NODES" -ge 1 ] || fail "NNODES: '$NNODES': a job has 1 node or more"
[ "$MIN_NODES" -le "$MAX_NODES" ] || fail "NNODES: '$NNODES': MIN $MIN_NODES is above MAX $MAX_NODES"
[[ "${NGPU:-auto}" =~ ^([1-9][0-9]*|auto)$ ]] || fail "NGPU: '$NGPU' is not a number of ranks per node"
[[ "${MAX_RESTARTS:-3}" =~ ^[0-9]+$ ]] || fail "MAX_RESTARTS: '$MAX_RESTARTS' is not a number of restarts"
LOG_RANK=${LOG_RANK:-0}
[[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "LOG_RANK: '$LOG_RANK' is not a list of local ranks (e.g. 0,1)"
# OpenMP ignores a value it cannot read (a line per rank) and takes every core, as many ranks at once.
[[ "${OMP_NUM_THREADS:-1}" =~ ^[1-9][0-9,]*$ ]] || fail "OMP_NUM_THREADS: '$OMP_NUM_THREADS' is not a number of threads"
[ "${COMM_MODE:-}" = fake_backend ] && COMM_MODE=fake # torchtitan's name for it
[[ "${COMM_MODE:-fake}" = fake ]] || fail "COMM_MODE: '$COMM_MODE' is not a mode; the one there is: fake (or fake_backend)"
if [ "${COMM_MODE:-}" = fake ]; then
  : # a dry run plays one rank of NNODES nodes (the most of a range): no rendezvous
elif [ "$MAX_NODES" -gt 1 ]; then
  [ -n "${RDZV_ENDPOINT:-}" ] || fail "RDZV_ENDPOINT: set it to host:port of the first node for a job of $NNODES nodes"
  # host[:port]; torchrun's agent fails on another with a traceback, and restarts.
  [[ "$RDZV_ENDPOINT" =~ ^([^:]+|\[.+\])(:[0-9]+)?$ ]] ||
    fail "RDZV_ENDPOINT: '$RDZV_ENDPOINT' is not host:port of the first node (e.g. node0:29500)"
else
  for variable in RDZV_ENDPOINT RDZV_ID; do
    [ -z "${!variable:-}" ] ||
      echo "warning: $variable is set but NNODES is 1: a job of this node alone (set NNODES for more)" >&2
  done
fi
PY=$("$HERE/scripts/setup_env.sh")
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
# CONFIG_FILE only when the command line names no config file: two typed there are a warning that
# the last is read, which CONFIG_FILE ahead of them would give every such command line.
CONFIG_ARGS=(--job.config_file "$CONFIG_FILE")
for arg in "$@"; do
  if [ "$arg" = --help ] || [ "$arg" = -h ]; then
    # The environment this script reads (the comment above), then every config option.
    sed -n '2,/^# Extra arguments/s/^# \{0,1\}//p' "$0"
    echo
    exec "$PY" "$HERE/train.py" --help
  fi
  if [[ "$arg" == --job.config[_-]file* ]]; then
    if [ -n "$CONFIG_FILE_GIVEN" ]; then
      echo "warning: CONFIG_FILE=$CONFIG_FILE is not read: --job.config_file on the command line wins" >&2
      CONFIG_FILE_GIVEN=
    fi
    CONFIG_ARGS=()
  fi
done
# Named here: the check would name --job.config_file, which the user did not type.
if [ -n "$CONFIG_FILE_GIVEN" ]; then
  [ ! -d "$CONFIG_FILE" ] || fail "CONFIG_FILE: $CONFIG_FILE is a folder, not a TOML file"
  [ -f "$CONFIG_FILE" ] || fail "CONFIG_FILE: $CONFIG_FILE: no such file"
fi

if [ "${COMM_MODE:-}" = fake ]; then
  # A dry run ends as the real run would, LOG_RANK included. It checks the config as the real
  # launch would, in its one process.
  if [ "$LOG_RANK" != 0 ]; then # the default needs no count; else count NGPU=auto as the launch would
    check_log_rank "${NGPU:-$("$PY" -c 'from programs.preflight import launch_sizes; print(launch_sizes({"--nnodes": "1"})[1])')}"
  fi
  exec "$PY" -m programs.dry_run --nnodes "$MAX_NODES" --nproc-per-node "${NGPU:-auto}" \
    ${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"} "$@"
fi
# Catch configuration mistakes in one process, before starting all of them; it also tells the
# ranks per node (NGPU, else one per accelerator, else 2 CPU processes) and whether on accelerators.
LAUNCH=$("$PY" -m programs.preflight --nnodes "$NNODES" --nproc-per-node "${NGPU:-auto}" \
  ${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"} "$@")
read -r NGPU ON_ACCELERATORS ESTIMATE_MEMORY <<<"$LAUNCH"
check_log_rank "$NGPU"
if [ "$ESTIMATE_MEMORY" -eq 1 ]; then
  # memory_estimation.enable (torchtitan's): the dry run's estimate of this job, then the training.
  "$PY" -m programs.dry_run --nnodes "$MAX_NODES" --nproc-per-node "$NGPU" ${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"} "$@"
fi
if [ "$ON_ACCELERATORS" -eq 0 ]; then
  # One thread per rank: several multi-threaded ranks on the same cores thrash.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

if [ "$MAX_NODES" -gt 1 ]; then
  RENDEZVOUS=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-tessera}")
else
  RENDEZVOUS=(--standalone)
fi

# exec: a signal sent to the script (a scheduler's SIGTERM) reaches torchrun's agent, which stops the
# ranks; the launcher also reports a mistake a rank found that no restart can mend, once.
exec "$PY" -m programs.launch "${RENDEZVOUS[@]}" --nproc-per-node="$NGPU" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  "$HERE/train.py" ${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"} "$@"
