"""The Nemotron-H family (Nemotron-3 Nano / Super / Ultra, config.json ``model_type`` ``nemotron_h``) on
megatron-core: hybrid Mamba-2 / attention / MLP / latent-MoE layers.

    fields = shape_fields(hf_config)          # ModelShape's fields (ValueError, one line: what is not built)
    model = build_model(shape, config, ...)   # megatron-core's MambaModel (hidden states out), local spec

What the checkpoint holds (transformers 5.24's ``nemotron_h``; weights saved under ``backbone.*``):

- a layer pattern (config.json ``hybrid_override_pattern`` or ``layers_block_type``): ``M`` Mamba-2, ``*``
  attention, ``-`` MLP, ``E`` MoE; each layer is ``x + mixer(norm(x))`` with one RMSNorm (``layers.L.norm``).
- Mamba-2 (``M``): ``in_proj`` -> [z, x, B, C, dt] (d_inner = mamba_num_heads * mamba_head_dim, B/C over
  ``n_groups`` groups of ``ssm_state_size``), a depthwise causal conv (``conv_kernel``, bias) and SiLU over
  [x, B, C], dt = softplus(dt + dt_bias) clamped to [time_step_min, inf) (transformers' limit, which ours keeps;
  megatron-core's ``MambaMixer`` does not clamp), A = -exp(A_log), the SSD scan chunked by
  ``chunk_size`` with skip ``D``, then RMSNorm over ``n_groups`` groups of y * silu(z) (``mixer.norm``), ``out_proj``.
- attention (``*``): GQA with ``head_dim``, no position embedding at all (no rope), no biases.
- MLP (``-``): non-gated ``down(relu(up x)^2)`` (``mlp_hidden_act`` relu2).
- MoE (``E``): a sigmoid router (``gate.weight``) choosing top-k on score + ``e_score_correction_bias``, weights
  normalised and times ``routed_scaling_factor``; the routed experts run in ``moe_latent_size``
  (``fc1_latent_proj`` hidden -> latent before dispatch, non-gated relu2 experts latent -> latent,
  ``fc2_latent_proj`` back after combine), a shared relu2 expert on the full hidden size, added after.

How it is built, and from which megatron-core blocks: ``GPTModel`` cannot hold Mamba layers (its
``TransformerBlock`` builds transformer layers only), so the family builds megatron-core's ``MambaModel``
(``models/mamba/mamba_model.py``: embedding, ``MambaStack`` with its hybrid layer allocation from the pattern
string (``ssm/mamba_hybrid_layer_allocation.py``), untied output layer), position embedding ``none``, as Miles does
through megatron.bridge (radixark/miles@v0.1.0:miles_plugins/megatron_bridge/nemotron_h.py, whose MoE names are
the ones below); the
trainer's one builder, ``model.build_gpt_model``, hands the build to the family's ``build_model`` hook, and
``HiddenMambaModel`` returns the final-norm hidden states as ``HiddenGPTModel`` does. The stack's layers:

- ``M``: megatron-core's ``MambaLayer`` (norm, mixer, bias-dropout-add) whose mixer is ``mamba.TorchMambaMixer``:
  megatron-core's ``MambaMixer`` cannot be constructed without ``mamba_ssm`` (CUDA-only) and allocates on CUDA;
  ours has its parameters and per-rank layouts and runs our torch SSD scan (``mamba.ssd_scan``) on CPU,
  ``mamba_ssm``'s kernel where it imports.
- ``*``: megatron-core's ``TransformerLayer`` with the attention half only (``SDPACoreAttention``, no rope).
- ``-``: megatron-core's ``MLPLayer`` (``gated_linear_unit`` false, ``squared_relu``).
- ``E``: ``TransformerLayer`` with megatron-core's ``MoELayer``: ``moe_latent_size`` (its ``fc1_latent_proj`` /
  ``fc2_latent_proj``; megatron-core asserts transformer-engine for them, so on the local spec they are a
  replicated torch linear, ``LatentLinear``), sigmoid router with expert bias and top-k scaling, shared expert.
- the stack's final norm: megatron-core hard-codes ``TENorm``; the local build swaps in its torch norm.

Names (megatron <- HF ``backbone.layers.L.``): ``norm.weight`` / ``input_layernorm.weight`` /
``pre_mlp_layernorm.weight`` <- ``norm.weight``; ``mixer.*`` (Mamba) <- ``mixer.*``; ``linear_qkv`` <- q/k/v
grouped per query group; ``linear_proj`` <- ``o_proj``; ``mlp.linear_fc1/2`` <- ``mixer.up_proj/down_proj``;
``mlp.router.weight`` / ``expert_bias`` <- ``mixer.gate.weight`` / ``e_score_correction_bias``;
``mlp.shared_experts.*`` <- ``mixer.shared_experts.*``; ``mlp.fc{1,2}_latent_proj`` <- ``mixer.fc{1,2}_latent_proj``;
expert e's ``linear_fc1/2`` <- ``mixer.experts.e.up_proj/down_proj``. Tensor parallelism splits ``in_proj`` by
sections ([z; x; B; C; dt], each its own TP split) and ``conv1d`` by [x; B; C] (``tp_sections``).

Pipeline parallelism: ``MambaStack`` builds its stage's part of the pattern (megatron-core's split, as
``pipeline.stage_layer_counts``) with global layer numbers, so ``pipeline.py`` runs it as it runs ``GPTModel``'s
stages, MoE layers included (each stage's routers' ``expert_bias`` loaded and exported with its parameters, the
experts over the stage's EP group).

Tensor parallelism over more ranks than KV heads (Nemotron-3 Super / Ultra: 2 KV heads, Miles's Super command runs
TP 4): the attention layers replicate the KV heads over TP (``kv_replicate.py``, as Gemma 4's full layers do):
``linear_q`` (``q_proj``, split over TP by heads) and ``linear_kv`` (``k_proj`` / ``v_proj`` per KV head, on every
rank, its gradient summed over TP). TP must divide the KV heads or be a multiple of them.

MTP layers (config.json ``num_nextn_predict_layers``, Nemotron-3 Super's 1): not built, as Miles's bridge drops them
(radixark/miles@v0.1.0:miles_plugins/megatron_bridge/nemotron_h.py: ``mtp_num_layers = None`` unless an environment
variable keeps them) and transformers does not load them; the main model trains and exports without them,
``--mtp-num-layers`` is refused.

Refused, one line each: context parallelism (the Mamba scan's state is not passed between CP ranks),
``--mtp-num-layers``; quantised checkpoints; ``mamba_hidden_act`` other than silu, linear biases. Rows are right-padded and unpacked (as for every family here), so
a row's padding never reaches its real tokens through the scan. The transformer-engine spec is not used: on a GPU
the same local spec runs (SDPA attention, ``mamba_ssm``'s scan where it imports).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from miles.trainer.megatron import kv_replicate
from miles.trainer.megatron.families import Family

FAMILIES = {"nemotron_h": "Nemotron-H (Nemotron-3)"}
_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_NORMS = ("norm.weight", "input_layernorm.weight", "pre_mlp_layernorm.weight")
_SAME = {  # megatron suffix -> HF suffix (under backbone.layers.L.)
    "self_attention.linear_proj.weight": "mixer.o_proj.weight",
    "mlp.linear_fc1.weight": "mixer.up_proj.weight",
    "mlp.linear_fc2.weight": "mixer.down_proj.weight",
    "mlp.router.weight": "mixer.gate.weight",
    "mlp.router.expert_bias": "mixer.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc1.weight": "mixer.shared_experts.up_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mixer.shared_experts.down_proj.weight",
    "mlp.fc1_latent_proj.weight": "mixer.fc1_latent_proj.weight",
    "mlp.fc2_latent_proj.weight": "mixer.fc2_latent_proj.weight",
}
TOP = {"embedding.word_embeddings.weight": "backbone.embeddings.weight", "output_layer.weight": "lm_head.weight",
       "decoder.final_norm.weight": "backbone.norm_f.weight"}
COLUMN = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_bias", "mixer.A_log",
          "mixer.D", "mixer.norm.weight")
ROW = ("mixer.out_proj.weight",)


@dataclass(frozen=True)
class NemotronHShape:
    pattern: str                    # one of M * - E per layer (megatron-core's hybrid_override_pattern)
    num_heads: int                  # Mamba heads
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    chunk_size: int
    dt_min: float                   # dt's clamp (transformers': [time_step_min, inf))
    dt_max: float
    norm_eps: float
    latent_size: int                # moe_latent_size (0: the experts run on the hidden size)


def own(shape) -> NemotronHShape | None:
    return shape.variant if isinstance(shape.variant, NemotronHShape) else None


def layer_pattern(c) -> str:
    """The M / * / - / E pattern of a nemotron_h config.json (ValueError for a layer type not built)."""
    types = list(getattr(c, "layers_block_type", None) or getattr(c, "layer_types", None) or [])
    if not types and getattr(c, "hybrid_override_pattern", None):
        return str(c.hybrid_override_pattern)
    bad = sorted({t for t in types if t not in _PATTERN})
    if bad or not types:
        raise ValueError(f"nemotron_h layers_block_type {bad or types} not supported (linear_attention, "
                         "full_attention, mlp, moe).")
    return "".join(_PATTERN[t] for t in types)


# ------------------------------------------------------------------------------------------- shape
def shape_fields(c) -> dict:
    """``ModelShape``'s fields of a nemotron_h config.json (ValueError, one line, for what is not built)."""
    if getattr(c, "quantization_config", None):
        raise ValueError("config.json has quantization_config: the Megatron backend loads bf16/fp32 Nemotron-H "
                         "weights; use the checkpoint's BF16 release.")
    for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if getattr(c, key, want) != want:
            raise ValueError(f"nemotron_h {key} {getattr(c, key)!r} is not supported ({want} only).")
    for key in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
        if getattr(c, key, False):
            raise ValueError(f"nemotron_h {key} true is not supported (Nemotron-3 has no linear biases).")
    pattern = layer_pattern(c)
    n = len(pattern)
    experts = int(getattr(c, "n_routed_experts", 0) or 0) if "E" in pattern else 0
    groups, group_topk = int(getattr(c, "n_group", 1) or 1), int(getattr(c, "topk_group", 1) or 1)
    topk = int(getattr(c, "num_experts_per_tok", 1) or 1)
    if experts and groups > 1 and topk // group_topk != 2:
        raise ValueError(f"nemotron_h n_group {groups} with num_experts_per_tok {topk} / topk_group {group_topk} != 2: "
                         "HF scores a group by its top 2 experts, megatron-core by its top k / topk_group.")
    if experts and not getattr(c, "norm_topk_prob", True):
        raise ValueError("nemotron_h norm_topk_prob false is not supported (megatron-core renormalises the top-k "
                         "sigmoid scores).")
    heads = int(c.num_attention_heads)
    limit = getattr(c, "time_step_limit", None) or (0.0, float("inf"))
    variant = NemotronHShape(
        pattern=pattern, num_heads=int(c.mamba_num_heads), head_dim=int(c.mamba_head_dim), n_groups=int(c.n_groups),
        state_size=int(c.ssm_state_size), conv_kernel=int(c.conv_kernel), conv_bias=bool(c.use_conv_bias),
        chunk_size=int(c.chunk_size), dt_min=max(float(c.time_step_min), float(limit[0])),
        dt_max=float(limit[1]), norm_eps=float(c.layer_norm_epsilon),
        latent_size=int(getattr(c, "moe_latent_size", None) or 0))
    fields = dict(
        model_type=c.model_type, num_layers=n, hidden_size=int(c.hidden_size),
        ffn_hidden_size=int(c.intermediate_size), num_attention_heads=heads,
        num_query_groups=int(getattr(c, "num_key_value_heads", None) or heads),
        kv_channels=int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads), vocab_size=int(c.vocab_size),
        max_position_embeddings=int(c.max_position_embeddings), rotary_base=10000.0,
        norm_epsilon=float(c.layer_norm_epsilon), qk_layernorm=False, qkv_bias=False,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)), variant=variant,
        nextn_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0))      # not built (check_static)
    if experts:
        fields.update(num_experts=experts, moe_ffn_hidden_size=int(c.moe_intermediate_size), moe_router_topk=topk,
                      moe_norm_topk_prob=True, moe_layer_pattern=tuple(int(x == "E") for x in pattern),
                      moe_shared_ffn_hidden_size=int(c.moe_shared_expert_intermediate_size)
                      * max(int(getattr(c, "n_shared_experts", 1) or 0), 0),
                      moe_score_function="sigmoid", moe_expert_bias=True,
                      moe_topk_scaling=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
                      moe_num_groups=groups if groups > 1 else 0, moe_group_topk=group_topk if groups > 1 else 0)
    return fields


# ------------------------------------------------------------------------------------------- flags
def check_flags(m, shape) -> None:
    """``--moe-latent-size`` against config.json's ``moe_latent_size`` (refused on another family), one line."""
    from miles.config.base import ConfigError

    if m is None:
        return
    latent = getattr(m, "moe_latent_size", None)
    v = own(shape)
    if latent is None:
        return
    if v is None:
        raise ConfigError(f"--moe-latent-size {latent} does not match --hf-checkpoint's config.json (model_type "
                          f"{shape.model_type}, no latent MoE): drop the flag (the model shape is read from "
                          "config.json).")
    if int(latent) != v.latent_size:
        raise ConfigError(f"--moe-latent-size {latent} does not match --hf-checkpoint's config.json (moe_latent_size "
                          f"{v.latent_size or None}): fix the flag or drop it (the model shape is read from "
                          "config.json).")


def check_static(o, shape) -> None:
    """What the Nemotron-H build does not run (``o``: ``options.Options``)."""
    from miles.config.base import ConfigError

    if own(shape) is None:
        return
    if o.cp > 1:
        raise ConfigError(f"--context-parallel-size {o.cp} with Nemotron-H: the Mamba layers' scan state is not passed "
                          "between context-parallel ranks; use --context-parallel-size 1.")
    if o.mtp_num_layers:
        raise ConfigError(f"--mtp-num-layers {o.mtp_num_layers} with Nemotron-H: its MTP layers (config.json's "
                          f"num_nextn_predict_layers {shape.nextn_layers}) are not built by the Megatron backend; drop "
                          "the flag (the main model trains without them, as Miles's Nemotron-H bridge does).")


# ------------------------------------------------------------------------------------------- model
def config_kwargs(shape) -> dict:
    """TransformerConfig arguments of Nemotron-H: non-gated squared ReLU, Mamba dims, the latent sigmoid MoE."""
    v = own(shape)
    if v is None:
        return {}
    from megatron.core.activations import squared_relu

    kw = dict(gated_linear_unit=False, activation_func=squared_relu, bias_activation_fusion=False,
              is_hybrid_model=True, mamba_state_dim=v.state_size, mamba_head_dim=v.head_dim,
              mamba_num_groups=v.n_groups, mamba_num_heads=v.num_heads)
    if shape.num_experts:
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=shape.moe_topk_scaling,
                  moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size
                  or None, moe_latent_size=v.latent_size or None, moe_shared_expert_overlap=False)
        if shape.moe_num_groups:
            kw.update(moe_router_num_groups=shape.moe_num_groups, moe_router_group_topk=shape.moe_group_topk)
    return kw


class LatentLinear(torch.nn.Module):
    """megatron-core's ``TELinear(parallel_mode="duplicated")`` of ``MoELayer``'s latent projections on the local
    spec: a whole (replicated) torch linear returning (out, None)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 **_unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if bias:
            raise ValueError("MoE latent projections with biases are not supported")
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None


def _norm(config) -> type:
    """The local spec's torch RMSNorm (``model.SequenceParallelNorm`` under ``--sequence-parallel``)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from miles.trainer.megatron.model import SequenceParallelNorm

    return SequenceParallelNorm if config.sequence_parallel else WrappedTorchNorm


@contextlib.contextmanager
def _local_build_patches(config):
    """While the local spec is built: MambaStack's final norm is the local torch norm (megatron-core hard-codes
    ``TENorm``) and MoELayer's latent projections are ``LatentLinear`` (it asserts transformer-engine)."""
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.moe import moe_layer

    saved = (mamba_block.TENorm, moe_layer.HAVE_TE, getattr(moe_layer, "TELinear", None))
    mamba_block.TENorm, moe_layer.HAVE_TE, moe_layer.TELinear = _norm(config), True, LatentLinear
    try:
        yield
    finally:
        mamba_block.TENorm, moe_layer.HAVE_TE = saved[0], saved[1]
        if saved[2] is None:
            del moe_layer.TELinear
        else:
            moe_layer.TELinear = saved[2]


def stack_spec(config, shape, core_attention):
    """The local ``MambaStack`` spec: Mamba, attention, MLP and MoE layers from megatron-core's blocks."""
    from types import SimpleNamespace

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from miles.trainer.megatron.families.mamba import torch_mamba_mixer
    from miles.trainer.megatron.kv_replicate import kv_replicated, replicated_attention

    norm = _norm(config)

    mixer = ModuleSpec(module=torch_mamba_mixer(), params={"variant": own(shape)},
                       submodules=SimpleNamespace(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    kv = shape.num_query_groups            # fewer KV heads than TP ranks: replicated over TP (kv_replicate.py)
    self_attention = replicated_attention(kv) if kv_replicated(kv, config.tensor_model_parallel_size) else SelfAttention
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=self_attention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=core_attention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    subs = dict(mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=norm, mixer=mixer, mamba_bda=get_bias_dropout_add)), attention_layer=attention, mlp_layer=mlp)
    if shape.num_experts:
        moe = get_moe_module_spec(use_te=False, num_experts=shape.num_experts, moe_grouped_gemm=False)
        subs["moe_layer"] = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(**subs))


def build_model(shape, config, *, padded_vocab: int, device: torch.device, core_attention, pre_process: bool = True,
                post_process: bool = True, **_unused):
    """A ``HiddenMambaModel`` on ``device`` (weights uninitialised: ``convert.load_hf_into``)."""
    from megatron.core.models.mamba.mamba_model import MambaModel

    if shape.mtp_num_layers:
        raise ValueError("Nemotron-H with MTP layers is not built by the Megatron backend")

    class HiddenMambaModel(MambaModel):
        """MambaModel whose forward returns the final-norm hidden states [s, b, h] (no output layer)."""

        mtp_training = False
        mtp_loss_value = None

        def forward(self, input_ids, position_ids, attention_mask=None, decoder_input=None, labels=None,
                    **_unused):
            if decoder_input is None and self.pre_process:
                decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            return self.decoder(hidden_states=decoder_input, attention_mask=attention_mask)

    with _local_build_patches(config):
        model = HiddenMambaModel(config, stack_spec(config, shape, core_attention), vocab_size=padded_vocab,
                                 max_sequence_length=shape.max_position_embeddings, pre_process=pre_process,
                                 post_process=post_process, hybrid_override_pattern=own(shape).pattern,
                                 share_embeddings_and_output_weights=shape.tie_embeddings, parallel_output=True,
                                 position_embedding_type="none")
    return model.to(device)


def exported_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each router's ``expert_bias`` (HF ``e_score_correction_bias``), exported with the parameters."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith(".mlp.router.expert_bias")]


def tp_sections(name: str, shape) -> tuple[int, ...] | None:
    """Row sections of a full tensor each split over TP on its own (None: an even split)."""
    v = own(shape)
    if v is None:
        return None
    d, gn, h = v.num_heads * v.head_dim, v.n_groups * v.state_size, v.num_heads
    if name.endswith("mixer.in_proj.weight"):
        return (d, d, gn, gn, h)
    if name.endswith(("mixer.conv1d.weight", "mixer.conv1d.bias")):
        return (d, gn, gn)
    if name.endswith(("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")):   # not gated: one section
        return (-1,)
    return None


# ------------------------------------------------------------------------------------------- names
def _hf_prefix(prefix: str) -> str:
    return "backbone." + prefix[len("model."):]          # 'model.layers.L.' -> 'backbone.layers.L.'


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], shape) -> torch.Tensor | None:
    """The full megatron tensor of layer parameter ``suffix`` (EP-free) from the HF state dict."""
    if own(shape) is None:
        return None
    p = _hf_prefix(prefix)
    if suffix in _NORMS:
        return hf[p + "norm.weight"]
    if suffix.startswith("mixer."):
        return hf[p + suffix]
    if suffix in _SAME:
        return hf[p + _SAME[suffix]]
    if suffix == "self_attention.linear_q.weight":           # KV heads replicated over TP (kv_replicate.py)
        return hf[p + "mixer.q_proj.weight"]
    if suffix == "self_attention.linear_kv.weight":
        return kv_replicate.hf_linear_kv([hf[f"{p}mixer.{x}_proj.weight"] for x in "kv"], shape.num_query_groups,
                                         shape.kv_channels)
    if suffix == "self_attention.linear_qkv.weight":
        ng = shape.num_query_groups
        q, k, v = (hf[f"{p}mixer.{x}_proj.weight"] for x in "qkv")
        return torch.cat([q.reshape(ng, -1, q.shape[-1]), k.reshape(ng, -1, k.shape[-1]),
                          v.reshape(ng, -1, v.shape[-1])], dim=1).reshape(-1, q.shape[-1])
    m = _EXPERT.match(suffix)
    if m:
        return hf[f"{p}mixer.experts.{m.group(1)}.{'up' if m.group(2) == 'linear_fc1' else 'down'}_proj.weight"]
    raise KeyError(f"no HF source for Nemotron-H megatron parameter layers.N.{suffix}")


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor, shape) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of a full megatron layer tensor."""
    if own(shape) is None:
        return None
    p = _hf_prefix(prefix)
    if suffix in _NORMS:
        return [(p + "norm.weight", full)]
    if suffix.startswith("mixer."):
        return [(p + suffix, full)]
    if suffix in _SAME:
        return [(p + _SAME[suffix], full)]
    if suffix == "self_attention.linear_q.weight":
        return [(p + "mixer.q_proj.weight", full)]
    if suffix == "self_attention.linear_kv.weight":
        parts = kv_replicate.split_linear_kv(full, shape.num_query_groups, shape.kv_channels)
        return [(f"{p}mixer.{x}_proj.weight", t) for x, t in zip("kv", parts)]
    if suffix == "self_attention.linear_qkv.weight":
        ng, d = shape.num_query_groups, shape.kv_channels
        per = shape.num_attention_heads // ng * d
        q, k, v = full.reshape(ng, per + 2 * d, -1).split([per, d, d], dim=1)
        return [(f"{p}mixer.{x}_proj.weight", t.reshape(-1, full.shape[-1])) for x, t in zip("qkv", (q, k, v))]
    m = _EXPERT.match(suffix)
    if m:
        return [(f"{p}mixer.experts.{m.group(1)}.{'up' if m.group(2) == 'linear_fc1' else 'down'}_proj.weight", full)]
    raise KeyError(f"no HF name for Nemotron-H megatron parameter layers.N.{suffix}")


# ------------------------------------------------------------------------------------------- family
FAMILY = Family(
    name="Nemotron-H", model_types=FAMILIES, shape_fields=shape_fields, config_kwargs=config_kwargs,
    hf_to_megatron=hf_to_megatron, megatron_to_hf=megatron_to_hf, column=COLUMN + kv_replicate.COLUMN, row=ROW,
    tp_partial=kv_replicate.TP_PARTIAL, replicated_kv=True, exported_buffers=exported_buffers, check_flags=check_flags, check_static=check_static, build_model=build_model,
    top_names=TOP, tp_sections=tp_sections, swiglu=False, position_embedding="none")
