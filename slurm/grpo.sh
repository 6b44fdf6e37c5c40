#!/bin/bash
# GRPO with miles under Slurm: one SPMD job, one task per GPU (or one torchrun per node). No Ray.
#
#   sbatch slurm/grpo.sh                                  # the quickstart: builds a tiny model + data
#   MODEL_DIR=/models/Qwen3-4B PROMPT_DATA=/data/train.jsonl \
#   MILES_ARGS="--rollout-batch-size 32 --n-samples-per-prompt 8 --num-rollout 100" \
#     sbatch --nodes 2 slurm/grpo.sh --save /ckpt/run1     # extra train.py flags after the script
#
# Edit the #SBATCH defaults below for your site; command-line sbatch options override them. The defaults
# (8 tasks x 8 CPUs, 8 GPUs per node) need a 64-CPU, 8-GPU node: a job asking for more than a node has
# is not always refused, it can PEND FOREVER (squeue reason PartitionConfig or Resources). On a small or
# CPU-only cluster override tasks, CPUs and GPUs, and ask Slurm first with --test-only (starts nothing):
#   sbatch --test-only --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 slurm/grpo.sh
#   sbatch --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 slurm/grpo.sh   # e.g. one 2-core node
#   squeue --me -o "%i %T %r"           # why a job is pending; scancel <jobid> drops it
# Submit from the miles checkout (or set MILES_HOME): its .venv (from `make setup`/`make demo`) is used when
# there is one, so nothing needs to be activated.
#SBATCH --job-name=miles-grpo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=miles-grpo-%j.out
#SBATCH --open-mode=append    # a requeued job (--requeue) keeps the first attempt's log
#
# Environment (all optional):
#   MODEL_DIR        local HF model directory            -> --hf-checkpoint (default: the quickstart's)
#   PROMPT_DATA      prompts (JSONL/Parquet)             -> --prompt-data   (default: the quickstart's)
#   MILES_ARGS       more train.py flags (a string); arguments after the script come last and win. No
#                    backend is named here: Miles's default, megatron (megatron-core); add
#                    --train-backend fsdp for FSDP2
#   LAUNCH           srun (one task per GPU, default) | torchrun (srun one torchrun agent per node)
#   GPUS_PER_NODE    ranks per node          [SLURM_NTASKS_PER_NODE, else SLURM_GPUS_ON_NODE, else 8]
#   ACTOR_GPUS       trainer GPUs            [half of all GPUs; all of them with COLOCATE=1]
#   ROLLOUT_GPUS     engine GPUs             [the rest; with COLOCATE=1 the trainer's]
#   GPUS_PER_ENGINE  GPUs per engine (TP)    [1]
#   COLOCATE=1       engines share the trainer's GPUs (--colocate)
#   ENTRY            what every rank runs    [train.py]; e.g. ENTRY="-m miles.spmd.smoke" checks the
#                    allocation (world, roles, collectives) in seconds
#   PYTHON           interpreter             [$MILES_HOME/.venv/bin/python if it exists, else python]
#   MILES_HOME       the miles checkout      [$SLURM_SUBMIT_DIR, else the submitted script's checkout]
#   QUICKSTART_DIR   where the quickstart model/data go [$MILES_HOME/outputs/quickstart]
#   QUICKSTART_MODEL start GRPO from this model instead of the quickstart's SFT warm start
#   MASTER_PORT      rendezvous port         [derived from the job id]
#   SRUN_ARGS        more srun options (a string), e.g. "--mpi=pmix" or "--container-image=..."
set -euo pipefail

# ---------------------------------------------------------------- the checkout and its python
fail() { echo "[grpo.sh] error: $*" >&2; exit 2; }
HOME_DIR=${MILES_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$HOME_DIR" 2>/dev/null || fail "cannot enter $HOME_DIR (MILES_HOME, else the submit directory)"
if [ ! -f train.py ] && [ -z "${MILES_HOME:-}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  # submitted from elsewhere (sbatch ~/miles/slurm/grpo.sh): sbatch ran a copy; find the original's checkout
  SUBMITTED=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* Command=\([^ ]*\).*/\1/p' || true)
  if [ -n "$SUBMITTED" ] && [ -f "$(dirname "$SUBMITTED")/../train.py" ]; then cd "$(dirname "$SUBMITTED")/.."; fi
fi
[ -f train.py ] || fail "$PWD is not a miles checkout (no train.py): run sbatch from the checkout or set MILES_HOME=/path/to/miles"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python; fi
fi
case "$PYTHON" in /*) ;; */*) PYTHON=$PWD/$PYTHON ;; esac  # relative to the checkout
# (run from / so that the checkout on sys.path does not hide a python without miles installed)
MISSING=$(cd / && "$PYTHON" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "miles") if u.find_spec(m) is None))' 2>&1) \
  || fail "PYTHON=$PYTHON does not run ($MISSING). Fix: make setup (creates $PWD/.venv), or set PYTHON=/path/to/python"
[ -z "$MISSING" ] || fail "PYTHON=$PYTHON cannot import: $MISSING. Fix: make setup (creates $PWD/.venv, used by default), activate the environment miles is installed in, or set PYTHON=/path/to/python"
ENTRY=${ENTRY:-train.py}
LAUNCH=${LAUNCH:-srun}
NNODES=${SLURM_NNODES:-1}
PER_NODE_TASKS=${SLURM_NTASKS_PER_NODE:-}
GPUS_PER_NODE=${GPUS_PER_NODE:-${PER_NODE_TASKS%%(*}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
TOTAL=$(( NNODES * GPUS_PER_NODE ))
GPUS_PER_ENGINE=${GPUS_PER_ENGINE:-1}
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- the role plan's flags
if [ "${COLOCATE:-0}" = 1 ]; then
  ACTOR_GPUS=${ACTOR_GPUS:-$TOTAL}
  ROLLOUT_GPUS=${ROLLOUT_GPUS:-$ACTOR_GPUS}
  PLAN=(--colocate)
else
  ACTOR_GPUS=${ACTOR_GPUS:-$(( TOTAL / 2 ))}
  ROLLOUT_GPUS=${ROLLOUT_GPUS:-$(( TOTAL - ACTOR_GPUS ))}
  PLAN=()
fi
if [ "$ACTOR_GPUS" -ge "$GPUS_PER_NODE" ] && [ $(( ACTOR_GPUS % GPUS_PER_NODE )) -eq 0 ]; then
  ACTOR_NODES=$(( ACTOR_GPUS / GPUS_PER_NODE )); ACTOR_PER_NODE=$GPUS_PER_NODE
else
  ACTOR_NODES=1; ACTOR_PER_NODE=$ACTOR_GPUS
fi
PLAN+=(--actor-num-nodes "$ACTOR_NODES" --actor-num-gpus-per-node "$ACTOR_PER_NODE"
       --rollout-num-gpus "$ROLLOUT_GPUS" --rollout-num-gpus-per-engine "$GPUS_PER_ENGINE"
       --num-gpus-per-node "$GPUS_PER_NODE")

# ---------------------------------------------------------------- model and data
DATA=()
case "$ENTRY" in
  train.py|train_async.py|*/train.py|*/train_async.py)
    if [ -z "${MODEL_DIR:-}" ] && [ -f examples/quickstart/prepare.sh ]; then
      QUICKSTART_DIR=${QUICKSTART_DIR:-$PWD/outputs/quickstart}
      echo "[grpo.sh] no MODEL_DIR: running the quickstart from $QUICKSTART_DIR" >&2
      [ -f "$QUICKSTART_DIR/model/config.json" ] || PYTHON="$PYTHON" bash examples/quickstart/prepare.sh "$QUICKSTART_DIR" >&2
      if [ -z "${QUICKSTART_MODEL:-}" ] && [ ! -f "$QUICKSTART_DIR/sft_model/config.json" ]; then
        # the SFT warm start (2 trainer ranks on this host, our own SFT path) that GRPO starts from
        echo "[grpo.sh] making the SFT warm start (examples/quickstart/run_sft.sh)" >&2
        QUICKSTART_DIR="$QUICKSTART_DIR" PYTHON="$PYTHON" bash examples/quickstart/run_sft.sh >&2
      fi
      if [ -f examples/quickstart/flags.sh ]; then
        read -r -a QS_FLAGS <<<"$(bash examples/quickstart/flags.sh "$QUICKSTART_DIR")"
        DATA+=("${QS_FLAGS[@]}")
      fi
    fi ;;
esac
[ -n "${MODEL_DIR:-}" ] && DATA+=(--hf-checkpoint "$MODEL_DIR")
[ -n "${PROMPT_DATA:-}" ] && DATA+=(--prompt-data "$PROMPT_DATA")
read -r -a EXTRA <<<"${MILES_ARGS:-}"
read -r -a ENTRY_WORDS <<<"$ENTRY"
read -r -a SRUN_MORE <<<"${SRUN_ARGS:-}"
ARGS=("${PLAN[@]}" "${DATA[@]}" "${EXTRA[@]}" "$@")

echo "[grpo.sh] job ${SLURM_JOB_ID:-?}: $NNODES node(s) x $GPUS_PER_NODE, trainer $ACTOR_GPUS, rollout $ROLLOUT_GPUS" \
     "(engines of $GPUS_PER_ENGINE), launch $LAUNCH, entry $ENTRY" >&2

# ---------------------------------------------------------------- launch
case "$LAUNCH" in
  srun)
    # one task per GPU; every rank reads SLURM_PROCID/NTASKS/LOCALID; rank 0 is on the first host
    exec srun --kill-on-bad-exit=1 --cpu-bind=none --ntasks-per-node="$GPUS_PER_NODE" --ntasks="$TOTAL" \
      "${SRUN_MORE[@]}" "$PYTHON" "${ENTRY_WORDS[@]}" "${ARGS[@]}" ;;
  torchrun)
    HEAD=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n1)
    RDZV_PORT=${RDZV_PORT:-$(( 20000 + ${SLURM_JOB_ID:-0} % 20000 ))}
    exec srun --kill-on-bad-exit=1 --cpu-bind=none --ntasks-per-node=1 --ntasks="$NNODES" "${SRUN_MORE[@]}" \
      "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
      --rdzv-backend c10d --rdzv-endpoint "$HEAD:$RDZV_PORT" --rdzv-id "${SLURM_JOB_ID:-miles}" \
      "${ENTRY_WORDS[@]}" "${ARGS[@]}" ;;
  *) echo "[grpo.sh] LAUNCH must be srun or torchrun, got '$LAUNCH'" >&2; exit 2 ;;
esac
