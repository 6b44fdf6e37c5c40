#!/usr/bin/env bash
# Echo the quickstart's GRPO flags (Miles flag names), for `train.py $(bash flags.sh)`.
#   bash examples/quickstart/flags.sh [DIR] [MODEL]
# DIR: what prepare.sh built (default outputs/quickstart); MODEL: the policy to start from (default
# DIR/sft_model, the SFT warm start of run_sft.sh). Hyper-parameters come from prototype_grpo.py (README), the
# optimizer's in full (constant LR, no weight decay), so both backends train the same recipe: no backend is
# named, so it is Miles's default, megatron; append --train-backend fsdp for FSDP2.
DIR="${1:-${QUICKSTART_DIR:-outputs/quickstart}}"
MODEL="${2:-${QUICKSTART_MODEL:-$DIR/sft_model}}"
if [ -z "${2:-}${QUICKSTART_MODEL:-}" ] && [ ! -f "$MODEL/config.json" ]; then
  echo "flags.sh: no SFT warm start in $MODEL (run run_sft.sh); starting GRPO from $DIR/model" >&2
  MODEL="$DIR/model"
fi
echo --hf-checkpoint "$MODEL" \
  --prompt-data "$DIR/train.jsonl" --input-key input --label-key label --rollout-shuffle \
  --rm-type quickstart \
  --num-rollout "${NUM_ROLLOUT:-40}" --rollout-batch-size 16 --n-samples-per-prompt 8 --global-batch-size 128 \
  --rollout-max-response-len 4 --rollout-temperature 0.7 \
  --advantage-estimator grpo --lr 1e-3 --lr-decay-style constant --adam-beta2 0.98 --weight-decay 0.0 \
  --clip-grad 1.0 \
  --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --eval-prompt-data quickstart "$DIR/eval.jsonl" --eval-interval 10 --eval-temperature 0 \
  --engine-max-running-requests 128 \
  --sglang-router-policy round_robin --use-tensorboard --run-name quickstart-grpo
