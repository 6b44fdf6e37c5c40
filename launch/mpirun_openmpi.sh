#!/usr/bin/env bash
# Open MPI: one rank per GPU, placed node by node. MPI only starts the ranks and (through mpi4py)
# shares rank 0's address; collectives run on NCCL/gloo over TCP.
#
#   NP=16 PER_NODE=8 HOSTFILE=hosts.txt launch/mpirun_openmpi.sh --actor-num-gpus-per-node 8 --rollout-num-gpus 8
#
# NP        total ranks                            [PER_NODE]
# PER_NODE  ranks (= GPUs) per node                [visible GPUs, else 8]
# HOSTFILE  Open MPI hostfile ("node0 slots=8")    [none: this host only]
# MASTER_ADDR/MASTER_PORT  skip the mpi4py exchange (then mpi4py is not needed)
# MPIRUN_ARGS  more mpirun options (e.g. "--mca btl_tcp_if_include eth0")
# ENTRY     what every rank runs                   [train.py]
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
PER_NODE=${PER_NODE:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 8)}
NP=${NP:-$PER_NODE}
read -r -a ENTRY_WORDS <<<"${ENTRY:-train.py}"
read -r -a MORE <<<"${MPIRUN_ARGS:-}"
ARGS=(-n "$NP" --map-by "ppr:$PER_NODE:node" --bind-to none)
[ -n "${HOSTFILE:-}" ] && ARGS+=(--hostfile "$HOSTFILE")
[ "$(id -u)" -eq 0 ] && ARGS+=(--allow-run-as-root)
# forward the environment every rank needs (Open MPI passes nothing by default to remote nodes)
for v in PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV HF_HOME HF_HUB_OFFLINE CUDA_VISIBLE_DEVICES NCCL_DEBUG \
         NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME MASTER_ADDR MASTER_PORT MPI4PY_LIBMPI WANDB_MODE OMP_NUM_THREADS; do
  [ -n "${!v:-}" ] && ARGS+=(-x "$v")
done
exec mpirun "${ARGS[@]}" "${MORE[@]}" "${PYTHON:-python}" "${ENTRY_WORDS[@]}" \
  --num-gpus-per-node "$PER_NODE" "$@"
