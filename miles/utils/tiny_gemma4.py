"""A tiny Gemma 4 model built locally (no hub): transformers' ``Gemma4ForConditionalGeneration`` at test size,
laid out as Miles's recorded Gemma 4 checkpoints are (google/gemma-4-31B-it: a multimodal checkpoint whose text
decoder is under ``model.language_model.*``, a vision tower under ``model.vision_tower.*`` and
``model.embed_vision.*``, tied embeddings).

    build_tiny_gemma4("/tmp/g4")                 # 5 layers: 2 sliding, 1 full, 1 sliding, 1 full (as 31B's 5:1)
    build_tiny_gemma4("/tmp/g4", vision=False)   # Gemma4ForCausalLM (model.layers.*), the text decoder alone
    build_tiny_gemma4("/tmp/g4m", moe=True)      # 26B-A4B's MoE block in every layer: 4 experts, top-2

The text decoder has every part of 31B's at this size: sliding-window layers (``sliding_window`` 4, shorter than
the test sequences) and full-attention layers with their own head size (``global_head_dim``), fewer KV heads
(``num_global_key_value_heads``), keys doubling as values (``attention_k_eq_v``) and proportional RoPE over a
quarter of the head (``partial_rotary_factor`` 0.25, theta 1e6); q/k norms, the weightless v norm, sandwich norms,
GeGLU, the embedding scaled by sqrt(hidden), ``layer_scalar``, final logit softcapping (1.0 here, so the tanh
bends the tiny model's logits). Norm weights and layer scalars are drawn at random (transformers starts them at
one) so each changes the output. ``moe=True``: gemma-4-26B-A4B's MoE block beside the dense MLP in every layer
(``enable_moe_block``: 4 experts of 32, top-2; the router's ``scale`` and ``per_expert_scale`` drawn around one, its
projection wide enough that tokens pick different experts). No per-layer embeddings or KV sharing (the E2B/E4B parts).
The tokenizer is ``miles.utils.tiny_model``'s; the multimodal layout also writes the image processor's
``preprocessor_config.json``, as the released checkpoints have one.
"""

from __future__ import annotations

from pathlib import Path

LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention")


def tiny_text_config(vocab_size: int, *, hidden_size: int = 64, intermediate_size: int = 96, num_heads: int = 8,
                     num_kv_heads: int = 4, head_dim: int = 8, global_head_dim: int = 16, num_global_kv_heads: int = 2,
                     layer_types: tuple[str, ...] = LAYER_TYPES, sliding_window: int = 4,
                     final_logit_softcapping: float | None = 1.0, max_position_embeddings: int = 512,
                     pad_token_id: int = 0, eos_token_id: int = 1, moe: bool = False, num_experts: int = 4,
                     top_k_experts: int = 2, moe_intermediate_size: int = 32) -> dict:
    """The ``text_config`` of the tiny Gemma 4 (31B's switches, tiny sizes; ``moe``: 26B-A4B's MoE block)."""
    experts = dict(num_experts=num_experts, top_k_experts=top_k_experts,
                   moe_intermediate_size=moe_intermediate_size) if moe else {}
    return dict(**experts,
        model_type="gemma4_text", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=len(layer_types), num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, global_head_dim=global_head_dim,
        num_global_key_value_heads=num_global_kv_heads, attention_k_eq_v=True, layer_types=list(layer_types),
        sliding_window=sliding_window, final_logit_softcapping=final_logit_softcapping,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=moe, use_double_wide_mlp=False,
        attention_bias=False, tie_word_embeddings=True, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        bos_token_id=None)


def build_tiny_gemma4(out_dir: str | Path, *, vision: bool = True, seed: int = 0, dtype: str = "float32",
                      **text_kwargs) -> Path:
    """Write a randomly initialised tiny Gemma 4 (multimodal layout unless ``vision=False``) plus the tiny
    tokenizer to ``out_dir``."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    from miles.utils.tiny_model import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    n = len(tokenizer)
    text = tiny_text_config(n + 4 if vision else n, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, **text_kwargs)
    torch.manual_seed(seed)
    if vision:                           # the image/video/audio token ids past the tokenizer's characters
        config = Gemma4Config(
            text_config=text, audio_config=None,
            vision_config={"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                           "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
                           "position_embedding_size": 64},
            boi_token_id=n, eoi_token_id=n + 1, image_token_id=n + 2, video_token_id=n + 3, boa_token_id=None,
            eoa_token_index=None, audio_token_id=None, tie_word_embeddings=True, dtype=dtype)
        model = Gemma4ForConditionalGeneration(config)
        lm = model.model.language_model
    else:
        config = Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"}, dtype=dtype)
        model = Gemma4ForCausalLM(config)
        lm = model.model
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name and name.endswith("weight") or name.endswith(("router.scale", "router.per_expert_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.proj.weight"):     # logits of order one: routing differs between tokens
                p.copy_(torch.randn(p.shape, generator=gen))
        for layer in lm.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    if vision:                           # the checkpoint's image processor config (the released ones ship it)
        from transformers import Gemma4ImageProcessorPil

        Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2).save_pretrained(str(out))
    return out
