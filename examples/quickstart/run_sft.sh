#!/usr/bin/env bash
# The SFT warm start (our own SFT path, --loss-type sft_loss) on 2 trainer ranks, no engines; the default
# backend (megatron, as in Miles), or append --train-backend fsdp.
# It imitates a buggy teacher (20% right, 80% off by one), so the model ends clearly imperfect.
#   bash examples/quickstart/run_sft.sh [extra train.py flags...]   (QUICKSTART_DIR, default outputs/quickstart)
# writes $QUICKSTART_DIR/sft_model (a HF dir); metrics and logs in $QUICKSTART_DIR/sft_run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${QUICKSTART_DIR:-outputs/quickstart}"
cd "$REPO"
[ -f "$DIR/model/config.json" ] || bash "$HERE/prepare.sh" "$DIR"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node 2 train.py \
  --debug-train-only --actor-num-nodes 1 --actor-num-gpus-per-node 2 --num-gpus-per-node 2 \
  --hf-checkpoint "$DIR/model" --loss-type sft_loss \
  --prompt-data "$DIR/sft.jsonl" --input-key input --label-key response --rollout-shuffle \
  --num-rollout 30 --rollout-batch-size 320 --global-batch-size 32 \
  --lr 3e-3 --lr-decay-style constant --adam-beta2 0.98 --weight-decay 0.0 --clip-grad 1.0 \
  --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --save "$DIR/sft_ckpt" --save-interval 1000 --keep-checkpoints 1 --no-save-optim --save-hf "$DIR/sft_model" \
  --output-dir "$DIR/sft_run" --run-name quickstart-sft --use-tensorboard "$@"
