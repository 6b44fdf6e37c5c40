"""The Qwen3-Next / Qwen3.5 / Qwen3.6 family on megatron-core: hybrid layers of gated DeltaNet (linear attention) and
gated full attention, MoE with a gated shared expert.

    fields = shape_fields(hf_config)              # ModelShape's fields; variant: HybridShape (ValueError: not built)
    hf = hf_state(hf, shape)                      # mtp.* and fused experts under the names convert.py reads
    kw = config_kwargs(shape)                     # TransformerConfig arguments of the family
    spec = decoder_block_spec(config, shape, shape.variant)   # per layer: GDN or gated attention, MoE or MLP
    FAMILY                                        # the registry's hooks (families/__init__.py)

Miles selects these models with ``--spec miles_plugins.models.qwen3_5 get_qwen3_5_spec`` (Qwen3.5 / 3.6: config.json
``qwen3_5_moe`` or ``qwen3_5`` with a ``text_config``) and ``--spec miles_plugins.models.qwen3_next
get_qwen3_next_spec`` (``qwen3_next``); radixark/miles@v0.1.0:miles_plugins/models/qwen3_5.py puts transformers'
own DeltaNet module (on fla's kernels) in the linear layers' attention slot and megatron-core's attention with
``--attention-output-gate`` in the others. Here every block is megatron-core's:

- layer pattern: config.json's ``layer_types`` (else every ``full_attention_interval``-th layer is full attention),
  read per layer with the pipeline stage's offset (``decoder_block_spec``). megatron-core's
  ``experimental_attention_variant`` is left unset: it only selects megatron-core's own (transformer-engine) spec,
  and it refuses context parallelism, which this build runs (``gated_delta.py``).
- linear layers: megatron-core's ``GatedDeltaNet`` (``megatron.core.ssm.gated_delta_net``) as
  ``gated_delta.GatedDeltaNetLayer``: its parameters (``in_proj`` = [q; k; v; z; beta; alpha] rows per TP rank,
  ``conv1d`` depthwise over [q; k; v], ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``), its TP split and its
  distributed-checkpoint layout, with the gated delta rule and the causal conv in torch on CPU (fla and
  causal_conv1d are GPU-only; on a GPU with fla the layer calls fla's kernel). ``out_norm`` is the gated RMSNorm of
  transformers (plain ``w``, normalised in fp32, times ``silu(z)``). The input norm is the layer's
  ``input_layernorm`` (the local spec keeps it unfused).
- full-attention layers: megatron-core's ``SelfAttention`` with ``attention_output_gate`` (``linear_qkv`` per
  query group = [its query heads; their gates; key; value], ``sigmoid(gate)`` times the attention output before
  ``linear_proj``), q/k RMSNorms, rotary on the first ``partial_rotary_factor`` of each head (``rotary_percent``),
  torch SDPA as core attention.
- norms: transformers' ``(1 + w)`` RMSNorm (``Qwen3NextRMSNorm``: fp32, ``x * (1 + w)``, weights stored centred on
  0) for the input, pre-MLP, final and q/k norms: ``ZeroCenteredRMSNorm`` (megatron-core's
  ``layernorm_zero_centered_gamma`` is the same map but its torch norm refuses it), so weights move unchanged.
- MoE: megatron-core's softmax top-k router (``norm_topk_prob``), experts, and shared expert with
  ``moe_shared_expert_gate`` (``sigmoid(x . gate_weight)`` scales the shared expert's output); dense Qwen3.5
  models (``qwen3_5``) have a SwiGLU MLP per layer.
- MTP (config.json's ``mtp_num_hidden_layers``, ``--mtp-num-layers 1``): megatron-core's MTP layer (``mtp.py``) like
  the decoder's last layer (a full-attention one; otherwise refused), its ``enorm`` / ``hnorm`` / final norm the
  family's (1 + w) norms (``adapt_mtp_spec``). The checkpoint's ``mtp.fc`` / ``mtp.pre_fc_norm_embedding`` /
  ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` / ``mtp.layers.0.*`` are read as ``mtp.py`` reads DeepSeek-V3's
  (``hf_state``) and exported under their own names again (``export_stream``); engines skip them.
- context parallelism: the attention layers as every family's (``context_parallel.py``); a DeltaNet layer
  all-gathers its input projection over the CP group and runs the whole sequence (``gated_delta.py``).
- LoRA: the DeltaNet's ``in_proj`` (column-parallel, its TP sections as the weight's) and ``out_proj`` (row-parallel)
  are targets (``lora_targets``; Miles's Qwen3.5 recipe names them), merged and exported as the weights are;
  ``--target-modules`` paths are matched under ``language_model.`` for a Qwen3.5 (VL) checkpoint, as Megatron-Bridge
  names its modules (``lora_path_prefix``).

Weights (HF suffix under ``model.layers.L.``; a Qwen3.5 VLM checkpoint's text model is under
``model.language_model.``, read and exported there: ``text_prefix``, its vision tower neither trained nor exported,
copied by ``--save-hf``): Qwen3.5's ``linear_attn.in_proj_qkv`` [q_all; k_all; v_all], ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` stack into ``self_attention.in_proj.weight``; Qwen3-Next's ``in_proj_qkvz`` /
``in_proj_ba`` hold them grouped per key head ([q_g, k_g, v_g, z_g] rows per group) and are regrouped; ``conv1d``,
``A_log``, ``dt_bias``, ``norm`` (-> ``out_norm``), ``out_proj`` map one to one. ``self_attn.q_proj`` holds per head
[query; gate] rows and is regrouped into ``linear_qkv`` with k and v. Shared experts: ``mlp.shared_expert.*`` ->
``mlp.shared_experts.linear_fc1`` ([gate; up]) / ``linear_fc2``, ``mlp.shared_expert_gate.weight`` ->
``mlp.shared_experts.gate_weight``. Every map is a permutation of rows, so the round trip is bitwise. Under TP,
``in_proj`` and ``conv1d`` are split per section (``tp_sections``): rank r holds the r-th slice of each of q, k, v
(z, beta, alpha).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from miles.trainer.megatron.families import Family

FAMILIES = {"qwen3_next": "Qwen3-Next", "qwen3_5_moe": "Qwen3.5-MoE", "qwen3_5_moe_text": "Qwen3.5-MoE",
            "qwen3_5": "Qwen3.5", "qwen3_5_text": "Qwen3.5"}
_QWEN35 = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
IN_PROJ = "self_attention.in_proj.weight"
CONV = "self_attention.conv1d.weight"
_OWN = {  # megatron suffix -> HF suffix, per layer (one to one)
    "self_attention.A_log": "linear_attn.A_log",
    "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.out_norm.weight": "linear_attn.norm.weight",
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
    CONV: "linear_attn.conv1d.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
COLUMN = (IN_PROJ, CONV, "self_attention.A_log", "self_attention.dt_bias", SHARED_FC1)   # TP split on dim 0 ...
ROW = ("self_attention.out_proj.weight", "mlp.shared_experts.linear_fc2.weight")        # ... and on dim 1


@dataclass(frozen=True)
class HybridShape:
    linear_layers: tuple[int, ...]      # 1 per gated-DeltaNet layer, 0 per full-attention one
    conv_kernel: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    rotary_percent: float               # partial_rotary_factor
    fused_qkvz: bool                    # Qwen3-Next's grouped in_proj_qkvz / in_proj_ba (else Qwen3.5's split ones)
    shared_expert_gate: bool
    mtp_layers: int                     # the checkpoint's MTP layers (mtp_num_hidden_layers; not built)

    @property
    def qk_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.value_heads * self.value_head_dim


def is_hybrid_config(c) -> bool:
    return getattr(c, "model_type", None) in FAMILIES


def text_config(c):
    """The language model's config (a Qwen3.5 VLM's ``text_config``; else ``c``)."""
    return getattr(c, "text_config", None) or c


# ------------------------------------------------------------------------------------------- shape
def hybrid_shape(c) -> HybridShape:
    """What the family adds to ``ModelShape`` (ValueError, one line, for a config it does not build)."""
    mt = c.model_type
    t = text_config(c)
    n = int(t.num_hidden_layers)
    types = list(getattr(t, "layer_types", None) or [])
    if not types:
        interval = int(getattr(t, "full_attention_interval", 4) or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    bad = sorted({x for x in types if x not in ("linear_attention", "full_attention")})
    if bad or len(types) != n:
        raise ValueError(f"{mt} layer_types {bad or types} not supported (linear_attention / full_attention, one per "
                         "layer).")
    if getattr(t, "hidden_act", "silu") != "silu":
        raise ValueError(f"{mt}: hidden_act {t.hidden_act!r} is not supported (silu only).")
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{mt}: rope_type {rope.get('rope_type')!r} is not supported (default only).")
    if rope.get("mrope_section") and rope.get("mrope_interleaved") is False:
        raise ValueError(f"{mt}: non-interleaved M-RoPE is not supported.")
    nk, nv = int(t.linear_num_key_heads), int(t.linear_num_value_heads)
    if nv % nk:
        raise ValueError(f"{mt}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}.")
    return HybridShape(
        linear_layers=tuple(int(x == "linear_attention") for x in types), conv_kernel=int(t.linear_conv_kernel_dim),
        key_heads=nk, value_heads=nv, key_head_dim=int(t.linear_key_head_dim),
        value_head_dim=int(t.linear_value_head_dim),
        rotary_percent=float(rope.get("partial_rotary_factor", getattr(t, "partial_rotary_factor", 1.0))),
        fused_qkvz=mt == "qwen3_next", shared_expert_gate=bool(getattr(t, "num_experts", 0) or 0),
        mtp_layers=int(getattr(t, "mtp_num_hidden_layers", 0) or 0))


def shape_fields(c) -> dict:
    """``ModelShape``'s fields of a Qwen3-Next / Qwen3.5 config.json."""
    t = text_config(c)
    n = int(t.num_hidden_layers)
    heads = int(t.num_attention_heads)
    rope = dict(getattr(t, "rope_parameters", None) or {})
    experts = int(getattr(t, "num_experts", 0) or 0)
    fields = dict(
        model_type=c.model_type, num_layers=n, hidden_size=int(t.hidden_size),
        ffn_hidden_size=int(getattr(t, "intermediate_size", None) or getattr(t, "moe_intermediate_size", 0) or 0),
        num_attention_heads=heads, num_query_groups=int(getattr(t, "num_key_value_heads", None) or heads),
        kv_channels=int(getattr(t, "head_dim", None) or int(t.hidden_size) // heads), vocab_size=int(t.vocab_size),
        max_position_embeddings=int(t.max_position_embeddings),
        rotary_base=float(rope.get("rope_theta", getattr(t, "rope_theta", None) or 10000.0)),
        norm_epsilon=float(t.rms_norm_eps), qk_layernorm=True, qkv_bias=bool(getattr(t, "attention_bias", False)),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)), variant=hybrid_shape(c),
        nextn_layers=int(getattr(t, "mtp_num_hidden_layers", 0) or 0))
    fields["rotary_percent"] = fields["variant"].rotary_percent
    if experts:
        dense = set(getattr(t, "mlp_only_layers", None) or [])
        step = int(getattr(t, "decoder_sparse_step", 1) or 1)
        fields.update(num_experts=experts, moe_ffn_hidden_size=int(t.moe_intermediate_size),
                      moe_router_topk=int(t.num_experts_per_tok),
                      moe_norm_topk_prob=bool(getattr(t, "norm_topk_prob", True)),
                      moe_layer_pattern=tuple(int(i not in dense and (i + 1) % step == 0) for i in range(n)),
                      moe_shared_ffn_hidden_size=int(getattr(t, "shared_expert_intermediate_size", 0) or 0))
    return fields


# ------------------------------------------------------------------------------------------- flags
_SWITCHES = (("--attention-output-gate", "attention_output_gate", "q_proj's output gates"),
             ("--apply-layernorm-1p", "apply_layernorm_1p", "(1 + w) RMSNorms"),
             ("--moe-shared-expert-gate", "moe_shared_expert_gate", "mlp.shared_expert_gate"))


def check_flags(m, shape) -> None:
    """``--attention-output-gate``, ``--apply-layernorm-1p``, ``--moe-shared-expert-gate`` against config.json: what a
    Qwen3-Next / Qwen3.5 checkpoint has (refused on another family; with ``--num-layers`` the shape flags describe
    the model fully, so they are required here, as Miles's scripts pass them)."""
    from miles.config.base import ConfigError

    if m is None:
        return
    mine = isinstance(shape.variant, HybridShape)
    for flag, dest, what in _SWITCHES:
        given = bool(getattr(m, dest, False))
        present = mine and (dest != "moe_shared_expert_gate" or shape.variant.shared_expert_gate)
        if given and not present:
            raise ConfigError(f"{flag} does not match --hf-checkpoint's config.json (model_type {shape.model_type}: no "
                              f"{what}): drop the flag (the model shape is read from config.json).")
        if present and not given and m.num_layers is not None:
            raise ConfigError(f"{flag} is missing but --hf-checkpoint's config.json is {FAMILIES[shape.model_type]} "
                              f"({what}): add {flag} (with --num-layers the Megatron shape flags must describe the "
                              "model fully), or drop the shape flags.")


def check_static(o, shape) -> None:
    """What the build does not run (``o``: ``options.Options``)."""
    from miles.config.base import ConfigError

    h = shape.variant
    if h.key_heads % o.tp or h.value_heads % o.tp:
        raise ConfigError(f"--tensor-model-parallel-size {o.tp} does not divide the gated DeltaNet's heads "
                          f"(linear_num_key_heads {h.key_heads}, linear_num_value_heads {h.value_heads}): use a TP size "
                          "dividing both.")
    if o.mtp_num_layers and not (o.mtp_num_layers == 1 and not shape.variant.linear_layers[-1]):
        raise ConfigError(f"--mtp-num-layers {o.mtp_num_layers}: the Megatron backend builds Qwen3-Next / Qwen3.5's "
                          "MTP layer as one megatron-core MTP layer like the decoder's last (a full-attention layer); "
                          "use --mtp-num-layers 1 with such a checkpoint, or drop it.")


# ------------------------------------------------------------------------------------------- model
def config_kwargs(shape) -> dict:
    """TransformerConfig arguments of the family."""
    hybrid = shape.variant
    kw = dict(attention_output_gate=True, linear_conv_kernel_dim=hybrid.conv_kernel,
              linear_key_head_dim=hybrid.key_head_dim, linear_value_head_dim=hybrid.value_head_dim,
              linear_num_key_heads=hybrid.key_heads, linear_num_value_heads=hybrid.value_heads)
    if shape.num_experts and shape.moe_shared_ffn_hidden_size:
        kw.update(moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size,
                  moe_shared_expert_gate=hybrid.shared_expert_gate)
    return kw


class ZeroCenteredRMSNorm(torch.nn.Module):
    """transformers' ``Qwen3NextRMSNorm``: ``rmsnorm(x) * (1 + w)`` in fp32, cast back to x's dtype; ``w`` starts at 0.
    The constructor is megatron-core's norm's (``WrappedTorchNorm``), its weight marked ``sequence_parallel`` under
    --sequence-parallel as ``model.SequenceParallelNorm``'s."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _swap(obj, old, new, seen: set[int]):
    """``obj`` (a spec: nested dataclasses and lists) with every reference to ``old`` replaced by ``new``."""
    import dataclasses

    if obj is old:
        return new
    if isinstance(obj, list):
        return [_swap(o, old, new, seen) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and id(obj) not in seen:
        seen.add(id(obj))
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _swap(getattr(obj, f.name), old, new, seen))
    return obj


def gdn_spec():
    """The linear layers' attention: megatron-core's GatedDeltaNet on the local spec's linears."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from miles.trainer.megatron.gated_delta import GatedDeltaNetLayer, GatedRMSNorm

    return ModuleSpec(module=GatedDeltaNetLayer, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear))


def decoder_block_spec(config, shape, hybrid: HybridShape, *, core_attention=None, vp_stage: int | None = None):
    """This pipeline stage's layer specs: GatedDeltaNet (``hybrid.linear_layers``) or gated self-attention with
    ``core_attention``, MoE or MLP per ``shape.moe_layer_pattern``, ``ZeroCenteredRMSNorm`` for every norm but the
    DeltaNet's gated one (local spec: the norms and the DeltaNet's input norm are torch modules on CPU and GPU)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                      vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = []
    for i, layer in enumerate(spec.layer_specs):
        layer = copy.deepcopy(layer)              # megatron-core shares one spec object between layers
        if hybrid.linear_layers[offset + i]:
            layer.submodules.self_attention = gdn_spec()
        elif core_attention is not None:
            layer.submodules.self_attention.submodules.core_attention = core_attention
        layers.append(layer)
    spec.layer_specs = layers
    return _swap(spec, WrappedTorchNorm, ZeroCenteredRMSNorm, set())


# ------------------------------------------------------------------------------------------- names
def tp_sections(suffix: str, hybrid: HybridShape) -> list[int] | None:
    """Row sections of a full tensor that TP splits one by one (rank r: the r-th slice of each), else None."""
    if suffix.endswith(IN_PROJ):
        return [hybrid.qk_dim, hybrid.qk_dim, hybrid.v_dim, hybrid.v_dim, hybrid.value_heads, hybrid.value_heads]
    if suffix.endswith(CONV):
        return [hybrid.qk_dim, hybrid.qk_dim, hybrid.v_dim]
    return None


def shard(full: torch.Tensor, sections: list[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.cat([part.chunk(tp_size, dim=0)[tp_rank] for part in full.split(sections, dim=0)], dim=0)


def unshard(shards: list[torch.Tensor], sections: list[int]) -> torch.Tensor:
    tp = len(shards)
    pieces = [s.split([n // tp for n in sections], dim=0) for s in shards]
    return torch.cat([pieces[r][j] for j in range(len(sections)) for r in range(tp)], dim=0)


def _grouped(hybrid: HybridShape) -> tuple[int, list[int], list[int]]:
    """Qwen3-Next's per-key-head group: (groups, [q, k, v, z] rows, [b, a] rows)."""
    r = hybrid.value_heads // hybrid.key_heads
    return (hybrid.key_heads, [hybrid.key_head_dim, hybrid.key_head_dim, r * hybrid.value_head_dim,
                               r * hybrid.value_head_dim], [r, r])


def _gated_q_split(shape) -> tuple[int, int, int]:
    return shape.num_attention_heads // shape.num_query_groups, shape.kv_channels, shape.num_query_groups


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], shape, hybrid: HybridShape
                   ) -> torch.Tensor | None:
    """The full megatron tensor of layer parameter ``suffix`` (``prefix``: 'model.layers.L.'); None: not the
    family's own name."""
    if suffix in _OWN:
        return hf[prefix + _OWN[suffix]]
    if suffix == IN_PROJ:
        a = prefix + "linear_attn."
        if not hybrid.fused_qkvz:
            return torch.cat([hf[a + "in_proj_qkv.weight"], hf[a + "in_proj_z.weight"], hf[a + "in_proj_b.weight"],
                              hf[a + "in_proj_a.weight"]], dim=0)
        groups, qkvz, ba = _grouped(hybrid)
        w, h = hf[a + "in_proj_qkvz.weight"], hf[a + "in_proj_qkvz.weight"].shape[-1]
        q, k, v, z = (t.reshape(-1, h) for t in w.reshape(groups, sum(qkvz), h).split(qkvz, dim=1))
        b, al = (t.reshape(-1, h) for t in hf[a + "in_proj_ba.weight"].reshape(groups, sum(ba), h).split(ba, dim=1))
        return torch.cat([q, k, v, z, b, al], dim=0)
    if suffix == "self_attention.linear_qkv.weight":             # per group: [q heads; gates; k; v]
        per, d, ng = _gated_q_split(shape)
        qp = hf[prefix + "self_attn.q_proj.weight"]
        h = qp.shape[-1]
        qg = qp.reshape(ng, per, 2, d, h)
        k = hf[prefix + "self_attn.k_proj.weight"].reshape(ng, d, h)
        v = hf[prefix + "self_attn.v_proj.weight"].reshape(ng, d, h)
        return torch.cat([qg[:, :, 0].reshape(ng, per * d, h), qg[:, :, 1].reshape(ng, per * d, h), k, v],
                         dim=1).reshape(-1, h)
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return torch.cat([hf[prefix + "mlp.shared_expert.gate_proj.weight"],
                          hf[prefix + "mlp.shared_expert.up_proj.weight"]], dim=0)
    return None


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor, shape, hybrid: HybridShape
                   ) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of a full megatron layer tensor; None: not the family's own name."""
    if suffix in _OWN:
        return [(prefix + _OWN[suffix], full)]
    if suffix == IN_PROJ:
        a = prefix + "linear_attn."
        q, k, v, z, b, al = full.split(tp_sections(IN_PROJ, hybrid), dim=0)
        if not hybrid.fused_qkvz:
            return [(a + "in_proj_qkv.weight", torch.cat([q, k, v], dim=0)), (a + "in_proj_z.weight", z),
                    (a + "in_proj_b.weight", b), (a + "in_proj_a.weight", al)]
        groups, _, _ = _grouped(hybrid)
        h = full.shape[-1]
        qkvz = torch.cat([t.reshape(groups, -1, h) for t in (q, k, v, z)], dim=1).reshape(-1, h)
        ba = torch.cat([t.reshape(groups, -1, h) for t in (b, al)], dim=1).reshape(-1, h)
        return [(a + "in_proj_qkvz.weight", qkvz), (a + "in_proj_ba.weight", ba)]
    if suffix == "self_attention.linear_qkv.weight":
        per, d, ng = _gated_q_split(shape)
        h = full.shape[-1]
        q, g, k, v = full.reshape(ng, 2 * per * d + 2 * d, h).split([per * d, per * d, d, d], dim=1)
        qp = torch.stack([q.reshape(ng, per, d, h), g.reshape(ng, per, d, h)], dim=2).reshape(-1, h)
        return [(prefix + "self_attn.q_proj.weight", qp), (prefix + "self_attn.k_proj.weight", k.reshape(-1, h)),
                (prefix + "self_attn.v_proj.weight", v.reshape(-1, h))]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.shared_expert.gate_proj.weight", gate), (prefix + "mlp.shared_expert.up_proj.weight", up)]
    return None


# ------------------------------------------------------------------------------------------- MTP and fused experts
_MTP_OWN = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
            "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head.norm.weight"}
_MTP_BACK = {v: k for k, v in _MTP_OWN.items()}
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_LM = "model.language_model."                     # the published Qwen3.5 layout's text model


def hf_state(hf: dict, shape) -> dict:
    """The checkpoint's tensors under the names ``convert.py`` and ``mtp.py`` read: a published Qwen3.5
    checkpoint's text model (``model.language_model.*``) under transformers' causal-LM names (``model.*``; exported
    under its own again, ``text_prefix``; its ``model.visual.*`` tower left out), the MTP layer
    (``mtp.fc`` = ``eh_proj`` over [embedding; hidden], ``mtp.pre_fc_norm_embedding`` / ``_hidden`` = ``enorm`` /
    ``hnorm``, ``mtp.norm`` = the final norm, ``mtp.layers.k.*`` = a decoder layer) as DeepSeek-V3 keeps it
    (``model.layers.{num_layers + k}.*``), and fused experts (``mlp.experts.gate_up_proj`` [E, 2I, H] with gate rows
    first, ``down_proj`` [E, H, I]: the published Qwen3.5 checkpoints') as one tensor per expert (slices: bitwise)."""
    if not any(k.startswith(("mtp.", _LM)) or k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
               for k in hf):
        return hf
    n = shape.num_layers
    out = {}
    for k, t in hf.items():
        if k.startswith("model.visual."):          # a Qwen3.5 checkpoint's vision tower: not trained here
            continue
        if k.startswith(_LM):                      # its text model, under transformers' causal-LM names
            k = "model." + k[len(_LM):]
        if k in _MTP_OWN:
            k = f"model.layers.{n}.{_MTP_OWN[k]}"
        elif k.startswith("mtp.layers."):
            layer, _, rest = k[len("mtp.layers."):].partition(".")
            k = f"model.layers.{n + int(layer)}.{rest}"
        if k.endswith(".mlp.experts.gate_up_proj"):
            base = k[:-len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif k.endswith(".mlp.experts.down_proj"):
            base = k[:-len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[k] = t
    return out


def text_prefix(shape) -> str | None:
    """A Qwen3.5 VL checkpoint (``qwen3_5_moe`` / ``qwen3_5``) trained text-only: its text model's names are under
    ``model.language_model.`` (read and exported there; ``--save-hf`` copies its vision tower as it is)."""
    return _LM if shape.model_type in ("qwen3_5_moe", "qwen3_5") else None


def export_stream(buckets, shape):
    """The weight stream with the MTP layers under the checkpoint's ``mtp.*`` names, without the embedding / output
    copies ``mtp.py`` adds for DeepSeek-V3 (Qwen3-Next's MTP layer shares the main model's)."""
    n = shape.num_layers
    layers = (text_prefix(shape) or "model.") + "layers."
    for bucket in buckets:
        out = []
        for name, t in bucket:
            if name.startswith(layers) and shape.mtp_num_layers:
                layer, _, rest = name[len(layers):].partition(".")
                if int(layer) >= n:
                    if rest in _SHARED_COPIES:
                        continue
                    name = _MTP_BACK.get(rest) or f"mtp.layers.{int(layer) - n}.{rest}"
            out.append((name, t))
        if out:
            yield out


def adapt_mtp_spec(spec):
    """The MTP layer's ``enorm`` / ``hnorm`` / final norm as the family's (1 + w) norms (its decoder layer is the
    decoder's last, a full-attention one: already the family's)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return _swap(spec, WrappedTorchNorm, ZeroCenteredRMSNorm, set())


def lora_path_prefix(shape) -> str:
    """Megatron-Bridge builds a Qwen3.5 checkpoint (``qwen3_5_moe`` / ``qwen3_5``: a vision-language one) as its VL model,
    the text model under ``language_model.`` (Miles's Qwen3.5 LoRA targets read
    ``language_model.decoder.layers.*.self_attention.linear_qkv``); Qwen3-Next and the text-only configs as a GPT
    model (no prefix)."""
    return "language_model." if shape.model_type in ("qwen3_5_moe", "qwen3_5") else ""


def _sections(name: str, shape) -> list[int] | None:
    return tp_sections(name, shape.variant) if isinstance(shape.variant, HybridShape) else None


FAMILY = Family(
    name="Qwen3-Next / Qwen3.5", model_types=FAMILIES, shape_fields=shape_fields, config_kwargs=config_kwargs,
    mtp_key="mtp_num_hidden_layers",
    block_spec=lambda config, shape, core: decoder_block_spec(config, shape, shape.variant, core_attention=core),
    hf_to_megatron=lambda suffix, prefix, hf, shape: hf_to_megatron(suffix, prefix, hf, shape, shape.variant),
    megatron_to_hf=lambda suffix, prefix, full, shape: megatron_to_hf(suffix, prefix, full, shape, shape.variant),
    column=COLUMN, row=ROW, glu_fc1=(SHARED_FC1,), tp_sections=_sections, tp_partial=(".self_attention.out_norm.",),
    check_flags=check_flags, check_static=check_static, hf_state=hf_state, export_stream=export_stream,
    mtp_prefix="mtp.", adapt_mtp_spec=adapt_mtp_spec, lora_targets=("in_proj", "out_proj"),
    lora_path_prefix=lora_path_prefix, text_prefix=text_prefix,
    fork_flags=lambda shape: {"experimental_attention_variant": ("linear attention layers", "gated_delta_net")})
