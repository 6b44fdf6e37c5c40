"""A tiny Inkling text model built locally (no hub): transformers' ``InklingForCausalLM`` at test size.

    build_tiny_inkling_model("/tmp/inkling")   # 3 layers: sliding (dense MLP), full (MoE), sliding (MoE)

Every part of Inkling's text model is present and changes the output at this size: the normed embedding, the
relative-position logits (a ``rel_extent`` shorter than the test rows, so the bias is cut off on the full layer), the
short convolutions on K / V and on the attention's and MLP's outputs, a sliding window shorter than the rows with its
own head counts and head size, the full layer's log scaling of the logits (``log_scaling_n_floor`` below the row
length), the dense MLP's ``global_scale``, the sigmoid router with the shared-expert sink, its score-correction bias
and ``global_scale``, ``route_scale`` and the muP division before the head. transformers starts the convolutions,
norms, scales and router bias at constants; here they are drawn at random. The tokenizer is
``miles.utils.tiny_model``'s.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_inkling_model(out_dir: str | Path, *, hidden_size: int = 48, seed: int = 0,
                             dtype: str = "float32") -> Path:
    """Write a randomly initialised Inkling causal LM (``inkling_text``) plus the tiny tokenizer to ``out_dir``."""
    import torch
    from transformers import InklingForCausalLM, InklingTextConfig

    from miles.utils.tiny_model import build_tiny_causal_lm

    g = torch.Generator().manual_seed(seed + 1)

    def draw(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=g))

    def init(model) -> None:
        m = model.model
        draw(model.lm_head.weight, 0.5)            # logits of order 1 (transformers' 0.02 std, / muP: ~0.1)
        draw(m.embed_tokens.embed_norm.weight, 0.1, 1.0)
        draw(m.norm.weight, 0.1, 1.0)
        for layer in m.layers:
            attn = layer.self_attn
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm):
                draw(norm.weight, 0.1, 1.0)
            for conv in (attn.k_sconv, attn.v_sconv, layer.attn_sconv, layer.mlp_sconv):
                draw(conv.conv1d.weight, 0.3)
            draw(attn.rel_logits_proj.proj, 0.5)
            mlp = layer.mlp
            if hasattr(mlp, "gate"):
                draw(mlp.gate.weight, 0.5)
                draw(mlp.gate.e_score_correction_bias, 0.1)
                draw(mlp.gate.global_scale, 0.1, 1.0)
            else:
                draw(mlp.global_scale, 0.1, 1.0)

    return build_tiny_causal_lm(
        out_dir, InklingTextConfig, InklingForCausalLM, seed=seed, dtype=dtype, init=init,
        hidden_size=hidden_size, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        swa_num_attention_heads=6, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, d_rel=4,
        rel_extent=12, log_scaling_n_floor=6, log_scaling_alpha=0.3, local_layer_ids=[0, 2],
        mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, route_scale=2.5,
        logits_mup_width_multiplier=4.0, conv_kernel_size=4, max_position_embeddings=256, rms_norm_eps=1e-6)
