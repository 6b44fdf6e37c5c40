"""GLM-4.5 / GLM-4.5-Air (config.json ``model_type`` ``glm4_moe``) on megatron-core's standard GPT layer.

    shape = ModelShape.from_hf_config(Glm4MoeConfig)   # model.py's generic reader with this module's two hooks

GLM-4.5 is grouped-query attention (``num_key_value_heads`` < ``num_attention_heads``, ``head_dim`` 128) with q/k/v
biases (``attention_bias``), per-head q/k RMSNorms when ``use_qk_norm`` (GLM-4.5: true, GLM-4.5-Air: false), RoPE on
the first ``partial_rotary_factor`` (0.5) of each head, the rotary half not interleaved (transformers' GPT-NeoX
``rotate_half``; megatron-core's ``rotary_percent`` with ``rotary_interleaved`` false rotates the same dims), and
DeepSeek-V3's MoE: the first ``first_k_dense_replace`` layers dense, then a sigmoid router whose top-k is chosen on
``scores + e_score_correction_bias``, renormalised, scaled by ``routed_scaling_factor``, grouped when ``n_group`` > 1,
plus shared experts. Everything is megatron-core's own block:

- attention (``attention_fields``): ``qk_layernorm`` = ``use_qk_norm`` (megatron-core normalises each head's q and k
  after the projection, before RoPE, as transformers does), ``add_qkv_bias`` = ``attention_bias``,
  ``rotary_percent`` = ``partial_rotary_factor``; the weights are the generic ones of ``convert.py`` (``q/k/v_proj``
  with biases as ``linear_qkv``, ``q_norm`` / ``k_norm``, ``o_proj``).
- MoE: ``mla.py``'s DeepSeek-style reader, router configuration and names (``hf_moe_fields``, ``config_kwargs``:
  ``moe_router_score_function`` "sigmoid", ``moe_router_enable_expert_bias``, bias update rate 0, top-k scaling,
  group top-k; ``mlp.shared_experts.{gate,up,down}_proj`` = ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``;
  ``mlp.gate.e_score_correction_bias`` = ``mlp.router.expert_bias``, exported with the parameters). Those hooks
  leave standard attention alone: the MLA part of them runs only for a config with ``kv_lora_rank``.
- MTP: ``num_nextn_predict_layers`` (one in GLM-4.5's checkpoints, ``model.layers.{num_hidden_layers}.*``, DeepSeek-V3's
  layout: ``mtp.py``'s default), built with ``--mtp-num-layers``.
"""

from __future__ import annotations

from miles.trainer.megatron.families import Family, mla

MODEL_TYPES = {"glm4_moe": "GLM-4.5"}


def rotary_fraction(c) -> float:
    """``partial_rotary_factor`` (transformers 5 keeps it in ``rope_parameters``; GLM-4.5's config.json at the top;
    transformers' default for the type: 0.5)."""
    rope = getattr(c, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None) or 0.5))


def attention_fields(c) -> dict:
    """q/k norms by ``use_qk_norm``, q/k/v biases by ``attention_bias``, RoPE on ``partial_rotary_factor`` of a head."""
    return {"qk_layernorm": bool(getattr(c, "use_qk_norm", False)), "qkv_bias": bool(getattr(c, "attention_bias", False)),
            "rotary_percent": rotary_fraction(c)}


FAMILY = Family(
    name="glm4_moe", model_types=MODEL_TYPES, attention_fields=attention_fields, moe_fields=mla.hf_moe_fields,
    config_kwargs=mla.config_kwargs,
    hf_to_megatron=lambda suffix, prefix, hf, shape: mla.hf_to_megatron(suffix, prefix, hf, False),
    megatron_to_hf=lambda suffix, prefix, full, shape: mla.megatron_to_hf(suffix, prefix, full, False),
    column=(mla.SHARED_FC1,), row=mla.ROW, glu_fc1=(mla.SHARED_FC1,), exported_buffers=mla.exported_buffers)
