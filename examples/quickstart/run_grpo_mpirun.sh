#!/usr/bin/env bash
# The quickstart GRPO run under Open MPI's mpirun (same layout as run_grpo.sh: 2 trainers + 2 engines).
# The rendezvous address comes from MPI itself; --master-port picks the port.
#   bash examples/quickstart/run_grpo_mpirun.sh [extra train.py flags...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${QUICKSTART_DIR:-outputs/quickstart}"
PYTHON="${PYTHON:-python}"
cd "$REPO"
[ -f "$DIR/sft_model/config.json" ] || QUICKSTART_DIR="$DIR" bash "$HERE/run_sft.sh"
PORT="${MASTER_PORT:-$("$PYTHON" -c 'from miles.utils.net import find_free_port; print(find_free_port())')}"
MPI_ARGS=(-n 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 -x HF_HUB_OFFLINE=1 -x TOKENIZERS_PARALLELISM=false -x PATH)
[ "$(id -u)" = 0 ] && MPI_ARGS+=(--allow-run-as-root)
# shellcheck disable=SC2046
mpirun "${MPI_ARGS[@]}" "$PYTHON" train.py --master-port "$PORT" \
  --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 \
  --num-gpus-per-node 4 $(bash "$HERE/flags.sh" "$DIR") --run-name quickstart-grpo-mpirun "$@"
