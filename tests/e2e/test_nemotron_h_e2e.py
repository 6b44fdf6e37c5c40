"""Nemotron-3 (Nemotron-H) end to end on CPU: Miles's recorded Nemotron-3 Ultra command (radixark/miles@v0.1.0:
tests/snapshots/launch_scripts/py/scripts/run_nemotron_3_ultra_550b_a55b.py/train.txt) with its model-shape flags at
the tiny Nemotron-H's sizes (``miles.utils.tiny_nemotron``: pattern ``ME*-E``, Mamba-2, attention without position
embedding, squared-ReLU MLP, latent MoE, its routed scaling 5.0 as Ultra's) and its 8-GPU world at 2 CPU trainer ranks
(TP 2 with sequence parallelism and EP 2, where Ultra runs TP 1 / EP 8), the embedded engines serving it on the
generic transformers path (each request's Mamba conv / SSM state in its own cache): 2 rollouts with a weight sync
after each under ``--check-weight-update-equal`` (every tensor the trainer exports equals the engine's, under HF's
``backbone.*`` names), in each weight-sync mode: ``tensor`` (colocated, as recorded), ``broadcast``, ``p2p`` and
``disk-delta`` (one engine rank of its own).

What is changed besides sizes, and why: the data and reward are the quickstart's (a random tiny policy never solves a
dapo-math prompt); ``--moe-grouped-gemm`` needs transformer-engine, absent on CPU (refused there by name:
``tests/unit/trainer/megatron/test_nemotron_h.py::test_recorded_ultra_command_dry_run``); ``--sglang-ep-size``,
``--sglang-dp-size``, ``--sglang-enable-dp-attention`` and ``--sglang-mem-fraction-static`` are SGLang's serving flags,
which the embedded engine does not take; ``--ref-load`` is left out (``--kl-loss-coef 0`` without ``--use-kl-loss``:
no reference model), and so are ``--save`` (the checkpoint round trip is tested in
``tests/multiprocess/test_megatron_nemotron_h.py``), the wandb flags and ``--dump-details``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import WEIGHT_SYNC_MODES, quickstart_data, run_two_rollouts, weight_sync_flags
from miles_fixtures import replay_params

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1200)]

TINY_SHAPE = [  # Ultra's model flags (radixark/miles@v0.1.0:scripts/models/nemotron-3-ultra-550b-a55b-4layer.py) at tiny size
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--kv-channels", "16", "--num-layers", "5", "--hidden-size", "64", "--ffn-hidden-size", "48", "--normalization",
    "RMSNorm", "--position-embedding-type", "none", "--vocab-size", "101", "--make-vocab-size-divisible-by", "128",
    "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
    "32", "--moe-shared-expert-intermediate-size", "48", "--moe-latent-size", "32", "--moe-router-score-function",
    "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32", "--moe-router-num-groups", "1",
    "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "5.0", "--moe-router-pre-softmax",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-bias-update-rate", "0", "--moe-aux-loss-coeff",
    "0"]
RECORDED = [  # the rest of the recorded command, GPU counts scaled to 2 trainer ranks
    "--megatron-to-hf-mode", "bridge", "--apply-chat-template", "--rollout-shuffle", "--rollout-temperature", "1",
    "--balance-data", "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer", "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type",
    "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024", "--log-probs-chunk-size", "128",
    "--rollout-num-gpus-per-engine", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "auto",
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    d = tmp_path_factory.mktemp("nemotron_h")
    return quickstart_data(d, quickstart_prepared), build_tiny_nemotron_model(d / "nemotron", routed_scaling_factor=5.0)


# `make test` runs the recorded colocated mode; the other modes run under `make test-replay` (the other families'
# e2e tests carry each mode in `make test`: docs/benchmarks.md, "The CPU suite")
@pytest.mark.parametrize("mode", replay_params(WEIGHT_SYNC_MODES, in_make_test=("tensor", "disk-delta")))
def test_nemotron_h_recorded_command_runs_two_rollouts(setup, tmp_path: Path, mode: str) -> None:
    data, model = setup
    flags, nproc = weight_sync_flags(mode, tmp_path)
    run_two_rollouts([*TINY_SHAPE, *RECORDED, *flags], model=model, data=data, tmp_path=tmp_path, nproc=nproc,
                     timeout=900)
