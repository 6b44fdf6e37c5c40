"""A tiny Kimi-K2.5 built locally (no hub): transformers' ``Kimi_K25ForConditionalGeneration`` at test size, laid out
as the published checkpoints (moonshotai/Kimi-K2.5) and Miles's converter name it.

    build_tiny_kimi_k25("/tmp/k25")                          # 3 layers: 1 dense, 2 MoE; YaRN over 8 positions

Kimi-K2.5 is a vision-language model whose text model is DeepSeek-V3's architecture (``text_config`` of model type
``deepseek_v3``; the hub's config.json says ``kimi_k2``, which transformers maps to it): multi-latent attention,
YaRN rope, a sigmoid-routed MoE with a shared expert, the first layer dense. The checkpoint's names (as
radixark/miles@v0.1.0:miles/backends/megatron_utils/megatron_to_hf/kimi_vl.py writes them for SGLang):
``language_model.model.layers.L.*``, ``language_model.model.embed_tokens.weight``, ``language_model.model.norm.weight``,
``language_model.lm_head.weight`` (untied), and the MoonViT tower and projector beside them (``vision_tower.*``,
``mm_projector.*``). transformers 5 loads that layout through its conversion mapping (``model.language_model.*``,
``lm_head``); its ``save_pretrained`` writes the text layers back as ``language_model.model.blocks.L`` (the vision
tower's ``blocks`` -> ``layers`` rename reverted on every name), which ``build_tiny_kimi_k25`` renames to the
published ``layers``; the tower's tensors are kept as ``save_pretrained`` writes them (transformers reads them back).

The text model has every part of K2.5's at this size (``miles.utils.tiny_mla``'s sizes): q LoRA, the latent norms,
YaRN (K2.5's factor 64, beta_fast 32, beta_slow 1, mscale 1 / 1, its original context scaled down to 8 positions so a
12-token row crosses it), rope theta 50000, routed scaling 2.827, random routers and score-correction biases (so
routing differs between tokens). ``rms_norm_eps`` defaults to 1e-6, the eps transformers gives the latent norms,
so Megatron (one eps for every norm) computes the same. The vision tower is one block of width 16. The tokenizer is
``miles.utils.tiny_model``'s; the image / video / vision start / end token ids are the 4 ids past it.
"""

from __future__ import annotations

from pathlib import Path

# Kimi-K2.5's yarn rope (Miles's scripts/models/kimi-k25.py: --rotary-scaling-factor 64, --beta-fast 32,
# --beta-slow 1, --mscale 1, --mscale-all-dim 1), its original context scaled down to 8 positions
KIMI_K25_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
TEXT_PREFIX = "language_model.model."        # the published checkpoint's text decoder (``model.*`` of DeepSeek-V3)
LM_HEAD = "language_model.lm_head.weight"
_SAVED_LAYERS = "language_model.model.blocks."   # transformers 5's save_pretrained name of the text layers


def published_name(name: str) -> str:
    """The published checkpoint's name of a tensor ``save_pretrained`` names (its text layers' ``blocks`` ->
    ``layers``); other names as they are."""
    return TEXT_PREFIX + "layers." + name[len(_SAVED_LAYERS):] if name.startswith(_SAVED_LAYERS) else name


def tiny_text_config(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                     q_lora_rank: int | None = 24, kv_lora_rank: int = 16, qk_nope_head_dim: int = 12,
                     qk_rope_head_dim: int = 8, v_head_dim: int = 10, intermediate_size: int = 96,
                     moe_intermediate_size: int = 24, n_routed_experts: int = 4, num_experts_per_tok: int = 2,
                     n_shared_experts: int = 1, first_k_dense_replace: int = 1, routed_scaling_factor: float = 2.827,
                     rms_norm_eps: float = 1e-6, rope_theta: float = 50000.0, rope_scaling: dict | None = KIMI_K25_YARN,
                     max_position_embeddings: int = 512, eos_token_id: int = 1, pad_token_id: int = 0) -> dict:
    """The ``text_config`` of the tiny Kimi-K2.5 (DeepSeek-V3's fields, K2.5's switches, tiny sizes)."""
    return dict(
        model_type="deepseek_v3", vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim, intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
        n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok, n_shared_experts=n_shared_experts,
        first_k_dense_replace=first_k_dense_replace, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=routed_scaling_factor, rms_norm_eps=rms_norm_eps, attention_bias=False,
        max_position_embeddings=max_position_embeddings, num_nextn_predict_layers=0, tie_word_embeddings=False,
        rope_parameters=dict(rope_scaling or {"rope_type": "default"}, rope_theta=rope_theta),
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


VISION_CONFIG = {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2,
                 "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                 "merge_kernel_size": [2, 2]}


def build_tiny_kimi_k25(out_dir: str | Path, *, seed: int = 0, dtype: str = "float32", **text_kwargs) -> Path:
    """Write a randomly initialised tiny Kimi-K2.5 (the published layout, see the module docstring) plus the tiny
    tokenizer to ``out_dir``; ``text_kwargs``: ``tiny_text_config``'s."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from miles.utils.tiny_model import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    n = len(tokenizer)
    text = tiny_text_config(n + 4, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **text_kwargs)
    config = Kimi_K25Config(text_config=text, vision_config=dict(VISION_CONFIG),
                            projection_hidden_size=VISION_CONFIG["hidden_size"], image_token_id=n,
                            video_token_id=n + 1, vision_start_token_id=n + 2, vision_end_token_id=n + 3,
                            tie_word_embeddings=False, dtype=dtype)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config)
    from miles.utils.tiny_mla import randomize_routers

    randomize_routers(model.model.language_model.layers)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    path = out / "model.safetensors"
    tensors = {published_name(k): v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    write_image_processor(out)
    return out


def write_image_processor(out: Path) -> None:
    """``preprocessor_config.json`` of the tiny MoonViT (its patch size, a 2 x 2 merge), as the published checkpoint ships
    one: transformers' ``Kimi_K25ImageProcessor``, written as JSON (the class itself imports torchvision, its only
    backend, which is not installed here: loading it needs torchvision)."""
    import json

    config = {"image_processor_type": "Kimi_K25ImageProcessor", "patch_size": VISION_CONFIG["patch_size"],
              "merge_size": 2, "size": {"max_height": 64, "max_width": 64}, "do_resize": True, "do_rescale": True,
              "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "do_convert_rgb": True}
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
