"""Gemma 4 on the Megatron backend without ranks: the shape of gemma-4-31B-it's config.json, Miles's recorded Gemma 4
flags checked against it, the multimodal checkpoint's names through the shared converter, one line for what is not
built. Parity with transformers and FSDP: tests/multiprocess/test_megatron_gemma4.py.
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

GEMMA_JSON = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models" / "gemma-4-31B-it.json"
SCRIPT = [  # the model flags of Miles's recorded 31B command (tests/fixtures/miles_scripts/megatron_gemma_4_31b.flags)
    "--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "32", "--num-query-groups", "16",
    "--kv-channels", "256", "--num-layers", "60", "--hidden-size", "5376", "--ffn-hidden-size", "21504",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-06", "--position-embedding-type", "rope", "--rotary-base",
    "1000000", "--vocab-size", "262144", "--max-position-embeddings", "262144", "--tensor-model-parallel-size", "4",
    "--sequence-parallel", "--qkv-format", "bshd", "--attention-backend", "unfused"]


def _real() -> dict:
    return json.loads(GEMMA_JSON.read_text())


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


def test_tp_must_divide_the_full_layers_kv_heads(tiny_model_dir: Path) -> None:
    flags = [f if f != "4" or SCRIPT[i - 1] != "--tensor-model-parallel-size" else "8" for i, f in enumerate(SCRIPT)]
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size 8 does not divide config.json's "
                                          r"num_global_key_value_heads 4"):
        options.preflight_check(_cfg(tiny_model_dir, *flags), _real())


@pytest.mark.parametrize("key, value, what", [
    ("enable_moe_block", True, "the MoE block (26B-A4B)"),
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
