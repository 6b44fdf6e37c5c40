#!/usr/bin/env bash
# MPICH (Hydra's mpiexec; also Intel MPI): one rank per GPU, placed node by node.
#
#   NP=16 PER_NODE=8 HOSTS=node0,node1 launch/mpirun_mpich.sh --actor-num-gpus-per-node 8 --rollout-num-gpus 8
#
# NP        total ranks                            [PER_NODE]
# PER_NODE  ranks (= GPUs) per node                [visible GPUs, else 8]
# HOSTS     comma-separated hosts                  [this host only]
# MPIEXEC   Hydra's launcher                       [mpiexec.hydra, else mpiexec on PATH]
# MASTER_ADDR/MASTER_PORT  skip the mpi4py exchange
# ENTRY     what every rank runs                   [train.py]
#
# mpi4py must load MPICH's libmpi.so.12: miles points it there (next to $MPIEXEC) unless MPI4PY_LIBMPI
# is set. With PyPI's `mpich` wheel, install it into its own prefix
# (pip install --prefix /opt/mpich mpich) and put /opt/mpich/bin on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
PER_NODE=${PER_NODE:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 8)}
NP=${NP:-$PER_NODE}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec.hydra || command -v mpiexec)}
read -r -a ENTRY_WORDS <<<"${ENTRY:-train.py}"
ARGS=(-n "$NP" -ppn "$PER_NODE" -genvall)
[ -n "${HOSTS:-}" ] && ARGS+=(-hosts "$HOSTS")
exec "$MPIEXEC" "${ARGS[@]}" "${PYTHON:-python}" "${ENTRY_WORDS[@]}" --num-gpus-per-node "$PER_NODE" "$@"
