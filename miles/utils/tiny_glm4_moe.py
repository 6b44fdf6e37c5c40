"""A tiny GLM-4.5-architecture model built locally (no hub): transformers' ``Glm4MoeForCausalLM``, random init.

    build_tiny_glm4_moe("/tmp/glm45")                        # GLM-4.5's switches: q/k norms, q/k/v biases
    build_tiny_glm4_moe("/tmp/air", use_qk_norm=False)       # GLM-4.5-Air's (no q/k norms)

Grouped-query attention (4 heads, 2 KV heads of 16) with q/k/v biases, per-head q/k RMSNorms (``use_qk_norm``), RoPE
on the first half of each head (``partial_rotary_factor`` 0.5, not interleaved), the first ``first_k_dense_replace``
layers dense, then DeepSeek-style MoE: a sigmoid router with a score-correction bias, top-k over (optionally grouped)
experts, renormalised and scaled by ``routed_scaling_factor``, plus a shared expert. What transformers starts at
constants is drawn so that each part changes the output: the routers and their bias
(``tiny_mla.randomize_routers``), the q/k/v biases and the q/k norms' weights. ``mtp_layers`` > 0: also the
multi-token-prediction layers as GLM-4.5's checkpoints keep them (``model.layers.{num_layers + k}``, DeepSeek-V3's
layout: ``tiny_mla``'s), which transformers does not load. The tokenizer is ``miles.utils.tiny_model``'s.
"""

from __future__ import annotations

from pathlib import Path


def _init(model) -> None:
    from miles.utils.tiny_mla import randomize_routers

    randomize_routers(model.model.layers)
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            if proj.bias is not None:
                proj.bias.normal_(0.0, 0.1)
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None:
                norm.weight.normal_(1.0, 0.1)


def build_tiny_glm4_moe(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    partial_rotary_factor: float = 0.5,
    use_qk_norm: bool = True,
    attention_bias: bool = True,
    intermediate_size: int = 96,
    moe_intermediate_size: int = 24,
    n_routed_experts: int = 4,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 2.5,
    rms_norm_eps: float = 1e-5,
    rope_theta: float = 1000000.0,
    max_position_embeddings: int = 2048,
    mtp_layers: int = 0,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised ``Glm4MoeForCausalLM`` plus the tiny tokenizer to ``out_dir``."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from miles.utils.tiny_model import build_tiny_causal_lm

    out = build_tiny_causal_lm(
        out_dir, Glm4MoeConfig, Glm4MoeForCausalLM, seed=seed, dtype=dtype, init=_init,
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, partial_rotary_factor=partial_rotary_factor,
        use_qk_norm=use_qk_norm, attention_bias=attention_bias, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok, n_shared_experts=n_shared_experts,
        first_k_dense_replace=first_k_dense_replace, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
        routed_scaling_factor=routed_scaling_factor, rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                         "partial_rotary_factor": partial_rotary_factor},
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False, num_nextn_predict_layers=mtp_layers)
    if mtp_layers:
        from miles.utils.tiny_mla import add_mtp_layers

        add_mtp_layers(out, mtp_layers, seed)
    return out
