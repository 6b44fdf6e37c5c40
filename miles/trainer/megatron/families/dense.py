"""The families megatron-core's standard GPT layer builds as they are: Llama, Qwen2, Qwen3, Qwen3-MoE (``moe.py``'s
softmax router) and Qwen3-VL's text model (``vlm.py``). ``model.ModelShape``'s generic reader takes their config.json;
this module says only where they differ from each other: Qwen3's q/k norms and Qwen2's q/k/v biases."""

from __future__ import annotations

from miles.trainer.megatron.families import Family

MODEL_TYPES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "qwen3_vl": "Qwen3-VL"}
_QK_NORM = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text")   # qwen3_vl_text: the VLM's text_config


def attention_fields(c) -> dict:
    """q/k norms (the Qwen3 types) and q/k/v biases (Qwen2 always, others by ``attention_bias``)."""
    mt = c.model_type
    return {"qk_layernorm": mt in _QK_NORM, "qkv_bias": True if mt == "qwen2" else bool(getattr(c, "attention_bias", False))}


FAMILY = Family(name="dense", model_types=MODEL_TYPES, attention_fields=attention_fields)
