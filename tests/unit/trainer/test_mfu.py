"""MFU's parameter count: a MoE token passes through the top-k of its routed experts, not all of them."""

from __future__ import annotations

import pytest

from miles.trainer.metrics import active_params, mfu, moe_routing


def test_active_params_of_a_real_qwen3_moe(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.utils.tiny_model import build_tiny_moe_model

    d = build_tiny_moe_model(tmp_path / "moe", hidden_size=64, num_layers=2, num_experts=4, num_experts_per_tok=1,
                             moe_intermediate_size=32)
    cfg = AutoConfig.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    # per layer, 4 experts of 3 projections 64x32: 3/4 of them are idle for every token
    assert experts == 2 * 4 * 3 * 64 * 32
    assert moe_routing(cfg) == (4, 1)
    assert active_params(total, experts, moe_routing(cfg)) == total - 2 * 3 * 3 * 64 * 32


def test_gemma4_moe_routing_from_its_text_config(tmp_path):
    """Gemma 4 26B-A4B: the multimodal config's text_config, top_k_experts; its experts' fused tensors counted."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from miles.utils.tiny_gemma4 import build_tiny_gemma4

    d = build_tiny_gemma4(tmp_path / "g4m", moe=True)
    assert moe_routing(AutoConfig.from_pretrained(d)) == (4, 2)
    model = AutoModelForImageTextToText.from_pretrained(d)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 5 * 4 * 3 * 64 * 32       # 5 layers of 4 experts, gate / up / down 64 x 32


def test_dense_models_count_every_parameter(tiny_model_dir):
    from transformers import AutoConfig

    assert moe_routing(AutoConfig.from_pretrained(tiny_model_dir)) is None
    assert active_params(1000, 0, None) == 1000
    assert active_params(1000, 600, (8, 8)) == 1000  # every expert routed: all active


def test_mfu_formula():
    # 6N per trained token + 2N per forward-only token, over seconds * gpus * peak
    assert mfu(num_params=10**9, train_tokens=1000, forward_tokens=500, seconds=1.0, num_gpus=2, peak=1.0) == \
        pytest.approx((6e12 + 1e12) / 2 / 1e12)
    assert mfu(num_params=1, train_tokens=1, forward_tokens=1, seconds=1.0, num_gpus=1, peak=None) is None
