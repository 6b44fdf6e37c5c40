#!/usr/bin/env bash
# The quickstart GRPO run under torchrun, disaggregated: ranks 0-1 train (the default backend, megatron; append
# --train-backend fsdp for FSDP2), ranks 2-3 each host an embedded engine. Builds the data and the SFT warm
# start first if they are missing.
#   bash examples/quickstart/run_grpo.sh [extra train.py flags...]      (QUICKSTART_DIR=outputs/quickstart)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${QUICKSTART_DIR:-outputs/quickstart}"
cd "$REPO"
[ -f "$DIR/sft_model/config.json" ] || QUICKSTART_DIR="$DIR" bash "$HERE/run_sft.sh"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck disable=SC2046
torchrun --standalone --nproc-per-node 4 train.py \
  --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 \
  --num-gpus-per-node 4 $(bash "$HERE/flags.sh" "$DIR") "$@"
