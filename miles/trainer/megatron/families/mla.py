"""Multi-Latent Attention (GLM-4.7-Flash ``glm4_moe_lite``, DeepSeek-V3 ``deepseek_v3``) on megatron-core, and the
DeepSeek-style MoE these models use.

    fields = hf_mla_fields(hf_config)       # ModelShape's MLA fields (empty for standard attention)
    check_mla_shape(cfg.megatron, shape)    # --kv-lora-rank 256 vs config.json's kv_lora_rank 512 -> ConfigError
    kw = config_kwargs(shape)               # MLATransformerConfig's arguments

Model: megatron-core's ``MLASelfAttention`` (``MLATransformerConfig``: ``q_lora_rank``, ``kv_lora_rank``,
``qk_head_dim`` = HF ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` = ``qk_rope_head_dim``, ``v_head_dim``;
``rope_type`` "rope", ``qk_layernorm`` = the latent norms) with replicated down projections (as its transformer-engine spec has them;
``adapt_local_spec`` says why the local spec's column-parallel ones are not used) and our SDPA core attention
(``MLACoreAttention``); under TP it needs ``--sequence-parallel``. megatron-core applies RoPE to the de-interleaved rotary dims of
q and k, which is HF's ``rope_interleave`` true (both configs' default; false is refused); the softmax scale is
``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``; DeepSeek-V3's yarn rope scaling is megatron-core's ``rope_type``
"yarn" with the same parameters (the same inverse-frequency ramp, cos/sin scale and softmax ``mscale``).
The latent norms take ``rms_norm_eps`` (megatron-core's and SGLang's choice; transformers uses 1e-6 there).

Context parallelism (``context_parallel.py``): ``MLASelfAttention`` computes its rotary angles itself (it takes no
position ids): for the whole row (its local length x CP, x TP under sequence parallelism), then keeps this CP rank's
load-balanced chunks (megatron-core's ``get_pos_emb_on_this_cp_rank``), the chunks ``context_parallel.shard_rows``
gave the rank; the core attention gets the CP group and ``--cp-comm-type`` and runs ``context_parallel.attention``
on keys ``qk_nope + qk_rope`` wide and values ``v_head_dim`` wide (a2a splits the heads, which MLA has as many of
for keys as for queries). Pipeline parallelism: each stage builds its own layers (the dense-first ones included)
from the stage's block spec, with its own rotary embedding; nothing MLA-specific crosses a stage.

Weights (HF names per layer ``model.layers.L.self_attn.``; megatron ``decoder.layers.L.self_attention.``), the
same rows in both (whole heads per TP rank: each up projection's rows are per head ``[nope; rope]`` or
``[nope; v]``), the up projections TP-split along dim 0 as megatron-core's column-parallel linears hold them,
the down projections and latent norms replicated:
``q_a_proj`` = ``linear_q_down_proj``, ``q_a_layernorm`` = ``q_layernorm`` (TE spec: ``linear_q_up_proj.
layer_norm_weight``), ``q_b_proj`` = ``linear_q_up_proj`` (``q_proj`` = ``linear_q_proj`` without q LoRA),
``kv_a_proj_with_mqa`` = ``linear_kv_down_proj``, ``kv_a_layernorm`` = ``kv_layernorm`` (TE: ``linear_kv_up_proj.
layer_norm_weight``), ``kv_b_proj`` = ``linear_kv_up_proj``, ``o_proj`` = ``linear_proj`` (row-parallel).

MoE (DeepSeek style): a sigmoid router whose top-k is chosen on ``scores + e_score_correction_bias`` (megatron-core's
``expert_bias`` buffer, loaded and exported as ``mlp.gate.e_score_correction_bias``, never updated here: the
Miles scripts pass ``--moe-router-bias-update-rate 0``), renormalised (``norm_topk_prob`` true) and scaled by
``routed_scaling_factor``; grouped top-k when ``n_group`` > 1 (megatron-core sums the top ``topk / topk_group``
scores of a group, HF the top 2: they must agree); shared experts (``mlp.shared_experts.{gate,up,down}_proj`` =
``mlp.shared_experts.linear_fc1`` as ``[gate; up]`` and ``linear_fc2``, TP-split like a dense MLP); the first
``first_k_dense_replace`` layers (``mlp_layer_types`` "dense") dense.
"""

from __future__ import annotations

import math

import torch

from miles.config.base import ConfigError
from miles.trainer.megatron.families import Family, yarn

MLA_FAMILIES = {"glm4_moe_lite": "GLM-4.7-Flash", **yarn.FAMILIES}   # yarn.py: DeepSeek-V3, Kimi-K2, JoyAI
_ATTN = {  # megatron suffix -> HF suffix, per layer (MLA attention)
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
COLUMN = ("linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight", SHARED_FC1)
ROW = ("mlp.shared_experts.linear_fc2.weight",)


# ------------------------------------------------------------------------------------------- shape
def is_mla_config(c) -> bool:
    return getattr(c, "model_type", None) in MLA_FAMILIES


def hf_mla_fields(c) -> dict:
    """``ModelShape``'s MLA fields (and ``kv_channels`` = ``qk_nope_head_dim``, as Miles's scripts pass
    ``--kv-channels``) from a HF config; empty for standard attention. ValueError for what is not supported."""
    if not is_mla_config(c):
        return {}
    if getattr(c, "rope_interleave", True) is False:
        raise ValueError("rope_interleave false (MLA rotary dims not interleaved) is not supported: megatron-core "
                         "rotates the interleaved layout of DeepSeek/GLM checkpoints.")
    if getattr(c, "attention_bias", False):
        raise ValueError("attention_bias true is not supported with multi-latent attention (megatron-core's MLA "
                         "projections have no bias).")
    rope = getattr(c, "rope_parameters", None) or {}
    yarn: tuple[float, ...] = ()
    if rope.get("rope_type") == "yarn":
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is False:
            raise ValueError(f"yarn rope parameters {rope} are not supported (attention_factor or truncate false).")
        yarn = (float(rope["factor"]), float(rope["original_max_position_embeddings"]),
                float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                float(rope.get("mscale") or 0.0), float(rope.get("mscale_all_dim") or 0.0))
    heads, kv_heads = int(c.num_attention_heads), int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    if kv_heads != heads:
        raise ValueError(f"num_key_value_heads {kv_heads} != num_attention_heads {heads} is not an MLA layout "
                         "megatron-core builds.")
    return {"q_lora_rank": int(c.q_lora_rank or 0), "kv_lora_rank": int(c.kv_lora_rank),
            "qk_head_dim": int(c.qk_nope_head_dim), "qk_pos_emb_head_dim": int(c.qk_rope_head_dim),
            "v_head_dim": int(c.v_head_dim), "kv_channels": int(c.qk_nope_head_dim), "qk_layernorm": True,
            "qkv_bias": False, "yarn": yarn}


def hf_moe_fields(c) -> dict:
    """``ModelShape``'s MoE fields of a DeepSeek-style MoE config (empty for a dense one)."""
    experts = int(getattr(c, "n_routed_experts", 0) or 0)
    if not experts:
        return {}
    n = int(c.num_hidden_layers)
    types = getattr(c, "mlp_layer_types", None)
    pattern = tuple(int(t == "sparse") for t in types[:n]) if types else tuple(
        int(i >= int(getattr(c, "first_k_dense_replace", 0) or 0)) for i in range(n))
    if not any(pattern):
        return {}
    if not getattr(c, "norm_topk_prob", True):
        raise ValueError("norm_topk_prob false with a sigmoid router is not supported (megatron-core renormalises "
                         "the top-k sigmoid scores).")
    topk, groups, group_topk = int(c.num_experts_per_tok), int(getattr(c, "n_group", 1) or 1), int(
        getattr(c, "topk_group", 1) or 1)
    if groups > 1 and topk // group_topk != 2:
        raise ValueError(f"n_group {groups} with num_experts_per_tok {topk} / topk_group {group_topk} != 2: HF scores "
                         "a group by its top 2 experts, megatron-core by its top num_experts_per_tok / topk_group.")
    return {"num_experts": experts, "moe_ffn_hidden_size": int(c.moe_intermediate_size), "moe_router_topk": topk,
            "moe_norm_topk_prob": True, "moe_layer_pattern": pattern,
            "moe_shared_ffn_hidden_size": int(c.moe_intermediate_size) * int(getattr(c, "n_shared_experts", 0) or 0),
            "moe_score_function": "sigmoid", "moe_expert_bias": True,
            "moe_topk_scaling": float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
            "moe_num_groups": groups if groups > 1 else 0, "moe_group_topk": group_topk if groups > 1 else 0}


# ------------------------------------------------------------------------------------------- flags
def _mismatch(name: str, value, key: str, config_value) -> ConfigError:
    return ConfigError(f"{name} {value} does not match --hf-checkpoint's config.json ({key} {config_value}): fix "
                       f"the flag or drop it (the model shape is read from config.json).")


MLA_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def check_mla_shape(m, shape) -> None:
    """``--multi-latent-attention`` and the MLA dims agree with config.json (one line naming flag, value and key)."""
    if m is None:
        return
    own = shape.family.fork_flags(shape)     # read in Miles's fork's spelling by the family (DeepSeek-V4): its check
    given = [f"--{d.replace('_', '-')}" for d in ("multi_latent_attention",) + MLA_FLAGS
             if getattr(m, d, None) not in (None, False) and d not in own]
    if not shape.mla:
        if given:
            raise ConfigError(f"{given[0]} is given but --hf-checkpoint's config.json describes standard attention "
                              f"(model_type {shape.model_type}, no kv_lora_rank): drop the MLA flags or use an MLA "
                              "checkpoint (GLM-4.7-Flash, DeepSeek-V3).")
        return
    for dest, key, cv in (("q_lora_rank", "q_lora_rank", shape.q_lora_rank or None),
                          ("kv_lora_rank", "kv_lora_rank", shape.kv_lora_rank),
                          ("qk_head_dim", "qk_nope_head_dim", shape.qk_head_dim),
                          ("qk_pos_emb_head_dim", "qk_rope_head_dim", shape.qk_pos_emb_head_dim),
                          ("v_head_dim", "v_head_dim", shape.v_head_dim)):
        v = getattr(m, dest, None)
        if v is not None and (cv is None or int(v) != int(cv)):
            raise _mismatch(f"--{dest.replace('_', '-')}", v, key, cv)
    if m.num_layers is not None and not m.multi_latent_attention:
        raise ConfigError("--multi-latent-attention is missing but --hf-checkpoint's config.json has kv_lora_rank "
                          f"{shape.kv_lora_rank} (MLA): add --multi-latent-attention (with --num-layers the Megatron "
                          "shape flags must describe the model fully), or drop the shape flags.")


# ------------------------------------------------------------------------------------------- model
def config_kwargs(shape) -> dict:
    """``MLATransformerConfig`` arguments (MLA) and the DeepSeek-style router's ``TransformerConfig`` ones."""
    kw: dict = {}
    if shape.mla:
        kw.update(multi_latent_attention=True, q_lora_rank=shape.q_lora_rank or None, kv_lora_rank=shape.kv_lora_rank,
                  qk_head_dim=shape.qk_head_dim, qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim,
                  v_head_dim=shape.v_head_dim, rope_type="rope", rotary_base=shape.rotary_base,
                  rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        if shape.yarn:         # HF's yarn: the same inv_freq ramp, cos/sin and softmax mscale (truncated range)
            factor, original, fast, slow, mscale, mscale_all = shape.yarn
            kw.update(rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=int(original),
                      beta_fast=fast, beta_slow=slow, mscale=mscale, mscale_all_dim=mscale_all)
    if shape.num_experts and shape.moe_score_function == "sigmoid":
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=shape.moe_expert_bias,
                  moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=shape.moe_topk_scaling,
                  moe_router_pre_softmax=False)
        if shape.moe_shared_ffn_hidden_size:
            kw.update(moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size)
        if shape.moe_num_groups:
            kw.update(moe_router_num_groups=shape.moe_num_groups, moe_router_group_topk=shape.moe_group_topk)
    return kw


def adapt_local_spec(spec, core_attention=None) -> None:
    """Every MLA layer of the local ``spec`` (a layer spec or a block spec): replicated down projections, as the
    transformer-engine spec has them (``TELinear`` duplicated), and ``core_attention`` when given.

    The local spec's column-parallel down projections are wrong under TP in megatron-core 0.16: the shared RoPE
    key ``k_pos_emb`` is cut from their gathered output, each TP rank's heads give it a partial gradient, and
    the gather's backward keeps that partial slice (the other ranks' heads are lost). With a replicated
    ``Linear`` megatron-core gathers ``k_pos_emb`` from the sequence-parallel region instead, whose backward sums
    the ranks' parts; the weights' gradients (each rank's part of the sequence) are summed over TP like the other
    sequence-parallel parameters (``sequence_parallel`` set by the ``Linear``). Without sequence parallelism
    nothing sums them: MLA under TP needs ``--sequence-parallel`` (``check_mla_static``)."""
    from megatron.core.post_training.modelopt.layers import Linear

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        sub = layer.submodules.self_attention.submodules
        sub.linear_q_down_proj = sub.linear_kv_down_proj = Linear
        if core_attention is not None:
            sub.core_attention = core_attention


def mla_core_attention():
    """Our SDPA core attention with megatron-core's MLA constructor (separate key and value head dims)."""
    from miles.trainer.megatron.model import SDPACoreAttention

    class MLACoreAttention(SDPACoreAttention):
        """``SDPACoreAttention`` for MLA: keys of ``qk_head_dim + qk_pos_emb_head_dim``, values of ``v_head_dim``
        (SDPA takes different widths); megatron-core hands it the softmax scale."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                     pg_collection=None):
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                             softmax_scale or (1.0 / math.sqrt(k_channels) if k_channels else None), cp_comm_type,
                             pg_collection)

    return MLACoreAttention


# ------------------------------------------------------------------------------------------- names
def hf_name(suffix: str, is_mla: bool) -> str | None:
    """The HF suffix (per layer) of a megatron MLA (only when ``is_mla``: ``q_layernorm`` is Qwen3's ``q_norm``
    otherwise) / shared-expert / expert-bias suffix, else None."""
    if not is_mla and suffix.startswith("self_attention."):
        return None
    return _ATTN.get(suffix)


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], is_mla: bool) -> torch.Tensor | None:
    """The full megatron tensor of a layer suffix from a HF state dict (None: not an MLA/shared-expert name)."""
    if (name := hf_name(suffix, is_mla)) is not None:
        return hf[prefix + name]
    if suffix == SHARED_FC1:
        return torch.cat([hf[prefix + "mlp.shared_experts.gate_proj.weight"],
                          hf[prefix + "mlp.shared_experts.up_proj.weight"]], dim=0)
    return None


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor,
                   is_mla: bool) -> list[tuple[str, torch.Tensor]] | None:
    if (name := hf_name(suffix, is_mla)) is not None:
        return [(prefix + name, full)]
    if suffix == SHARED_FC1:
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.shared_experts.gate_proj.weight", gate), (prefix + "mlp.shared_experts.up_proj.weight",
                                                                         up)]
    return None


def exported_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers exported with the parameters: each router's ``expert_bias`` (HF ``e_score_correction_bias``)."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith(".mlp.router.expert_bias")]


def apply_mla_compat() -> None:
    """megatron-core 0.16's ``multi_latent_attention`` imports its transformer-engine names from
    ``megatron.core.extensions.transformer_engine``, which imports without transformer-engine and leaves them None,
    so ``HAVE_TE`` is true and ``isinstance(..., TELinear)`` raises; without those classes it is set false (the
    local spec's linears need none of them). Idempotent."""
    from megatron.core.transformer import multi_latent_attention as m

    if m.HAVE_TE and not isinstance(m.TELinear, type):
        m.HAVE_TE = False


def apply_mla_cpu_compat() -> None:
    """megatron-core 0.16's yarn rotary embedding (DeepSeek-V3) allocates on ``torch.cuda.current_device()`` and,
    under context parallelism, selects this CP rank's chunks with an index pinned and moved to CUDA (the
    ``get_pos_emb_on_this_cp_rank`` it imported by name); on CPU it sees ``"cpu"`` there and selects on the
    embedding's device, as ``compat.apply_cpu_compat`` does for the other rotary embedding. Idempotent."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as y

    from miles.trainer.megatron import compat

    if not isinstance(y.torch, compat._CpuTorch):
        y.torch = compat._CpuTorch("torch")
    y.get_pos_emb_on_this_cp_rank = compat._cpu_pos_emb_on_this_cp_rank


def check_mla_static(o, shape) -> None:
    """The MLA values this build does not run (``o``: ``options.Options``): one line each."""
    if not shape.mla:
        return
    if o.tp > 1 and not o.sequence_parallel:
        raise ConfigError(f"--tensor-model-parallel-size {o.tp} with multi-latent attention needs --sequence-parallel "
                          "(the shared RoPE key's gradient is summed over TP through the sequence-parallel region): "
                          "add it.")
    for what, n in (("q_lora_rank", shape.q_lora_rank),
                    ("kv_lora_rank + qk_rope_head_dim", shape.kv_lora_rank + shape.qk_pos_emb_head_dim),
                    ("moe_intermediate_size x n_shared_experts", shape.moe_shared_ffn_hidden_size)):
        if n and n % o.tp:
            raise ConfigError(f"--tensor-model-parallel-size {o.tp} does not divide config.json's {what} {n} "
                              "(megatron-core splits the MLA down projections and the shared experts over TP); "
                              "choose a TP size that divides it.")


# ------------------------------------------------------------------------------------------- family
def _prepare(device: torch.device) -> None:
    apply_mla_compat()
    if device.type != "cuda":
        apply_mla_cpu_compat()


def _check_flags(m, shape) -> None:
    check_mla_shape(m, shape)          # --multi-latent-attention, --q/kv-lora-rank, ...
    yarn.check_rope_flags(m, shape)    # --rope-type, --rotary-scaling-factor, --mscale, ... (yarn.py)


FAMILY = Family(
    name="mla", model_types=MLA_FAMILIES, attention_fields=hf_mla_fields, moe_fields=hf_moe_fields,
    rope_types=("default", "yarn"), config_kwargs=config_kwargs, prepare=_prepare,
    core_attention=lambda shape: mla_core_attention(), adapt_local_spec=adapt_local_spec,
    hf_to_megatron=lambda suffix, prefix, hf, shape: hf_to_megatron(suffix, prefix, hf, True),
    megatron_to_hf=lambda suffix, prefix, full, shape: megatron_to_hf(suffix, prefix, full, True),
    column=COLUMN, row=ROW, glu_fc1=(SHARED_FC1,), exported_buffers=exported_buffers, check_flags=_check_flags,
    check_static=check_mla_static)
