"""Qwen3-Next / Qwen3.5 on the Megatron backend without ranks: the shape of Qwen3-Next-80B's config.json and
megatron-core's config of it, the HF <-> Megatron conversion (bitwise round trip under TP, the DeltaNet's in_proj and
conv1d split per section), Miles's Qwen3-Next / Qwen3.5 model flags checked against config.json, one line for what is
not built. Parity with transformers: tests/multiprocess/test_megatron_qwen3_next.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _tp_round_trip import round_trip_under_tp

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, shard
from miles.trainer.megatron.model import ModelShape, padded_vocab_size

pytest.importorskip("megatron.core")

NEXT_JSON = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models" / \
    "Qwen3-Next-80B-A3B-Thinking.json"


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def tiny_hybrid_dir(request, tmp_path_factory) -> Path:
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    return build_tiny_qwen35_model(tmp_path_factory.mktemp(request.param), kind=request.param)


def _shape(config: dict) -> ModelShape:
    from transformers import AutoConfig

    d = dict(config)
    return options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d))


def test_shape_of_qwen3_next_80b_and_its_megatron_config() -> None:
    from miles.trainer.megatron import moe
    from miles.trainer.megatron.model import transformer_config

    shape = _shape(json.loads(NEXT_JSON.read_text()))
    assert (shape.num_layers, shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads,
            shape.num_query_groups, shape.kv_channels, shape.num_experts, shape.moe_router_topk,
            shape.moe_ffn_hidden_size, shape.moe_shared_ffn_hidden_size) == (48, 2048, 5120, 16, 2, 256, 512, 10,
                                                                             512, 512)
    assert shape.qk_layernorm and shape.rotary_percent == 0.25 and shape.nextn_layers == 1
    h = shape.variant
    assert h.linear_layers == (1, 1, 1, 0) * 12 and h.fused_qkvz and h.shared_expert_gate
    assert (h.key_heads, h.value_heads, h.key_head_dim, h.value_head_dim, h.conv_kernel) == (16, 32, 128, 128, 4)
    config = transformer_config(shape, tp_size=2, device=torch.device("cpu"),
                                moe=moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False))
    assert config.attention_output_gate and config.moe_shared_expert_gate
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_conv_kernel_dim) == (16, 32, 128, 4)
    assert config.moe_shared_expert_intermediate_size == 512 and not config.moe_router_pre_softmax


def test_layer_types_read_from_config_json(tiny_hybrid_dir: Path) -> None:
    """``layer_types`` wins over ``full_attention_interval``; a type the family does not build is one line."""
    c = json.loads((tiny_hybrid_dir / "config.json").read_text())
    c["layer_types"] = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    assert _shape(c).variant.linear_layers == (0, 1, 0, 1)
    c["layer_types"][1] = "sliding_attention"
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .*layer_types \['sliding_attention'\] not supported"):
        _shape(c)


def _megatron_names(shape: ModelShape) -> list[str]:
    """megatron-core's parameter names (local spec, EP 1) of a tiny hybrid model."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.router.weight",
                                  "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
                                  "mlp.shared_experts.gate_weight")]
        if shape.variant.linear_layers[i]:
            names += [p + "self_attention." + n for n in ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias",
                                                          "out_norm.weight", "out_proj.weight")]
        else:
            names += [p + "self_attention." + n for n in ("linear_qkv.weight", "linear_proj.weight",
                                                          "q_layernorm.weight", "k_layernorm.weight")]
        names += [f"{p}mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(shape.num_experts)
                  for k in (1, 2)]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bitwise_under_tp(tiny_hybrid_dir: Path, tp: int) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(tiny_hybrid_dir / "model.safetensors"))
    shape = _shape(json.loads((tiny_hybrid_dir / "config.json").read_text()))
    full = round_trip_under_tp(hf, shape, _megatron_names(shape), tp)
    # rank r's in_proj: the r-th half of each of q, k, v, z, beta, alpha (megatron-core's GatedDeltaNet layout)
    h = shape.variant
    in_proj = full["decoder.layers.0.self_attention.in_proj.weight"]
    sections = [h.qk_dim, h.qk_dim, h.v_dim, h.v_dim, h.value_heads, h.value_heads]
    mine = shard("decoder.layers.0.self_attention.in_proj.weight", in_proj, 0, tp - 1, tp, shape)
    assert torch.equal(mine, torch.cat([part.chunk(tp)[-1] for part in in_proj.split(sections)]))
    if not h.fused_qkvz:                          # Qwen3.5: [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]
        a = "model.layers.0.linear_attn."
        assert torch.equal(in_proj, torch.cat([hf[a + "in_proj_qkv.weight"], hf[a + "in_proj_z.weight"],
                                               hf[a + "in_proj_b.weight"], hf[a + "in_proj_a.weight"]]))


# ------------------------------------------------------------------------------------------- flags
SCRIPT = [  # the model flags of Miles's scripts/models/qwen3-next-80B-A3B.py (tests/snapshots/model_args), no --spec
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "16",
    "--num-query-groups", "2", "--kv-channels", "256", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "5120", "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type",
    "rope", "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "10000000", "--moe-ffn-hidden-size", "512",
    "--moe-shared-expert-intermediate-size", "512", "--moe-router-score-function", "softmax",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "10", "--moe-layer-freq", "[1]*48",
    "--num-experts", "512", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff",
    "0", "--attention-output-gate", "--moe-shared-expert-gate", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1"]


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _without(flags: list[str], name: str) -> list[str]:
    out = list(flags)
    i = out.index(name)
    del out[i:i + 1 + (i + 1 < len(out) and not out[i + 1].startswith("--"))]
    return out


def _refusal(model: Path, flags: list[str], config: dict) -> str:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(model, *flags), config)
    assert "\n" not in str(ei.value), ei.value
    return str(ei.value)


def test_qwen3_next_80b_flags_accepted(tiny_model_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT), json.loads(NEXT_JSON.read_text()))


@pytest.mark.parametrize("flag, message", [
    ("--apply-layernorm-1p", "--apply-layernorm-1p is missing but --hf-checkpoint's config.json is Qwen3-Next"),
    ("--attention-output-gate", "--attention-output-gate is missing but --hf-checkpoint's config.json is Qwen3-Next"),
    ("--moe-shared-expert-gate", "--moe-shared-expert-gate is missing"),
])
def test_qwen3_next_switches_required_with_the_shape_flags(tiny_model_dir: Path, flag: str, message: str) -> None:
    assert _refusal(tiny_model_dir, _without(SCRIPT, flag), json.loads(NEXT_JSON.read_text())).startswith(message)


def test_hybrid_flags_refused_on_another_family(tiny_model_dir: Path) -> None:
    qwen3 = json.loads((tiny_model_dir / "config.json").read_text())
    for flag in ("--attention-output-gate", "--apply-layernorm-1p", "--moe-shared-expert-gate"):
        msg = _refusal(tiny_model_dir, [flag], qwen3)
        assert msg.startswith(f"{flag} does not match --hf-checkpoint's config.json (model_type qwen3"), msg
    msg = _refusal(tiny_model_dir, ["--rotary-percent", "0.25"], qwen3)
    assert msg.startswith("--rotary-percent 0.25 does not match --hf-checkpoint's config.json "
                          "(partial_rotary_factor 1.0)"), msg


def test_mtp_layer_is_built_like_the_last_decoder_layer(tiny_model_dir: Path) -> None:
    """``--mtp-num-layers 1`` (Miles's Qwen3.5 / Qwen3-Next commands): built when the decoder's last layer is a
    full-attention one (as in every published checkpoint), one line otherwise."""
    config = json.loads(NEXT_JSON.read_text())
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT, "--mtp-num-layers", "1"), config)
    config["layer_types"] = ["full_attention", "linear_attention"] * 24
    msg = _refusal(tiny_model_dir, ["--mtp-num-layers", "1"], config)
    assert msg.startswith("--mtp-num-layers 1: the Megatron backend builds Qwen3-Next / Qwen3.5's MTP layer as one "
                          "megatron-core MTP layer like the decoder's last (a full-attention layer)"), msg
    config = json.loads(NEXT_JSON.read_text()) | {"mtp_num_hidden_layers": 1}
    msg = _refusal(tiny_model_dir, ["--mtp-num-layers", "2"], config)   # the family's own key is named
    assert msg.startswith("--mtp-num-layers 2 does not match --hf-checkpoint's config.json (mtp_num_hidden_layers "
                          "1)"), msg


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "32", "--sequence-parallel"], "--tensor-model-parallel-size 32 does not divide the gated DeltaNet's "
                                             "heads (linear_num_key_heads 16, linear_num_value_heads 32)"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5 does not match --hf-checkpoint's config.json "
                                  "(partial_rotary_factor 0.25)"),
])
def test_what_is_not_built_is_one_line(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    msg = _refusal(tiny_model_dir, flags, json.loads(NEXT_JSON.read_text()))
    assert msg.startswith(message), msg


def test_qwen35_vlm_checkpoint_reads_its_text_model(tmp_path: Path) -> None:
    """A checkpoint in the published Qwen3.5 layout (config.json ``qwen3_5_moe`` with ``text_config``, the text model
    under ``model.language_model.``, a vision tower) trains its text model: the shape is text_config's, the megatron
    tensors are read from the prefixed names, and the export gives the checkpoint's names (``model.language_model.*``,
    experts one by one: what the FSDP backend's export gives and the engines load) with the checkpoint's tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles.trainer.megatron.convert import read_hf_state_dict
    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    model_dir = build_tiny_qwen35_model(tmp_path / "vlm", vlm=True)
    shape = options.shape_of(AutoConfig.from_pretrained(model_dir))
    assert shape.model_type == "qwen3_5_moe" and shape.num_layers == 4 and shape.variant.linear_layers == (1, 1, 1, 0)
    disk = load_file(str(model_dir / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in disk)
    names = _megatron_names(shape)
    full = hf_to_megatron(read_hf_state_dict(model_dir), shape, padded_vocab_size(shape.vocab_size, 128, 1), names)
    back = dict(pair for name in names for pair in megatron_to_hf(name, full[name], shape))
    assert set(back) == {n for n in disk if not n.startswith("model.visual.")}     # the tower is not trained
    assert len([n for n in back if ".mlp.experts." in n]) == 3 * shape.num_experts * shape.num_layers
    assert [n for n, t in back.items() if not torch.equal(t, disk[n].float())] == []
