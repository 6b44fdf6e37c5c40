#!/usr/bin/env bash
# One node, one rank per GPU, started by torchrun (its agent hosts the rendezvous store).
#
#   NPROC=8 launch/torchrun_single_node.sh --actor-num-gpus-per-node 4 --rollout-num-gpus 4 [train.py flags]
#   ENTRY="-m miles.spmd.smoke" NPROC=4 launch/torchrun_single_node.sh --colocate --actor-num-gpus-per-node 4
#
# NPROC   ranks (= GPUs) on this node          [number of visible GPUs, else 8]
# ENTRY   what every rank runs                 [train.py]  (train_async.py, "-m miles.spmd.smoke")
# PYTHON  interpreter                          [python]
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
NPROC=${NPROC:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 8)}
read -r -a ENTRY_WORDS <<<"${ENTRY:-train.py}"
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  "${ENTRY_WORDS[@]}" --num-gpus-per-node "$NPROC" "$@"
