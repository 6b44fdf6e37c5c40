"""DeepSeek-V4 end to end on CPU: the flags of Miles's recorded DeepSeek-V4 command (radixark/miles@v0.1.0:
tests/snapshots/launch_scripts/py/scripts/run_deepseek_v4.py/train.txt) that miles takes today, its 8-GPU world
scaled to 2 CPU ranks (TP 2 with sequence parallelism and EP 2, as its TP 8 / EP 8; colocated), on the tiny V4
(``miles.utils.tiny_dsv4``), the embedded engines serving it on the generic transformers path: 2 rollouts, a weight
sync after each under ``--check-weight-update-equal`` (the engines hold exactly the trainer's weights: transformers'
names, fused experts, the hash routers' int64 tables), colocated (``tensor``, as recorded) and with one engine rank of
its own (``p2p``: each trainer rank sends its dim-0 share of every tensor, the int64 tables and the mHC tensors too).

The model is spelled out as the recorded command spells it, in Miles's Megatron fork's flags at the tiny model's
values (``fork_spelled_flags``: ``--multi-latent-attention`` with ``--kv-lora-rank`` as V4's head dim, the YaRN flags of
the compressed layers, ``--experimental-attention-variant dsv4``, ``--dsv4-*``, ``--dsa-indexer-*``,
``--activation-func-clamp-value``), with the recorded ``--no-activation-func-clamp-shared-expert`` (the trainer's and the
engines' shared experts unclamped), ``--moe-router-freeze-gate``, ``--freeze-e-score-correction-bias``,
``--no-bias-swiglu-fusion`` and ``--model-name deepseekv4``: every one checked against config.json by the dry run.

Left out (refused by name here): the FP8 training flags (``--fp8-format``, ``--fp8-recipe``,
``--te-precision-config-file``: not built), ``--moe-grouped-gemm`` and ``--transformer-impl transformer_engine``
(transformer-engine, not on a CPU box). ``--use-rollout-routing-replay`` runs as recorded: the engines return V4's
routed experts (its hash layers' too) and the trainer's 4 routers replay them.

``test_engine_serves_dsv4``: the embedded engine's greedy tokens (a prompt of 11 and 14 new tokens: past the sliding
window, several CSA windows and an HCA window, through V4's own cache layers) equal transformers' full forward's; with
``--no-activation-func-clamp-shared-expert``, those of transformers' model with its shared experts unclamped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _family_e2e import check_two_rollouts, quickstart_data, two_rollouts_cmd, weight_sync_flags
from _miles_e2e import check_ok, run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

RECORDED = [  # the recorded command's flags miles takes, GPU counts scaled to 2 CPU ranks
    "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
    "--swiglu", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--attention-softmax-in-fp32", "--no-rope-fusion", "--moe-router-topk", "2", "--moe-router-pre-softmax",
    "--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0", "--moe-router-topk-scaling-factor", "1.5", "--apply-chat-template",
    "--rollout-shuffle", "--rollout-temperature", "0.8", "--num-steps-per-rollout", "1", "--balance-data",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
    "--overlap-cpu-optimizer-d2h-h2d", "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--micro-batch-size", "1", "--rollout-num-gpus-per-engine", "1", "--accumulate-allreduce-grads-in-fp32",
    "--qkv-format", "bshd", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
    "--spec", "miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec",
    "--use-rollout-routing-replay"]  # + the weight-sync mode's flags (recorded: --colocate)


# the recorded command's flags of Miles's Megatron fork that name no shape
FORK_SWITCHES = ["--no-bias-swiglu-fusion", "--no-activation-func-clamp-shared-expert", "--moe-router-freeze-gate",
                 "--freeze-e-score-correction-bias", "--model-name", "deepseekv4"]


def fork_spelled_flags(model: Path) -> list[str]:
    """The recorded command's model flags (radixark/miles@v0.1.0:scripts/models/deepseek-v4-flash.py) at the values of
    the tiny model's config.json, as Miles's fork reads them for V4."""
    import json

    c = json.loads((model / "config.json").read_text())
    n, head, rope = c["num_hidden_layers"], c["head_dim"], int(c["head_dim"] * c["partial_rotary_factor"])
    rate = {"sliding_attention": 0, **c["compress_rates"]}
    yarn = c["rope_parameters"]["compress"]
    return [str(v) for v in (
        "--num-layers", n, "--hidden-size", c["hidden_size"], "--ffn-hidden-size", c["moe_intermediate_size"],
        "--num-attention-heads", c["num_attention_heads"], "--vocab-size", c["vocab_size"],
        "--multi-latent-attention", "--q-lora-rank", c["q_lora_rank"], "--kv-lora-rank", head, "--qk-head-dim", head,
        "--qk-pos-emb-head-dim", rope, "--v-head-dim", head, "--qk-layernorm",
        "--rotary-scaling-factor", yarn["factor"], "--rotary-base", c["rope_parameters"]["main"]["rope_theta"],
        "--original-max-position-embeddings", yarn["original_max_position_embeddings"],
        "--beta-fast", yarn["beta_fast"], "--beta-slow", yarn["beta_slow"],
        "--num-experts", c["n_routed_experts"], "--moe-layer-freq", "[" + ",".join("1" * n) + "]",
        "--moe-ffn-hidden-size", c["moe_intermediate_size"],
        "--moe-shared-expert-intermediate-size", c["moe_intermediate_size"] * c["n_shared_experts"],
        "--experimental-attention-variant", "dsv4", "--dsv4-hc-mult", c["hc_mult"],
        "--dsv4-hc-sinkhorn-iters", c["hc_sinkhorn_iters"], "--dsv4-compress-ratios",
        *(rate[t] for t in c["layer_types"]), "--dsv4-compress-rope-theta", c["compress_rope_theta"],
        "--dsv4-o-groups", c["o_groups"], "--dsv4-o-lora-rank", c["o_lora_rank"],
        "--dsv4-n-hash-layers", c["mlp_layer_types"].count("hash_moe"), "--dsv4-window-size", c["sliding_window"],
        "--dsa-indexer-n-heads", c["index_n_heads"], "--dsa-indexer-head-dim", c["index_head_dim"],
        "--dsa-indexer-topk", c["index_topk"], "--activation-func-clamp-value", c["swiglu_limit"])]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, quickstart_prepared: Path) -> tuple[Path, Path]:
    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    d = tmp_path_factory.mktemp("dsv4")
    return quickstart_data(d, quickstart_prepared), build_tiny_dsv4_model(d / "dsv4")


@pytest.mark.parametrize("unclamped", [False, True], ids=["as_transformers", "no_shared_expert_clamp"])
def test_engine_serves_dsv4(setup, unclamped: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from miles.engine.model_runner import unclamp_shared_experts
    from miles.engine.testing import EngineProc

    _, model = setup
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    eng = EngineProc(model, "--max-running-requests", "2",
                     *(["--no-activation-func-clamp-shared-expert"] if unclamped else []), timeout=180)
    try:
        got = eng.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 14, "temperature": 0}})
    finally:
        eng.stop()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if unclamped:
        assert unclamp_shared_experts(hf) == 4
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(14):
            seq = torch.cat([seq, hf(seq, use_cache=False).logits[0, -1].argmax().view(1, 1)], 1)
    assert got["output_ids"] == seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["tensor", "p2p"])
def test_dsv4_recorded_flags_run_two_rollouts(setup, tmp_path: Path, mode: str) -> None:
    data, model = setup
    flags, nproc = weight_sync_flags(mode, tmp_path)
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = two_rollouts_cmd([*RECORDED, *fork_spelled_flags(model), *FORK_SWITCHES, *flags], model=model, data=data,
                           out=out, nproc=nproc)
    dry = run([*cmd, "--dry-run"], tmp_path / "dry.log", timeout=300)
    check_ok(dry, tmp_path / "dry.log")
    check_ok(run(cmd, log, timeout=600, MILES_ENGINE_LOG_LEVEL="INFO"), log)   # INFO: the engines' unclamp line
    check_two_rollouts(out, log, nproc)
    text = log.read_text()
    assert "routing replay (R3, --use-rollout-routing-replay): 4 MoE routers" in text, text[-3000:]
    engines = [p.read_text() for p in sorted(out.rglob("engine*.log"))]     # the engines follow the trainer's flag
    assert engines and all("4 shared experts served unclamped" in t for t in engines), [t[-2000:] for t in engines]
