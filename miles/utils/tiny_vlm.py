"""Build a tiny Qwen3-VL model directory locally (no hub): for multimodal tests and examples.

    build_tiny_vlm("/tmp/vlm")   # Qwen3VLForConditionalGeneration, random init, + tokenizer + image processor

The directory has what a real Qwen3-VL checkpoint ships for images: ``config.json`` (``qwen3_vl``: a
2-layer vision tower with one deepstack layer, a 2-layer M-RoPE text model), safetensors weights, the
character-level tokenizer of :mod:`miles.utils.tiny_model` plus Qwen3-VL's vision special tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``), a chat template that
renders ``{"type": "image"}`` content items as Qwen3-VL's does, and ``preprocessor_config.json`` (the
Qwen2-VL image processor: patch 16, temporal patch 2, merge 2, images resized to 32x32..64x64 pixels,
so an image is 1 to 4 merged tokens).
"""

from __future__ import annotations

from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_ID_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")  # config.json
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_vlm_tokenizer(out_dir: str | Path | None = None, vision_ids: dict[str, int] | None = None):
    """The tiny character-level tokenizer with Qwen3-VL's vision tokens and a content-list chat template.
    ``vision_ids``: the vision tokens at these ids (a real checkpoint's config.json: ``vision_start_token_id``,
    ``vision_end_token_id``, ``image_token_id``, ``video_token_id``); else after the character ids."""
    from miles.utils.tiny_model import build_tokenizer

    if vision_ids is not None:
        tok = build_tokenizer(fixed_ids=dict(zip(VISION_TOKENS, (vision_ids[k] for k in VISION_ID_KEYS))))
    else:
        tok = build_tokenizer()
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def build_tiny_vlm(out_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, vision_hidden: int = 32,
                   vision_depth: int = 2, seed: int = 0, dtype: str = "float32", tie_word_embeddings: bool = True) -> Path:
    """Write a randomly initialised tiny Qwen3-VL (vision tower + M-RoPE text model), tokenizer and image
    processor to ``out_dir`` (``tie_word_embeddings=False``: with its own ``lm_head.weight``, as Qwen3-VL-8B)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_vlm_tokenizer(out)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(str(out))
    ids = dict(zip(VISION_ID_KEYS, tok.convert_tokens_to_ids(VISION_TOKENS)))
    heads = 4
    head_dim = hidden_size // heads
    third = head_dim // 2 // 3          # M-RoPE sections (t, h, w) over head_dim / 2 frequencies
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                          "mrope_section": [head_dim // 2 - 2 * third, third, third]},
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         dtype=dtype),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
                           num_heads=2, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=hidden_size, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        tie_word_embeddings=tie_word_embeddings, **ids)
    config.pad_token_id = tok.pad_token_id
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return out
