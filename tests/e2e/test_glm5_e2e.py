"""GLM-5 (DeepSeek sparse attention) end to end on CPU: Miles's recorded GLM-5 command (tests/fixtures/miles_scripts/
megatron_glm5.flags) with its model-shape flags scaled to a tiny GLM-5 (``miles.utils.tiny_dsa``) and its 8-GPU
world to 2 CPU ranks (TP 2 with sequence parallelism and EP 2, as its TP 4 / EP 8; colocated), the embedded engines
serving the model on the generic transformers path (transformers' GlmMoeDsaForCausalLM, its indexer included): 2
rollouts, a weight sync after each under ``--check-weight-update-equal`` (the engines hold exactly the trainer's
weights under HF names, the indexer's permutation undone), colocated (``tensor``, as recorded) and with one engine rank
of its own (``broadcast``: the DSA indexer's tensors, ``indexer.wq_b`` / ``wk`` / ``k_norm`` / ``weights_proj``, sent
in the broadcast buckets).

Left out of the recorded command: the GPU kernel flags (``--moe-grouped-gemm``, ``--moe-permute-fusion``: transformer-engine; ``--moe-enable-deepep``,
``--moe-token-dispatcher-type flex``: DeepEP) and the ``--sglang-*`` flags of SGLang's DSA serving, which the
embedded engine does not take.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import quickstart_data, run_two_rollouts, weight_sync_flags

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

TINY_SHAPE = [  # GLM-5's model flags (radixark/miles@v0.1.0:scripts/models/glm5-744B-A40B.py) at the tiny sizes
    "--moe-layer-freq", "[0]*1+[1]*2", "--num-experts", "4", "--moe-shared-expert-intermediate-size", "24",
    "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-router-score-function", "sigmoid",
    "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-aux-loss-coeff", "0", "--moe-router-dtype", "fp32", "--make-vocab-size-divisible-by", "16",
    "--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
    "--disable-bias-linear", "--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
    "--no-position-embedding", "--normalization", "RMSNorm", "--qk-layernorm", "--multi-latent-attention",
    "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12", "--v-head-dim", "10", "--kv-channels", "12",
    "--qk-pos-emb-head-dim", "8", "--vocab-size", "101", "--rotary-base", "1000000", "--enable-experimental",
    "--spec", "miles_plugins.models.glm5.glm5", "get_glm5_spec"]
RECORDED = [  # the rest of the recorded command, GPU counts scaled to 2 CPU ranks
    "--apply-chat-template", "--rollout-shuffle", "--rollout-temperature", "1", "--optimizer", "adam", "--lr", "1e-6",
    "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu", "16384", "--data-pad-size-multiplier", "4096", "--log-probs-chunk-size", "1024",
    "--rollout-num-gpus-per-engine", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--allgather-cp",
    "--update-weight-buffer-size", "2147483648", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
    "--rematerialize-param-from-master-weight"]  # + the weight-sync mode's flags (recorded: --colocate)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    d = tmp_path_factory.mktemp("glm5")
    return quickstart_data(d, quickstart_prepared), build_tiny_dsa_model(d / "glm5", routed_scaling_factor=2.5, rope_theta=1e6,
                                                    rms_norm_eps=1e-5)


@pytest.mark.parametrize("mode", ["tensor", "broadcast"])
def test_glm5_recorded_command_runs_two_rollouts(setup, tmp_path: Path, mode: str) -> None:
    data, model = setup
    flags, nproc = weight_sync_flags(mode, tmp_path)
    run_two_rollouts([*TINY_SHAPE, *RECORDED, *flags], model=model, data=data, tmp_path=tmp_path, nproc=nproc)
