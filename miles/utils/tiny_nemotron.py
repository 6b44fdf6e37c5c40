"""A tiny Nemotron-3 (``nemotron_h``) model built locally (no hub): transformers' ``NemotronHForCausalLM`` at test
size, with every part of Nemotron-3 Super / Ultra present.

    build_tiny_nemotron_model("/tmp/nemotron")      # pattern "ME*-E": Mamba-2, MoE, attention, MLP, MoE

The parts: Mamba-2 layers (``M``: grouped B/C, several heads per group, a causal conv, the gated group norm),
attention without position embedding (``*``, GQA), a squared-ReLU MLP (``-``) and the latent MoE (``E``:
``fc1_latent_proj`` into ``moe_latent_size``, non-gated squared-ReLU experts there, ``fc2_latent_proj`` back, a
sigmoid router with ``e_score_correction_bias`` and a ``routed_scaling_factor``, a shared expert on the full hidden
size). ``chunk_size`` is shorter than the test rows, so the scan crosses chunks. The Mamba parameters (A_log, D,
dt_bias, norm), the router's bias and the norms are drawn at random so each changes the output. The tokenizer is
``miles.utils.tiny_model``'s.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_nemotron_model(
    out_dir: str | Path,
    *,
    pattern: str = "ME*-E",
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 48,
    mamba_num_heads: int = 8,
    mamba_head_dim: int = 8,
    n_groups: int = 2,
    ssm_state_size: int = 16,
    conv_kernel: int = 4,
    chunk_size: int = 8,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    moe_shared_expert_intermediate_size: int = 48,
    moe_latent_size: int | None = 32,
    routed_scaling_factor: float = 2.5,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised Nemotron-H causal LM plus the tiny tokenizer to ``out_dir``."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from miles.utils.tiny_model import build_tiny_causal_lm

    def init(model) -> None:
        for layer in model.model.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
            mixer = layer.mixer
            if layer.block_type == "linear_attention":
                mixer.A_log.copy_(torch.log(torch.rand(mamba_num_heads) * 4 + 0.5))
                mixer.D.normal_(1.0, 0.5)
                mixer.dt_bias.normal_(-1.0, 1.0)
                mixer.norm.weight.uniform_(0.5, 1.5)
                mixer.conv1d.bias.normal_(0.0, 0.2)
            elif layer.block_type == "moe":
                mixer.gate.weight.normal_(0.0, 0.5)
                mixer.gate.e_score_correction_bias.normal_(0.0, 0.1)
        model.model.norm_f.weight.uniform_(0.5, 1.5)
        model.lm_head.weight.normal_(0.0, 0.3)          # logits of a few units: log-probs far from uniform

    return build_tiny_causal_lm(
        out_dir, NemotronHConfig, NemotronHForCausalLM, seed=seed, dtype=dtype, init=init,
        hidden_size=hidden_size, hybrid_override_pattern=pattern, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        mlp_hidden_act="relu2", mamba_num_heads=mamba_num_heads, mamba_head_dim=mamba_head_dim, n_groups=n_groups,
        ssm_state_size=ssm_state_size, conv_kernel=conv_kernel, chunk_size=chunk_size, n_routed_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        moe_shared_expert_intermediate_size=moe_shared_expert_intermediate_size, moe_latent_size=moe_latent_size,
        routed_scaling_factor=routed_scaling_factor, n_group=1, topk_group=1, norm_topk_prob=True,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False, layer_norm_epsilon=1e-5,
        initializer_range=0.1)
