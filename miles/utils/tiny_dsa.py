"""Tiny DeepSeek-sparse-attention models built locally (no hub): DeepSeek-V3.2's and GLM-5's architectures.

    build_tiny_dsa_model("/tmp/glm5")                                    # GlmMoeDsaForCausalLM (model_type glm_moe_dsa)
    build_tiny_dsa_model("/tmp/dsv32", model_type="deepseek_v32")        # DeepseekV32ForCausalLM, yarn rope, groups
    build_tiny_dsa_model("/tmp/glm52", indexer_types=["full", "shared", "full"])   # GLM-5.2's shared top-k layers

Both are DeepSeek-V3's multi-latent attention and MoE (``miles.utils.tiny_mla``'s shapes: q LoRA, a dense first
layer, a sigmoid router with a score-correction bias, shared experts) plus a lightning indexer per attention layer
(``self_attn.indexer``: ``wq_b`` from the q latent, ``wk`` and a LayerNorm ``k_norm`` (weight and bias) from the
hidden states, ``weights_proj`` per indexer head) that keeps the ``index_topk`` keys of highest score per query;
the attention runs over those keys only. The indexer's rope dims are its first ``qk_rope_head_dim``: GLM-5 rotates
them interleaved (as its main attention), DeepSeek-V3.2 half-split. GLM-5's ``indexer_types`` "shared" layers
have no indexer and reuse the previous full layer's top-k.

``index_topk`` (4) is shorter than a test row, so every row past it is sparse. The indexer's weights are drawn
wider than transformers' init (std 0.5, a random ``k_norm``) so that its scores spread out and its top-k differs
between queries (transformers' init gives near-equal scores whose order a rounding may flip). The router, its bias
and the tokenizer are as ``tiny_mla``'s. ``rms_norm_eps`` defaults to 1e-6, transformers' eps of the latent norms.
"""

from __future__ import annotations

from pathlib import Path

DSA_MODEL_TYPES = {"glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
                   "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM")}
# DeepSeek-V3.2's yarn rope (its config.json: factor 40, beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 1)
# over an original context of 8, so that a 16-token test row crosses it
TINY_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def build_tiny_dsa_model(
    out_dir: str | Path,
    *,
    model_type: str = "glm_moe_dsa",
    hidden_size: int = 64,
    num_layers: int = 3,
    num_heads: int = 4,
    q_lora_rank: int = 24,
    kv_lora_rank: int = 16,
    qk_nope_head_dim: int = 12,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 10,
    index_topk: int = 4,
    index_n_heads: int = 4,
    index_head_dim: int = 16,
    indexer_types: list[str] | None = None,
    intermediate_size: int = 96,
    moe_intermediate_size: int = 24,
    n_routed_experts: int = 4,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.8,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 256,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised DSA causal LM of ``model_type`` plus the tiny tokenizer to ``out_dir``."""
    import transformers

    from miles.utils.tiny_mla import randomize_router
    from miles.utils.tiny_model import build_tiny_causal_lm

    if model_type not in DSA_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: one of {sorted(DSA_MODEL_TYPES)}")
    if indexer_types is not None and model_type != "glm_moe_dsa":
        raise ValueError("indexer_types (shared top-k layers) is GLM-5's (glm_moe_dsa)")
    config_cls, model_cls = (getattr(transformers, n) for n in DSA_MODEL_TYPES[model_type])
    rope = {"rope_type": "default", "rope_theta": rope_theta} if rope_scaling is None else dict(
        rope_scaling, rope_theta=rope_theta)

    def init(model) -> None:       # a random, distinct routing (transformers starts router and bias at zero) and an
        for layer in model.model.layers:      # indexer whose scores spread out
            randomize_router(layer)
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                for lin in (indexer.wq_b, indexer.wk, indexer.weights_proj):
                    lin.weight.normal_(0.0, 0.5)
                indexer.k_norm.weight.uniform_(0.5, 1.5)
                indexer.k_norm.bias.normal_(0.0, 0.2)

    return build_tiny_causal_lm(
        out_dir, config_cls, model_cls, seed=seed, dtype=dtype, init=init,
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        index_topk=index_topk, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
        intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
        n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok, n_shared_experts=n_shared_experts,
        first_k_dense_replace=first_k_dense_replace, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
        routed_scaling_factor=routed_scaling_factor, rms_norm_eps=rms_norm_eps, attention_bias=False,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope, tie_word_embeddings=False,
        **({"indexer_types": list(indexer_types)} if indexer_types is not None else {}))
