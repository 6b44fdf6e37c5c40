"""DeepSeek-V4 on the Megatron backend without ranks: the sqrtsoftplus and hash routing against transformers' own
routers, the shape of a V4 config.json, Miles's ``--moe-router-score-function sqrtsoftplus`` checked against
config.json, one line for what is not built. Parity with transformers: tests/multiprocess/test_megatron_dsv4.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.trainer.megatron import options
from miles.trainer.megatron.families import deepseek_v4

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tiny_dsv4_dir(tmp_path_factory) -> Path:
    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    return build_tiny_dsv4_model(tmp_path_factory.mktemp("tiny_dsv4"))


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def test_routing_matches_transformers_routers(tiny_dsv4_dir: Path) -> None:
    """sqrt(softplus) scores, top-k over scores + bias, renormalised weights times the scale (``sqrtsoftplus_topk``)
    and the hash layers' token-id table give transformers' ``DeepseekV4TopKRouter`` / ``HashRouter`` experts and
    weights exactly."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dsv4_dir, dtype=torch.float32)
    torch.manual_seed(0)
    x = torch.randn(2, 7, hf.config.hidden_size)
    ids = torch.randint(4, hf.config.vocab_size, (2, 7))
    for layer in hf.model.layers:
        gate = layer.mlp.gate
        logits = x.reshape(-1, x.shape[-1]) @ gate.weight.t()
        if layer.mlp.is_hash:
            _, want_w, want_i = gate(x, ids)
            probs, routing = deepseek_v4.sqrtsoftplus_topk(logits, gate.top_k, gate.routed_scaling_factor,
                                                           indices=gate.tid2eid[ids.reshape(-1)])
        else:
            _, want_w, want_i = gate(x)
            probs, routing = deepseek_v4.sqrtsoftplus_topk(logits, gate.top_k, gate.routed_scaling_factor,
                                                           gate.e_score_correction_bias)
        want = torch.zeros_like(probs).scatter(1, want_i, want_w)
        assert torch.equal(routing, want != 0) and torch.equal(probs, want)
    # the bias moves the choice, not the weight: a bias that flips a token's top-2 changes its experts
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    probs, _ = deepseek_v4.sqrtsoftplus_topk(logits, 2, 1.0, torch.tensor([5.0, 0.0, 0.0, 0.0]))
    s = torch.nn.functional.softplus(logits).sqrt()[0]
    want = torch.stack([s[0], 0 * s[1], 0 * s[2], s[3]]) / (s[0] + s[3])
    torch.testing.assert_close(probs[0], want, rtol=0, atol=0)      # measured: bit for bit (CPU, 2026-12-08)


def test_shape_of_the_tiny_config(tiny_dsv4_dir: Path) -> None:
    from transformers import AutoConfig

    shape = options.shape_of(AutoConfig.from_pretrained(tiny_dsv4_dir))
    g = shape.variant
    assert shape.family.name == "deepseek_v4" and shape.moe_score_function == "sqrtsoftplus"
    assert g.layer_types == ("sliding_attention", "sliding_attention", "compressed_sparse_attention",
                             "heavily_compressed_attention") and g.num_hash_layers == 2
    assert (g.head_dim, g.rope_head_dim, g.o_groups, g.csa_rate, g.hca_rate, g.hc_mult) == (32, 8, 2, 4, 8, 4)
    assert g.yarn == (4.0, 64.0, 32.0, 1.0) and shape.moe_topk_scaling == 1.5
    # the compressed rotary: YaRN's ramp, as transformers computes it
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dsv4_dir, dtype=torch.float32)
    rope = hf.model.rotary_emb
    # measured: bit for bit (CPU, 2026-12-08)
    torch.testing.assert_close(deepseek_v4.inv_freq(shape, "compress"), rope.compress_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(deepseek_v4.inv_freq(shape, "main"), rope.main_inv_freq, rtol=0, atol=0)


def test_sqrtsoftplus_flag(tiny_dsv4_dir: Path) -> None:
    """--moe-router-score-function sqrtsoftplus parses (argparse refused it before), matches a V4 config.json, and is
    one line on another family's; with --num-layers on V4 the sqrtsoftplus flag must be given."""
    v4 = _config(tiny_dsv4_dir)
    options.preflight_check(_cfg(tiny_dsv4_dir, "--moe-router-score-function", "sqrtsoftplus"), v4)
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_dsv4_dir, "--moe-router-score-function", "sigmoid"), v4)
    assert str(ei.value).startswith("--moe-router-score-function sigmoid does not match --hf-checkpoint's config.json "
                                    "(router scores sqrtsoftplus)") and "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match=r"^--moe-router-score-function is missing but .* router scores "
                                          r"sqrtsoftplus"):
        options.preflight_check(_cfg(tiny_dsv4_dir, "--num-layers", "4", "--moe-router-enable-expert-bias",
                                     "--moe-shared-expert-intermediate-size", "24",
                                     "--moe-router-topk-scaling-factor", "1.5"), v4)


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "config.json has quantization_config"),
    ({"scoring_func": "softmax"}, "DeepSeek-V4 scoring_func 'softmax' is not supported"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "DeepSeek-V4 mlp_layer_types"),
])
def test_unsupported_configs_are_one_line(tiny_dsv4_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_dsv4_dir), _config(tiny_dsv4_dir) | change)
    assert str(ei.value).startswith("--hf-checkpoint: " + message) and "\n" not in str(ei.value), ei.value


@pytest.mark.parametrize("flags, message", [
    (["--context-parallel-size", "2"], "--context-parallel-size 2 with DeepSeek-V4 is not supported"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2 with DeepSeek-V4 is not supported"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 with MoE layers needs "
                                            "--sequence-parallel"),
    (["--tensor-model-parallel-size", "4", "--sequence-parallel"], "--tensor-model-parallel-size 4 does not divide "
                                                                   "config.json's o_groups 2"),
])
def test_layouts_not_built_are_one_line(tiny_dsv4_dir: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        options.preflight_check(_cfg(tiny_dsv4_dir, *flags), _config(tiny_dsv4_dir))
    assert str(ei.value).startswith(message) and "\n" not in str(ei.value), ei.value
