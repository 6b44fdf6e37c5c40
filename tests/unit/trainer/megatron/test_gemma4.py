"""Gemma 4 on the Megatron backend without ranks: the shapes of gemma-4-31B-it's and gemma-4-26B-A4B-it's config.json,
Miles's recorded Gemma 4 flags checked against them, the multimodal checkpoint's names (the MoE block's and the
replicated KV heads' included) through the shared converter, one line for what is not built. Parity with
transformers and FSDP: tests/multiprocess/test_megatron_gemma4.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import convert, options
from miles.trainer.megatron.families import gemma4

pytest.importorskip("megatron.core")

MODELS = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models"
GEMMA_JSON = MODELS / "gemma-4-31B-it.json"
MOE_JSON = MODELS / "gemma-4-26B-A4B-it.json"
SCRIPT = [  # the model flags of Miles's recorded 31B command (tests/fixtures/miles_scripts/megatron_gemma_4_31b.flags)
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "32", "--num-query-groups", "16",
    "--kv-channels", "256", "--num-layers", "60", "--hidden-size", "5376", "--ffn-hidden-size", "21504",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-06", "--position-embedding-type", "rope", "--rotary-base",
    "1000000", "--vocab-size", "262144", "--max-position-embeddings", "262144", "--tensor-model-parallel-size", "4",
    "--sequence-parallel", "--qkv-format", "bshd", "--attention-backend", "unfused"]


MOE_SCRIPT = [  # the model and parallel flags of Miles's recorded 26B-A4B command (megatron_gemma_4_26b_a4b.flags)
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "16", "--num-query-groups", "8",
    "--kv-channels", "256", "--num-layers", "30", "--hidden-size", "2816", "--ffn-hidden-size", "2112",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-06", "--position-embedding-type", "rope", "--rotary-base",
    "1000000", "--vocab-size", "262144", "--max-position-embeddings", "262144", "--num-experts", "128",
    "--moe-router-topk", "8", "--moe-ffn-hidden-size", "704", "--moe-router-score-function", "softmax",
    "--moe-router-dtype", "fp32", "--moe-router-num-groups", "1", "--moe-router-group-topk", "1",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-bias-update-rate", "0", "--moe-aux-loss-coeff",
    "0", "--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-model-parallel-size", "8",
    "--expert-tensor-parallel-size", "1", "--qkv-format", "bshd", "--attention-backend", "unfused"]


def _real() -> dict:
    return json.loads(GEMMA_JSON.read_text())


def _moe() -> dict:
    return json.loads(MOE_JSON.read_text())


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _shape(config: dict):
    from transformers import AutoConfig

    d = copy.deepcopy(config)
    return options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d))


def test_shape_of_gemma_4_31b() -> None:
    shape = _shape(_real())
    g = shape.variant
    assert (shape.num_layers, shape.hidden_size, shape.num_query_groups, shape.kv_channels) == (60, 5376, 16, 256)
    assert shape.tie_embeddings and shape.qk_layernorm and shape.final_logit_softcapping == 30.0
    assert (g.global_head_dim, g.global_kv_heads, g.k_eq_v, g.sliding_window) == (512, 4, True, 1024)
    assert g.sliding_layers == (1, 1, 1, 1, 1, 0) * 10 and g.multimodal
    assert shape.family.text_prefix(shape) == "model.language_model." and shape.family.bridge_only


def test_shape_of_gemma_4_26b_a4b() -> None:
    shape = _shape(_moe())
    g = shape.variant
    assert (shape.num_layers, shape.hidden_size, shape.ffn_hidden_size, shape.num_query_groups) == (30, 2816, 2112, 8)
    assert (shape.num_experts, shape.moe_router_topk, shape.moe_ffn_hidden_size) == (128, 8, 704)
    assert shape.moe_layer_pattern == (1,) * 30 and shape.moe_norm_topk_prob and shape.moe_shared_ffn_hidden_size == 0
    assert (g.global_head_dim, g.global_kv_heads, g.k_eq_v) == (512, 2, True)
    assert gemma4.kv_replicated(g, 4) and not gemma4.kv_replicated(g, 2)     # Miles's TP 4 over 2 KV heads
    kw = gemma4.config_kwargs(shape)        # the dense MLP is megatron-core's ungated shared expert
    assert kw["moe_shared_expert_intermediate_size"] == 2112 and kw["moe_shared_expert_gate"] is False


def test_recorded_26b_flags_accepted(tiny_model_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_model_dir, *MOE_SCRIPT), _moe())


def test_recorded_flags_accepted(tiny_model_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT), _real())
    # Megatron-LM's window flags, when given, as config.json says (5 sliding layers, then a full one)
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT, "--window-size", "1023,0", "--window-attn-skip-freq", "6"),
                            _real())


@pytest.mark.parametrize("extra, message", [
    (["--swiglu"], "--swiglu does not match --hf-checkpoint's config.json (Gemma 4's hidden_activation"),
    (["--window-size", "511,0"], "--window-size 511,0 does not match --hf-checkpoint's config.json (sliding_window "
                                 "1024)"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq 2 does not match --hf-checkpoint's config.json "
                                       "(layer_types (1: sliding_attention) [1, 1, 1, 1, 1, 0"),
    (["--softmax-type", "learnable"], "--softmax-type learnable does not match --hf-checkpoint's config.json"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2 with Gemma 4"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2 with Gemma 4"),
])
def test_flags_refused_in_one_line(tiny_model_dir: Path, extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_model_dir, *SCRIPT, *extra), _real())
    assert str(ei.value).startswith(message) and "\n" not in str(ei.value), ei.value


def _tp(script: list[str], tp: int) -> list[str]:
    return [f if script[i - 1] != "--tensor-model-parallel-size" else str(tp) for i, f in enumerate(script)]


def test_tp_divides_or_is_a_multiple_of_the_full_layers_kv_heads(tiny_model_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_model_dir, *_tp(SCRIPT, 8)), _real())     # 4 KV heads, each on 2 TP ranks
    real = _real()
    real["text_config"]["num_global_key_value_heads"] = 3
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size 2 neither divides nor is a multiple of "
                                          r"config.json's num_global_key_value_heads 3"):
        options.preflight_check(_cfg(tiny_model_dir, *_tp(SCRIPT, 2)), real)


@pytest.mark.parametrize("key, value, what", [
    ("hidden_size_per_layer_input", 256, "per-layer embeddings"),
    ("num_kv_shared_layers", 4, "KV sharing"),
])
def test_unbuilt_parts_are_one_line(tiny_model_dir: Path, key: str, value, what: str) -> None:
    real = _real()
    real["text_config"][key] = value
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_model_dir), real)
    msg = str(ei.value)
    assert msg.startswith(f"--hf-checkpoint: Gemma 4 with {key} ") and what in msg and "\n" not in msg, msg
    assert "--train-backend fsdp" in msg


def test_multimodal_names_through_the_shared_converter(tmp_path: Path) -> None:
    """The text decoder is loaded from model.language_model.* (the towers left out) and exported back under it."""
    from transformers import AutoConfig

    from miles.utils.tiny_gemma4 import build_tiny_gemma4

    model = build_tiny_gemma4(tmp_path / "g4")
    shape = options.shape_of(AutoConfig.from_pretrained(model))
    hf = convert.read_hf_state_dict(model)
    text = convert.text_state(hf, shape)
    assert all(k.startswith("model.") and not k.startswith(("model.language_model.", "model.vision_tower.",
                                                            "model.embed_vision.")) for k in text)
    pairs = convert.megatron_to_hf("decoder.layers.2.self_attention.linear_qkv.weight",
                                   convert.hf_to_megatron(hf, shape, 128, [
                                       "decoder.layers.2.self_attention.linear_qkv.weight"]).popitem()[1], shape)
    assert [n for n, _ in pairs] == ["model.language_model.layers.2.self_attn.q_proj.weight",
                                     "model.language_model.layers.2.self_attn.k_proj.weight"]   # full layer: K=V
    assert all(torch.equal(t, hf[n]) for n, t in pairs)
    assert gemma4.text_prefix(shape) == "model.language_model."


def test_moe_block_and_replicated_kv_names_round_trip_bitwise(tmp_path: Path) -> None:
    """Every megatron name of a tiny Gemma 4 MoE layer (router, experts, the dense MLP as shared expert, the block's
    norms) and a full layer's q / replicated KV weights (TP above its KV heads) from the checkpoint and back: the
    experts' slices joined into the fused tensors again, every tensor equal to the checkpoint's bit for bit."""
    from transformers import AutoConfig

    from miles.utils.tiny_gemma4 import build_tiny_gemma4

    model = build_tiny_gemma4(tmp_path / "g4m", moe=True)
    shape = options.shape_of(AutoConfig.from_pretrained(model))
    hf = convert.read_hf_state_dict(model)
    layer = "decoder.layers.2."                 # a full-attention layer
    names = [layer + n for n in (
        "mlp.router.weight", "mlp.router.scale", "mlp.router.per_expert_scale", "mlp.pre_dense_norm.weight",
        "mlp.pre_experts_norm.weight", "mlp.post_experts_norm.weight", "mlp.post_norm.weight",
        "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_experts.linear_fc2.post_norm.weight", "self_attention.linear_q.weight",
        "self_attention.linear_kv.weight", *[f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4)
                                             for i in (1, 2)])]
    full = convert.hf_to_megatron(hf, shape, 128, names)
    assert full[layer + "mlp.experts.local_experts.3.linear_fc1.weight"].shape == (64, 64)     # [gate; up] of 32
    assert full[layer + "self_attention.linear_kv.weight"].shape == (2 * 16, 64)          # 2 KV heads of 16, K=V
    pieces = [pair for n in names for pair in convert.megatron_to_hf(n, full[n], shape)]
    back = dict(pair for bucket in gemma4.FAMILY.export_stream(iter([pieces[:9], pieces[9:]]), shape)
                for pair in bucket)
    p = "model.language_model.layers.2."
    assert sorted(back) == sorted(p + n for n in (
        "router.proj.weight", "router.scale", "router.per_expert_scale", "pre_feedforward_layernorm.weight",
        "pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_2.weight",
        "post_feedforward_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_feedforward_layernorm_1.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "experts.gate_up_proj", "experts.down_proj"))
    assert all(torch.equal(t, hf[n]) for n, t in back.items())
    for name in (layer + "self_attention.linear_q.weight", layer + "mlp.shared_experts.linear_fc1.weight"):
        assert convert.partition_dim(name) == 0                    # split over TP (q by heads; the GLU by halves)
    assert convert.partition_dim(layer + "self_attention.linear_kv.weight") is None       # on every TP rank
