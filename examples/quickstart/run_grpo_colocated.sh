#!/usr/bin/env bash
# The quickstart GRPO run under torchrun, colocated: 2 ranks train (the default backend, megatron) and each
# also hosts an embedded engine on its own device (weights hand over in place: --update-weight-transfer-mode
# tensor).
#   bash examples/quickstart/run_grpo_colocated.sh [extra train.py flags...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${QUICKSTART_DIR:-outputs/quickstart}"
cd "$REPO"
[ -f "$DIR/sft_model/config.json" ] || QUICKSTART_DIR="$DIR" bash "$HERE/run_sft.sh"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck disable=SC2046
torchrun --standalone --nproc-per-node 2 train.py \
  --colocate --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus-per-engine 1 \
  --num-gpus-per-node 2 $(bash "$HERE/flags.sh" "$DIR") --run-name quickstart-grpo-colocated "$@"
