"""A tiny DeepSeek-V4 model built locally (no hub): transformers' ``DeepseekV4ForCausalLM`` at test size.

    build_tiny_dsv4_model("/tmp/dsv4")       # 4 layers: sliding, sliding, CSA, HCA (Miles's 4-layer V4-Flash schedule)

Every part of V4 is present and changes the output at this size: the hyper-connection streams (``hc_mult``) with
their Sinkhorn-projected mixing, the shared-KV attention with per-head sinks, a sliding window (shorter than the test
rows), the grouped low-rank output projection, a compressed-sparse-attention layer (overlapping windows of
``compress_rates['compressed_sparse_attention']`` tokens and the lightning indexer keeping ``index_topk`` of them)
and a heavily-compressed one (non-overlapping windows), the two rotary bases (``rope_theta`` on sliding layers,
``compress_rope_theta`` with YaRN on compressed ones), hash-routed MoE layers (a frozen ``tid2eid`` table) then
sqrtsoftplus top-k ones with a score-correction bias, the clamped SwiGLU on routed and shared experts.
transformers starts the sinks, position biases, hyper-connection biases, router bias and ``tid2eid`` at zero or
one; here they are drawn at random (each token's hash experts distinct). The weights are written under DeepSeek's
own checkpoint names (``layers.L.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``, ...: ``native_name``), as
DeepSeek-V4's checkpoints have them. The tokenizer is ``miles.utils.tiny_model``'s.
"""

from __future__ import annotations

from pathlib import Path

# Miles's 4-layer V4-Flash schedule (radixark/miles@v0.1.0:scripts/models/deepseek-v4-flash-4layer.py:
# --dsv4-compress-ratios 0 0 4 128): two sliding layers, one CSA, one HCA
TINY_LAYER_TYPES = ("sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention")


def build_tiny_dsv4_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    layer_types: tuple[str, ...] = TINY_LAYER_TYPES,
    num_hash_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 32,
    rope_head_dim: int = 8,
    q_lora_rank: int = 24,
    o_groups: int = 2,
    o_lora_rank: int = 16,
    moe_intermediate_size: int = 24,
    n_routed_experts: int = 4,
    num_experts_per_tok: int = 2,
    routed_scaling_factor: float = 1.5,
    hc_mult: int = 4,
    hc_sinkhorn_iters: int = 20,
    sliding_window: int = 8,
    csa_rate: int = 4,
    hca_rate: int = 8,
    index_n_heads: int = 2,
    index_head_dim: int = 16,
    index_topk: int = 2,
    swiglu_limit: float = 3.0,
    rope_theta: float = 10000.0,
    compress_rope_theta: float = 160000.0,
    yarn_factor: float = 4.0,
    yarn_original_max_position_embeddings: int = 64,
    max_position_embeddings: int = 256,
    rms_norm_eps: float = 1e-6,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised DeepSeek-V4 causal LM plus the tiny tokenizer to ``out_dir``."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from miles.utils.tiny_model import build_tiny_causal_lm

    n = len(layer_types)
    g = torch.Generator().manual_seed(seed + 1)

    def draw(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=g))

    def init(model) -> None:
        for layer in model.model.layers:
            attn = layer.self_attn
            draw(attn.sinks, 0.5)
            for hc in (layer.attn_hc, layer.ffn_hc):
                draw(hc.fn, 0.05)
                draw(hc.base, 0.5)
                draw(hc.scale, 0.2, 1.0)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_a_norm, attn.kv_norm):
                draw(norm.weight, 0.1, 1.0)
            comp = attn.compressor
            if comp is not None:
                draw(comp.position_bias, 0.5)
                draw(comp.kv_norm.weight, 0.1, 1.0)
                if getattr(comp, "indexer", None) is not None:
                    draw(comp.indexer.position_bias, 0.5)
                    draw(comp.indexer.kv_norm.weight, 0.1, 1.0)
            gate = layer.mlp.gate
            draw(gate.weight, 0.5)
            if hasattr(gate, "e_score_correction_bias"):
                draw(gate.e_score_correction_bias, 0.1)
            if hasattr(gate, "tid2eid"):            # each token's hash experts: distinct, drawn at random
                rows = [torch.randperm(n_routed_experts, generator=g)[:num_experts_per_tok]
                        for _ in range(model.config.vocab_size)]
                gate.tid2eid.copy_(torch.stack(rows))
        head = model.model.hc_head
        draw(head.hc_fn, 0.05)
        draw(head.hc_base, 0.5)
        draw(head.hc_scale, 0.2, 1.0)
        draw(model.model.norm.weight, 0.1, 1.0)

    out = build_tiny_causal_lm(
        out_dir, DeepseekV4Config, DeepseekV4ForCausalLM, seed=seed, dtype=dtype, init=init,
        hidden_size=hidden_size, num_hidden_layers=n, num_attention_heads=num_heads,
        num_key_value_heads=1, head_dim=head_dim, partial_rotary_factor=rope_head_dim / head_dim,
        q_lora_rank=q_lora_rank, o_groups=o_groups, o_lora_rank=o_lora_rank, moe_intermediate_size=moe_intermediate_size,
        n_routed_experts=n_routed_experts, n_shared_experts=1, num_experts_per_tok=num_experts_per_tok,
        scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=routed_scaling_factor,
        layer_types=list(layer_types), mlp_layer_types=["hash_moe"] * num_hash_layers + ["moe"] * (n - num_hash_layers),
        compress_rates={"compressed_sparse_attention": csa_rate, "heavily_compressed_attention": hca_rate},
        hc_mult=hc_mult, hc_sinkhorn_iters=hc_sinkhorn_iters, sliding_window=sliding_window,
        index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=index_topk, swiglu_limit=swiglu_limit,
        rope_theta=rope_theta, compress_rope_theta=compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": yarn_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": yarn_original_max_position_embeddings},
        max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps, tie_word_embeddings=False,
        num_nextn_predict_layers=0, router_aux_loss_coef=0.0)
    _to_native_names(out / "model.safetensors")
    return out


def native_name(name: str) -> str:
    """DeepSeek's own checkpoint name of a name transformers 5.24's ``save_pretrained`` writes for DeepSeek-V4
    (it writes ``model.layers.L.attn.*`` / ``model.embed_tokens.weight`` / ``model.hc_head.hc_fn``, DeepSeek's
    checkpoints ``layers.L.attn.*`` / ``embed.weight`` / ``hc_head_fn``; transformers loads either)."""
    name = name.replace("model.embed_tokens.weight", "embed.weight").replace("model.hc_head.hc_", "hc_head_")
    return name[len("model."):] if name.startswith("model.") else name


def _to_native_names(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({native_name(k): v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
