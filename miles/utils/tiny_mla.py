"""Tiny Multi-Latent-Attention models built locally (no hub): GLM-4.7-Flash's and DeepSeek-V3's architectures.

    build_tiny_mla_model("/tmp/glm")                                  # Glm4MoeLiteForCausalLM, random init
    build_tiny_mla_model("/tmp/dsv3", model_type="deepseek_v3", n_group=2, topk_group=1)
    build_tiny_mla_model("/tmp/k2", model_type="kimi_k2", rope_scaling=KIMI_K2_YARN)   # Kimi-K2: DeepSeek-V3 as
    #                                                                  its checkpoints write it (model_type kimi_k2)

Both are MLA attention (``q_a_proj``/``q_a_layernorm``/``q_b_proj``, or ``q_proj`` with ``q_lora_rank=None``;
``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj``; ``o_proj``), dense MLPs on the first
``first_k_dense_replace`` layers and DeepSeek-style MoE after them: a sigmoid router with a score-correction bias,
top-k over (optionally grouped) experts, renormalised and scaled by ``routed_scaling_factor``, plus shared experts.
The router weight, its bias and the experts are drawn at random so that routing differs between tokens. The
tokenizer is ``miles.utils.tiny_model``'s. ``rms_norm_eps`` defaults to 1e-6, the eps transformers gives the
latent norms (``q_a_layernorm``/``kv_a_layernorm``), so Megatron (one eps for every norm) computes the same.
"""

from __future__ import annotations

from pathlib import Path

MLA_MODEL_TYPES = {"glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
                   "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                   "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),   # config.json's model_type kimi_k2
                   "joyai_llm_flash": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}   # ... joyai_llm_flash
# Kimi-K2's yarn rope_scaling (moonshotai/Kimi-K2-Instruct's config.json: beta_fast = beta_slow = 1), its original
# context scaled down so that a 12-token row of a test crosses it
KIMI_K2_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8, "beta_fast": 1.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def build_tiny_mla_model(
    out_dir: str | Path,
    *,
    model_type: str = "glm4_moe_lite",
    hidden_size: int = 64,
    num_layers: int = 3,
    num_heads: int = 4,
    q_lora_rank: int | None = 24,
    kv_lora_rank: int = 16,
    qk_nope_head_dim: int = 12,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 10,
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
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    mtp_layers: int = 0,
) -> Path:
    """Write a randomly initialised MLA causal LM of ``model_type`` plus the tiny tokenizer to ``out_dir``.
    ``mtp_layers`` > 0: also its multi-token-prediction layers as the HF checkpoints keep them
    (``model.layers.{num_layers + k}``: a decoder layer plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
    and copies of the embedding / output layer as ``embed_tokens`` / ``shared_head.head``; config.json's
    ``num_nextn_predict_layers``), which transformers does not load."""
    import transformers

    from miles.utils.tiny_model import build_tiny_causal_lm

    if model_type not in MLA_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: one of {sorted(MLA_MODEL_TYPES)}")
    config_cls, model_cls = (getattr(transformers, n) for n in MLA_MODEL_TYPES[model_type])
    out = build_tiny_causal_lm(
        out_dir, config_cls, model_cls, seed=seed, dtype=dtype, init=lambda m: randomize_routers(m.model.layers),
        hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim, intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
        n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok, n_shared_experts=n_shared_experts,
        first_k_dense_replace=first_k_dense_replace, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
        routed_scaling_factor=routed_scaling_factor, rms_norm_eps=rms_norm_eps, attention_bias=False,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, tie_word_embeddings=False,
        **({"rope_scaling": dict(rope_scaling, rope_theta=rope_theta)} if rope_scaling else {}),
        **({"num_nextn_predict_layers": mtp_layers} if mtp_layers else {}))
    if model_type in ("kimi_k2", "joyai_llm_flash"):   # their checkpoints: DeepseekV3ForCausalLM under their type
        import json

        path = out / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"model_type": model_type}, indent=2))
    if mtp_layers:
        add_mtp_layers(out, mtp_layers, seed)
    return out


def randomize_routers(layers) -> None:
    """transformers initialises a DeepSeek-style router and its expert bias to zeros: draw them (from torch's global
    RNG, in layer order) for a random, distinct routing."""
    import torch

    with torch.no_grad():
        for layer in layers:
            randomize_router(layer)


def randomize_router(layer) -> None:
    """``randomize_routers`` of one decoder layer (nothing on a dense one); call under ``torch.no_grad``."""
    gate = getattr(layer.mlp, "gate", None)
    if gate is not None:
        gate.weight.normal_(0.0, 0.5)
        gate.e_score_correction_bias.uniform_(-0.1, 0.1)


def add_mtp_layers(out: Path, n: int, seed: int) -> None:
    """Append ``n`` random MTP layers to ``out``'s model.safetensors (HF layout, see ``build_tiny_mla_model``): each
    a decoder layer shaped like the last one (megatron-core builds its MTP layers so) plus the MTP tensors."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((out / "config.json").read_text())
    layers, h = config["num_hidden_layers"], config["hidden_size"]
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{layers - 1}."
    shapes = {k[len(last):]: v.shape for k, v in tensors.items() if k.startswith(last)}
    shapes |= {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
               "shared_head.norm.weight": (h,)}
    dtype = tensors["model.embed_tokens.weight"].dtype
    g = torch.Generator().manual_seed(seed + 1)
    for k in range(n):
        p = f"model.layers.{layers + k}."
        for name, shp in sorted(shapes.items()):   # every tensor drawn (norms too): a round trip is meaningful
            norm = len(shp) == 1 and "norm" in name
            t = 1.0 + 0.1 * torch.randn(shp, generator=g) if norm else 0.1 * torch.randn(shp, generator=g)
            tensors[p + name] = t.to(dtype).contiguous()
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
