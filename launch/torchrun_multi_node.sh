#!/usr/bin/env bash
# Several nodes: run this once on every node (same arguments), torchrun's c10d rendezvous joins them.
#
#   # on each of 2 nodes:
#   NNODES=2 RDZV_HOST=node0 NPROC=8 launch/torchrun_multi_node.sh \
#       --actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 [train.py flags]
#
# NNODES     nodes in the job                                      [required]
# RDZV_HOST  a host every node reaches (usually the first node)    [required]
# RDZV_PORT  its rendezvous port                                   [29400]
# RUN_ID     the same on every node, different per job            [miles-$RDZV_HOST-$RDZV_PORT]
# NPROC      ranks (= GPUs) per node                               [visible GPUs, else 8]
# NODE_RANK  honoured only with RDZV_BACKEND=static (c10d numbers nodes as they join)
# ENTRY      what every rank runs                                  [train.py]
#
# Ranks are numbered node by node (node i holds ranks i*NPROC .. i*NPROC+NPROC-1) and the role plan
# places ranks in the same blocks (--num-gpus-per-node is set to NPROC), so an engine never
# straddles two nodes unless it is larger than one.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES (nodes in the job)}" "${RDZV_HOST:?set RDZV_HOST (e.g. the first node)}"
RDZV_PORT=${RDZV_PORT:-29400}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
NPROC=${NPROC:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 8)}
BACKEND=${RDZV_BACKEND:-c10d}
read -r -a ENTRY_WORDS <<<"${ENTRY:-train.py}"
RDZV=(--rdzv-backend "$BACKEND" --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "${RUN_ID:-miles-$RDZV_HOST-$RDZV_PORT}")
[ "$BACKEND" = static ] && RDZV=(--node-rank "${NODE_RANK:?static rendezvous needs NODE_RANK}" --master-addr "$RDZV_HOST" --master-port "$RDZV_PORT")
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" "${RDZV[@]}" \
  "${ENTRY_WORDS[@]}" --num-gpus-per-node "$NPROC" "$@"
