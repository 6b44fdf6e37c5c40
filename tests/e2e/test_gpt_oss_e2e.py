"""gpt-oss end to end on CPU: Miles's recorded gpt-oss-20b command (tests/fixtures/miles_scripts/
megatron_moe_gpt_oss_20b.flags) with its model-shape flags scaled to the tiny gpt-oss (``miles.utils.tiny_gpt_oss``)
and its 8-GPU world to 2 CPU ranks (TP 2 with sequence parallelism and EP 2, as its TP 8 / EP 8; colocated), the
embedded engines serving the model on the generic transformers path: 2 rollouts, a weight sync after each under
``--check-weight-update-equal`` (the engines hold exactly the trainer's weights, HF names and fused experts),
colocated (``tensor``, as recorded) and with one engine rank of its own (``p2p``: each trainer rank sends its dim-0
share of every tensor, the attention sinks, the biases and the fused experts' ``gate_up_proj`` / ``down_proj`` and
their biases among them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import quickstart_data, run_two_rollouts, weight_sync_flags
from miles_fixtures import without_absent_kernel_flags

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

TINY_SHAPE = [  # gpt-oss-20b's model flags (Miles's scripts/models/gpt-oss-20b.py), at the tiny model's sizes
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--use-rotary-position-embeddings",
    "--rotary-percent", "1.0", "--rotary-base", "150000", "--max-position-embeddings", "512", "--normalization",
    "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "101",
    "--softmax-type", "learnable", "--window-size", "4,0", "--window-attn-skip-freq", "2", "--no-masked-softmax-fusion",
    "--no-rope-fusion", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.0",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32", "--moe-grouped-gemm"]
RECORDED = [  # the rest of the recorded command, GPU counts scaled to 2 CPU ranks
    "--megatron-to-hf-mode", "bridge", "--apply-chat-template", "--rollout-shuffle", "--rollout-temperature", "1.0",
    "--num-steps-per-rollout", "1", "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", "--advantage-estimator", "grpo",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1", "--micro-batch-size", "1",
    "--rollout-num-gpus-per-engine", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--qkv-format", "bshd", "--attention-backend", "fused", "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", "2"]  # + the weight-sync mode's flags (recorded: --colocate)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_gpt_oss import build_tiny_gpt_oss_model

    d = tmp_path_factory.mktemp("gpt_oss")
    return quickstart_data(d, quickstart_prepared), build_tiny_gpt_oss_model(d / "gpt_oss")


@pytest.mark.parametrize("mode", ["tensor", "p2p"])
def test_gpt_oss_recorded_command_runs_two_rollouts(setup, tmp_path: Path, mode: str) -> None:
    data, model = setup
    flags, nproc = weight_sync_flags(mode, tmp_path)
    # --moe-grouped-gemm, --attention-backend fused need transformer-engine: dropped / auto where it does not import
    # (refused there by name)
    run_two_rollouts(without_absent_kernel_flags([*TINY_SHAPE, *RECORDED, *flags]), model=model, data=data,
                     tmp_path=tmp_path, nproc=nproc)
