"""A tiny gpt-oss model built locally (no hub): transformers' ``GptOssForCausalLM`` at test size.

    build_tiny_gpt_oss_model("/tmp/gptoss")        # 2 layers: sliding window, then full attention

gpt-oss's parts, each present at this size: learnable attention sinks (one logit per head), sliding-window
layers alternating with full-attention ones (``layer_types``; a window of ``sliding_window`` tokens, shorter than
the test sequences), q/k/v/o biases, a top-k router with a bias over experts whose fused ``gate_up_proj`` holds
gate and up interleaved column by column, the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), YaRN rope
(``truncate`` false, as gpt-oss-20b's config.json). The sinks, biases and router are drawn at random (transformers
starts the expert biases at zero and the sinks near zero) so each part changes the output. The tokenizer is
``miles.utils.tiny_model``'s.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_gpt_oss_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 32,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    sliding_window: int = 4,
    swiglu_limit: float = 7.0,
    max_position_embeddings: int = 512,
    rope_theta: float = 150000.0,
    yarn_factor: float = 4.0,
    yarn_original_max_position_embeddings: int = 128,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised gpt-oss causal LM plus the tiny tokenizer to ``out_dir``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from miles.utils.tiny_model import build_tiny_causal_lm

    def init(model) -> None:
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.weight.normal_(0.0, 0.5)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_(0.0, 0.1)

    return build_tiny_causal_lm(
        out_dir, GptOssConfig, GptOssForCausalLM, seed=seed, dtype=dtype, init=init,
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok, sliding_window=sliding_window,
        swiglu_limit=swiglu_limit, max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "yarn", "rope_theta": rope_theta, "factor": yarn_factor, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": yarn_original_max_position_embeddings},
        tie_word_embeddings=False, attention_bias=True, router_aux_loss_coef=0.0)
