"""A tiny Inkling text model built locally (no hub): transformers' ``InklingForCausalLM`` at test size.

    build_tiny_inkling_model("/tmp/inkling")   # 3 layers: sliding (dense MLP), full (MoE), sliding (MoE)
    build_tiny_inkling_model("/tmp/ink_mm", published=True)   # the same weights in the published layout

Every part of Inkling's text model is present and changes the output at this size: the normed embedding, the
relative-position logits (a ``rel_extent`` shorter than the test rows, so the bias is cut off on the full layer), the
short convolutions on K / V and on the attention's and MLP's outputs, a sliding window shorter than the rows with its
own head counts and head size, the full layer's log scaling of the logits (``log_scaling_n_floor`` below the row
length), the dense MLP's ``global_scale``, the sigmoid router with the shared-expert sink, its score-correction bias
and ``global_scale``, ``route_scale`` and the muP division before the head. transformers starts the convolutions,
norms, scales and router bias at constants; here they are drawn at random. The tokenizer is
``miles.utils.tiny_model``'s.

``published``: the layout of the released checkpoint (thinkingmachines/Inkling: ``model_type`` ``inkling_mm_model``,
the text model in ``text_config``, its tensors under ``model.llm.*`` in Thinking Machines' names with the [gate; up]
pairs interleaved), written by transformers' own revert of its load-time conversion
(``transformers.conversion_mapping``'s ``inkling_mm_model``), plus one stand-in tower tensor (``model.visual.*``):
transformers' ``InklingForConditionalGeneration`` is not built (its vision tower needs scipy), so the weights are the
text model's of the same seed.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_inkling_model(out_dir: str | Path, *, hidden_size: int = 48, seed: int = 0, dtype: str = "float32",
                             published: bool = False) -> Path:
    """Write a randomly initialised Inkling causal LM (``inkling_text``; ``published``: the released checkpoint's
    layout, module docstring) plus the tiny tokenizer to ``out_dir``."""
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

    out = build_tiny_causal_lm(
        out_dir, InklingTextConfig, InklingForCausalLM, seed=seed, dtype=dtype, init=init,
        hidden_size=hidden_size, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        swa_num_attention_heads=6, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, d_rel=4,
        rel_extent=12, log_scaling_n_floor=6, log_scaling_alpha=0.3, local_layer_ids=[0, 2],
        mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, route_scale=2.5,
        logits_mup_width_multiplier=4.0, conv_kernel_size=4, max_position_embeddings=256, rms_norm_eps=1e-6)
    if published:
        _to_published(out, seed)
    return out


def _to_published(out: Path, seed: int) -> None:
    """Rewrite ``out`` (an inkling_text checkpoint) in the released checkpoint's layout (module docstring)."""
    import json
    import types

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import InklingConfig
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion

    text = json.loads((out / "config.json").read_text())
    for key in ("architectures", "transformers_version"):
        text.pop(key, None)
    config = InklingConfig(text_config=text, vision_config={"hidden_size": 16, "num_hidden_layers": 1,
                                                           "num_attention_heads": 2},
                           audio_config={"n_mel_bins": 4, "mel_vocab_size": 8})
    config.architectures = ["InklingForConditionalGeneration"]
    config.dtype = text.get("dtype") or "float32"           # the weights' (--save-hf writes this dtype)
    config.save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(str(path)).items()}
    # transformers' revert reads only the conversions from the model it is given
    layout = types.SimpleNamespace(_weight_conversions=get_checkpoint_conversion_mapping("inkling_mm_model"),
                                   config=None)
    native = {k: v.contiguous() for k, v in revert_weight_conversion(layout, tensors).items()}
    native["model.visual.layers.linear_0.weight"] = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
    save_file(native, str(path), metadata={"format": "pt"})
