"""gpt-oss on the Megatron backend without ranks: the shape of gpt-oss-20b's config.json, megatron-core's config of it,
the HF <-> Megatron conversion (bitwise round trip under TP, the fused experts), Miles's gpt-oss flags checked
against config.json, one line for what is not built. Parity with transformers: tests/multiprocess/test_megatron_gpt_oss.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import tp_round_trip

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.convert import partition_dim, shard
from miles.trainer.megatron.families import gpt_oss
from miles.trainer.megatron.model import ModelShape

pytest.importorskip("megatron.core")

GPT_OSS_JSON = Path(__file__).resolve().parents[3] / "fixtures" / "miles_scripts" / "models" / "gpt-oss-20b.json"


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_gpt_oss import build_tiny_gpt_oss_model

    return build_tiny_gpt_oss_model(tmp_path_factory.mktemp("tiny_gpt_oss"))


def _shape(config: dict) -> ModelShape:
    from transformers import AutoConfig

    d = dict(config)
    return options.shape_of(AutoConfig.for_model(d.pop("model_type"), **d))


def test_shape_of_gpt_oss_20b_and_its_megatron_config() -> None:
    from miles.trainer.megatron import moe
    from miles.trainer.megatron.model import transformer_config

    shape = _shape(json.loads(GPT_OSS_JSON.read_text()))
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, shape.kv_channels,
            shape.num_experts, shape.moe_router_topk, shape.moe_ffn_hidden_size) == (24, 2880, 64, 8, 64, 32, 4, 2880)
    assert shape.qkv_bias and not shape.tie_embeddings and shape.moe_layer_pattern == (1,) * 24
    g = shape.variant
    assert g.sliding_window == 128 and g.sliding_layers == (1, 0) * 12 and g.swiglu_limit == 7.0
    assert g.yarn == (32.0, 4096.0, 32.0, 1.0) and not g.yarn_truncate
    assert g.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    config = transformer_config(shape, tp_size=1, device=torch.device("cpu"),
                                moe=moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False))
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq) == ("learnable", (127, 0),
                                                                                       [1, 0] * 12)
    assert config.add_bias_linear and config.glu_linear_offset == 1.0 and config.activation_func_clamp_value == 7.0
    assert config.activation_func.__name__ == "quick_gelu" and not config.bias_activation_fusion
    assert config.softmax_scale == pytest.approx(g.attention_scaling ** 2 / 8.0)
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax


def test_yarn_frequencies_are_transformers(tiny_gpt_oss_dir: Path) -> None:
    """megatron-core's YaRN helpers with gpt-oss's unrounded correction range give transformers' inverse frequencies
    and scale."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(tiny_gpt_oss_dir)
    shape = ModelShape.from_hf_config(config)
    ref, scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(gpt_oss.yarn_inv_freq(shape), ref, rtol=0, atol=0)   # measured: bit for bit (CPU)
    assert shape.variant.attention_scaling == pytest.approx(scale)


def _megatron_names(shape: ModelShape) -> list[str]:
    """megatron-core's parameter names (local spec, EP 1) of a tiny gpt-oss model."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                                  "self_attention.core_attention.softmax_offset", "self_attention.linear_qkv.weight",
                                  "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                                  "self_attention.linear_proj.bias", "mlp.router.weight", "mlp.router.bias")]
        names += [f"{p}mlp.experts.local_experts.{e}.linear_fc{k}.{kind}" for e in range(shape.num_experts)
                  for k in (1, 2) for kind in ("weight", "bias")]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bitwise_under_tp(tiny_gpt_oss_dir: Path, tp: int) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(tiny_gpt_oss_dir / "model.safetensors"))
    shape = _shape(json.loads((tiny_gpt_oss_dir / "config.json").read_text()))
    full, pairs = tp_round_trip(hf, shape, _megatron_names(shape), tp)
    back = dict(pair for bucket in gpt_oss.fuse_experts(iter([pairs[:7], pairs[7:]]), shape.num_experts)
                for pair in bucket)
    assert back.keys() == hf.keys()
    assert all(back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]) for k in hf)
    # megatron-core's layouts: [gate; up] rows of expert 1 from the interleaved columns, sinks split by heads
    fc1 = full["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"][1]
    assert torch.equal(fc1[:shape.moe_ffn_hidden_size], gate_up[:, 0::2].t())
    sinks = "decoder.layers.1.self_attention.core_attention.softmax_offset"
    assert partition_dim(sinks) == 0 and torch.equal(shard(sinks, full[sinks], 0, tp - 1, tp),
                                                     hf["model.layers.1.self_attn.sinks"].chunk(tp)[-1])


def test_fuse_experts_refuses_an_incomplete_layer() -> None:
    with pytest.raises(RuntimeError, match="never completed"):
        list(gpt_oss.fuse_experts(iter([[("a.gate_up_proj#0", torch.zeros(1))]]), 2))


# ------------------------------------------------------------------------------------------- flags
SCRIPT = [  # the model flags of Miles's scripts/models/gpt-oss-20b.py (tests/fixtures/miles_scripts)
    "--num-layers", "24", "--hidden-size", "2880", "--ffn-hidden-size", "2880", "--num-attention-heads", "64",
    "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "64", "--use-rotary-position-embeddings",
    "--rotary-percent", "1.0", "--rotary-base", "150000", "--max-position-embeddings", "131072", "--normalization",
    "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "201088",
    "--softmax-type", "learnable", "--window-size", "128,0", "--window-attn-skip-freq", "2",
    "--no-masked-softmax-fusion", "--no-rope-fusion", "--num-experts", "32", "--moe-router-topk", "4",
    "--moe-aux-loss-coeff", "0.0", "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32",
    "--tensor-model-parallel-size", "8", "--sequence-parallel", "--expert-model-parallel-size", "8",
    "--expert-tensor-parallel-size", "1"]


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _with(flags: list[str], name: str, value: str | None) -> list[str]:
    out = list(flags)
    i = out.index(name)
    takes_value = i + 1 < len(out) and not out[i + 1].startswith("--")
    if value is None:
        del out[i:i + 1 + takes_value]
    elif takes_value:
        out[i + 1] = value
    return out


def test_gpt_oss_20b_flags_accepted(tiny_model_dir: Path) -> None:
    options.preflight_check(_cfg(tiny_model_dir, *SCRIPT), json.loads(GPT_OSS_JSON.read_text()))
    # the window also as a 0/1 list per layer (1: sliding), Megatron-LM's other spelling
    flags = _with(SCRIPT, "--window-attn-skip-freq", "[1,0]*12")
    options.preflight_check(_cfg(tiny_model_dir, *flags), json.loads(GPT_OSS_JSON.read_text()))


@pytest.mark.parametrize("flag, value, message", [
    ("--window-size", "64,0", "--window-size 64,0 does not match --hf-checkpoint's config.json (sliding_window 128)"),
    ("--window-attn-skip-freq", "3", "--window-attn-skip-freq 3 does not match --hf-checkpoint's config.json "
                                     "(layer_types (1: sliding_attention) [1, 0, 1, 0"),
    ("--softmax-type", "off-by-one", "--softmax-type off-by-one does not match --hf-checkpoint's config.json "
                                     "(self_attn.sinks present (learnable))"),
    ("--softmax-type", None, "--softmax-type is missing but --hf-checkpoint's config.json is gpt-oss"),
    ("--window-size", "128", "--window-size '128' is not two integers"),
])
def test_gpt_oss_flags_checked_against_config_json(tiny_model_dir: Path, flag: str, value, message: str) -> None:
    cfg = _cfg(tiny_model_dir, *_with(SCRIPT, flag, value))
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(cfg, json.loads(GPT_OSS_JSON.read_text()))
    assert str(ei.value).startswith(message) and "\n" not in str(ei.value), ei.value


def test_bias_and_sink_flags_against_other_families(tiny_model_dir: Path) -> None:
    """--disable-bias-linear on gpt-oss (every linear has a bias), and the sink / window flags on a Qwen3 model."""
    with pytest.raises(ConfigError, match=r"^--disable-bias-linear \(given\) does not match .*attention_bias True"):
        options.preflight_check(_cfg(tiny_model_dir, *SCRIPT, "--disable-bias-linear"),
                                json.loads(GPT_OSS_JSON.read_text()))
    qwen = json.loads((tiny_model_dir / "config.json").read_text())
    for flags, first in ((["--softmax-type", "learnable"], "--softmax-type learnable does not match"),
                         (["--window-size", "128,0"], "--window-size 128,0 does not match")):
        with pytest.raises(ConfigError) as ei:
            options.preflight_check(_cfg(tiny_model_dir, *flags), qwen)
        assert str(ei.value).startswith(first) and "model_type qwen3" in str(ei.value), ei.value


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "config.json has quantization_config (mxfp4)"),
    ({"swiglu_alpha": 1.5}, "gpt-oss swiglu_alpha 1.5 is not supported"),
    ({"attention_bias": False}, "gpt-oss with attention_bias false is not supported"),
])
def test_unsupported_gpt_oss_configs_are_one_line(tiny_model_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_model_dir), json.loads(GPT_OSS_JSON.read_text()) | change)
    assert str(ei.value).startswith("--hf-checkpoint: " + message) and "\n" not in str(ei.value), ei.value


def test_context_parallel_and_unfused_attention_are_refused(tiny_model_dir: Path) -> None:
    for flags, first in ((["--context-parallel-size", "2"], "--context-parallel-size 2 with gpt-oss"),
                         (["--attention-backend", "unfused"], "--attention-backend unfused")):
        with pytest.raises(ConfigError) as ei:
            options.preflight_check(_cfg(tiny_model_dir, *flags), json.loads(GPT_OSS_JSON.read_text()))
        assert str(ei.value).startswith(first), ei.value


def test_qkv_format_bshd_is_the_megatron_backends(tiny_model_dir: Path) -> None:
    assert _cfg(tiny_model_dir, "--qkv-format", "bshd").train.qkv_format == "bshd"
    with pytest.raises(ConfigError, match=r"^--qkv-format bshd is not supported by --train-backend fsdp"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--train-backend", "fsdp", "--qkv-format", "bshd"])
