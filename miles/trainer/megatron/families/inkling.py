"""The Inkling family on the Megatron backend: its text model, from the released multimodal checkpoint (config.json
``model_type: inkling_mm_model``, trained text-only as Kimi-K2.5 and Gemma 4 are) or a text-only one
(``inkling_text``, transformers' ``InklingForCausalLM``): shape, names, flags; the decoder is ``inkling_model.py``.

    FAMILY                                  # its hooks (families/__init__.py): shape, own model, names, refusals
    model = inkling_model.build_inkling_model(shape, config, padded_vocab=V, device=dev)   # via model.build_gpt_model

Design note: what Inkling's text model is, what megatron-core 0.16.1 has for it, and what is ours (the reference is
transformers 5.24's ``models/inkling``; Miles v0.1.0 trains it with its own transformer-engine-only model,
``--custom-model-provider-path miles_plugins.models.inkling.model.inkling_model_provider``,
radixark/miles@v0.1.0:miles_plugins/models/inkling/, whose path is taken here as naming this family:
``miles/config/specs.py``'s ``PROVIDERS``):

 1. Embedding: megatron-core's vocabulary-parallel embedding, then an RMS norm (``embed_tokens.embed_norm``); no
    position embedding (``--position-embedding-type none``).
 2. Attention: per-head q/k RMS norms and a 1/head_dim scale; K and V pass through a short causal depthwise
    convolution with its residual (``k_sconv``/``v_sconv``, ``conv_kernel_size`` taps, fp32) before the k norm;
    position enters only as a bias per backward distance, each head mixing a shared bank of ``d_rel`` profiles
    (``rel_logits_proj.proj`` [d_rel, extent]) with its own states (``r_proj``), zero past ``rel_extent`` (full layers) or
    the window (sliding layers). ``layer_types``: ``hybrid_sliding`` layers attend over ``sliding_window_size`` keys
    with their own head counts and head size (``swa_*``); ``hybrid`` layers over the whole row, their query and bias
    scaled by ``1 + alpha log(max(1, (i + 1) / n_floor))`` when ``log_scaling_n_floor`` is set. megatron-core's
    attention has no relative bias, no K/V convolution, no per-layer head counts -> ours (``InklingAttention``).
 3. Block: the attention's and the MLP's outputs each pass through a short convolution (``attn_sconv``,
    ``mlp_sconv``) before their residual add. megatron-core's TransformerLayer has no place for them -> ours.
 4. MLP: dense SwiGLU layers (``mlp_layer_types`` ``dense``) with a learned ``global_scale``; MoE layers: a sigmoid
    router over the routed experts plus ``n_shared_experts`` shared ones; top-k of the routed scores plus
    ``e_score_correction_bias``; the chosen experts' and the shared experts' log-sigmoid logits normalised together
    (a softmax: the shared experts are a "sink" for the weight), times ``route_scale`` and a learned
    ``global_scale``; each shared expert weighted by its own share. megatron-core's SharedExpertMLP takes no
    per-token weight and its router no shared logits -> ours (``InklingMoE``), in torch, the tokens split over TP.
    Expert parallelism: each EP rank holds its rows of the stacked experts (``moe.is_stacked_expert``: sliced at load,
    gathered at export, EP-sharded in torch_dist); the MoE sends tokens to them by ``--moe-token-dispatcher-type``
    (alltoall, the default under EP > 1, or allgather: ``inkling_ep.py``; flex refused).
 5. Head: the final hidden states divided by ``logits_mup_width_multiplier`` before the output layer (untied).
    ``unpadded_vocab_size``: the rows past it are not the model's (transformers drops those logits): the shape's
    vocabulary is the unpadded one, the export pads the head and embedding back to ``vocab_size`` with zeros.
 6. MTP layers (``num_mtp_layers``): transformers ignores the checkpoint's ``model.mtp.*``; so does this build
    (``--mtp-num-layers`` refused).

Names (transformers' ``InklingForCausalLM``: ``model.layers.L.self_attn.q_proj.weight``, ...; megatron:
``decoder.layers.L.self_attention.linear_q.weight``, ...): ``_LAYER`` below. The released checkpoint keeps the text
model under ``model.llm.*`` in Thinking Machines' names (``attn.wq_du``, ``mlp.w13_dn`` with gate and up rows
interleaved, ``mlp.experts.w13_weight``, ``shared_experts.shared_w13_weight``, ``unembed``: what transformers renames
at load time, ``_NATIVE_*``): ``hf_state`` reads them, ``export_stream`` writes them back (weight sync, ``--save-hf``),
``text_prefix`` leaves the towers (``model.visual.*``, ``model.audio.*``) to ``--save-hf``, which copies them from
``--hf-checkpoint``; the towers are not built (images and audio in the prompts are not trained on: as transformers
embeds any token, a placeholder token is embedded as itself). Refused (one line each,
``check_static``): pipeline and context parallelism, a TP size not dividing every layer's heads and KV heads,
MTP layers, ``--moe-grouped-gemm`` / ``--moe-permute-fusion`` (transformer-engine's kernels for megatron-core's experts),
``--moe-token-dispatcher-type flex`` (DeepEP's dispatcher, not wired into this MoE), dropout (the model has none; an auxiliary load-balancing loss is refused for every family). Activation
recompute: ``--recompute-granularity full`` (uniform / block chunks of layers) and ``selective`` (the attention's
[s, s] core) with torch's checkpoint. Routing replay: the router asks
megatron-core's ``router_replay`` as megatron-core's own does (R2 tested; R3 needs an engine that records Inkling's
experts: SGLang, not here; the embedded engine serves ``inkling_text`` without recording them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from miles.config.base import ConfigError
from miles.trainer.megatron.families import Family

MODEL_TYPES = {"inkling_text": "Inkling", "inkling_mm_model": "Inkling"}


@dataclass(frozen=True)
class InklingShape:
    sliding: tuple[bool, ...]         # per layer: hybrid_sliding
    swa_heads: int
    swa_kv_heads: int
    swa_head_dim: int
    sliding_window: int
    d_rel: int
    rel_extent: int
    log_scaling_n_floor: int | None
    log_scaling_alpha: float
    conv_kernel: int
    n_shared_experts: int
    mup_width_multiplier: float
    route_scale: float                # the router's weights' scale (config.json's, as Miles's provider reads it: not
    #                                   Megatron's --moe-router-topk-scaling-factor, which Miles's command does not pass)
    hf_vocab_size: int                # config.json's vocab_size (the checkpoint's rows; the shape's may be fewer)


def shape_fields(c) -> dict:
    """``ModelShape``'s fields of an Inkling config.json (``inkling_text``, or ``inkling_mm_model``'s
    ``text_config``), ``variant`` holding Inkling's own (ValueError, one line, naming what is not built)."""
    model_type = c.model_type
    if model_type == "inkling_mm_model":              # the published checkpoint: its text model, trained text-only
        c = c.text_config
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"Inkling hidden_act {c.hidden_act!r} is not supported (silu).")
    n = int(c.num_hidden_layers)
    types = list(c.layer_types[:n])
    if set(types) - {"hybrid", "hybrid_sliding"}:
        raise ValueError(f"Inkling layer_types {types}: hybrid or hybrid_sliding only.")
    mlp = list(c.mlp_layer_types[:n])
    if set(mlp) - {"dense", "sparse"}:
        raise ValueError(f"Inkling mlp_layer_types {mlp}: dense or sparse only.")
    pattern = tuple(int(t == "sparse") for t in mlp)
    shared = int(c.n_shared_experts or 0)
    if any(pattern) and (shared < 1 or not getattr(c, "shared_expert_sink", True)):
        raise ValueError("Inkling MoE without shared experts scored as a sink (n_shared_experts >= 1, "
                         "shared_expert_sink true) is not supported.")
    unpadded = getattr(c, "unpadded_vocab_size", None)
    vocab = int(c.vocab_size)
    g = InklingShape(sliding=tuple(t == "hybrid_sliding" for t in types), swa_heads=int(c.swa_num_attention_heads),
                     swa_kv_heads=int(c.swa_num_key_value_heads), swa_head_dim=int(c.swa_head_dim),
                     sliding_window=int(c.sliding_window_size), d_rel=int(c.d_rel), rel_extent=int(c.rel_extent),
                     log_scaling_n_floor=None if c.log_scaling_n_floor is None else int(c.log_scaling_n_floor),
                     log_scaling_alpha=float(c.log_scaling_alpha), conv_kernel=int(c.conv_kernel_size),
                     n_shared_experts=shared, mup_width_multiplier=float(c.logits_mup_width_multiplier),
                     route_scale=float(c.route_scale),
                     hf_vocab_size=vocab)
    experts = int(c.n_routed_experts) if any(pattern) else 0
    # the dense MLPs' size; with none (every layer MoE, the released model's) the experts' (Miles's --ffn-hidden-size:
    # radixark/miles@v0.1.0:scripts/models/inkling.py passes 3072, the experts' size)
    ffn = int(c.intermediate_size) if not all(pattern) else int(c.moe_intermediate_size)
    return dict(
        model_type=model_type, num_layers=n, hidden_size=int(c.hidden_size), ffn_hidden_size=ffn,
        num_attention_heads=int(c.num_attention_heads), num_query_groups=int(c.num_key_value_heads),
        kv_channels=int(c.head_dim), vocab_size=min(int(unpadded), vocab) if unpadded else vocab,
        max_position_embeddings=int(c.max_position_embeddings), rotary_base=10000.0,
        norm_epsilon=float(c.rms_norm_eps), qk_layernorm=True, qkv_bias=False, tie_embeddings=False,
        num_experts=experts, moe_ffn_hidden_size=int(c.moe_intermediate_size) if experts else 0,
        moe_router_topk=int(c.num_experts_per_tok) if experts else 0, moe_norm_topk_prob=True,
        # each shared expert's size (Miles's --moe-shared-expert-intermediate-size: radixark/miles@v0.1.0:
        # miles_plugins/models/inkling/model.py builds n_shared_experts experts of that size)
        moe_layer_pattern=pattern if experts else (), moe_shared_ffn_hidden_size=int(c.moe_intermediate_size)
        if experts else 0, moe_score_function="sigmoid", moe_expert_bias=bool(experts),
        nextn_layers=int(getattr(c, "num_mtp_layers", None) or 0), variant=g)


def is_inkling(shape) -> bool:
    return isinstance(shape.variant, InklingShape)


# ------------------------------------------------------------------------------------------- names
# megatron suffix -> transformers' suffix, per layer (prefix model.layers.L.)
_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
          "self_attention.linear_q.weight": "self_attn.q_proj.weight",
          "self_attention.linear_k.weight": "self_attn.k_proj.weight",
          "self_attention.linear_v.weight": "self_attn.v_proj.weight",
          "self_attention.linear_r.weight": "self_attn.r_proj.weight",
          "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
          "self_attention.k_conv.weight": "self_attn.k_sconv.conv1d.weight",
          "self_attention.v_conv.weight": "self_attn.v_sconv.conv1d.weight",
          "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
          "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
          "self_attention.rel_logits.proj": "self_attn.rel_logits_proj.proj",
          "attn_conv.weight": "attn_sconv.conv1d.weight",
          "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
          "mlp_conv.weight": "mlp_sconv.conv1d.weight",
          "mlp.linear_fc2.weight": "mlp.down_proj.weight",
          "mlp.global_scale": "mlp.global_scale",
          "mlp.router.weight": "mlp.gate.weight",
          "mlp.router.global_scale": "mlp.gate.global_scale",
          "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
          "mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj",
          "mlp.experts.down_proj": "mlp.experts.down_proj",
          "mlp.sink_experts.down_proj": "mlp.shared_experts.down_proj"}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "embedding_norm.weight": "model.embed_tokens.embed_norm.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight"}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_FC1 = "mlp.linear_fc1.weight"                      # [gate; up]: mlp.gate_proj / up_proj
_SINK_FC1 = "mlp.sink_experts.gate_up_proj"         # [S, 2I, h]: mlp.shared_experts.gate_proj / up_proj [S, I, h]
COLUMN = ("self_attention.linear_k.weight", "self_attention.linear_v.weight", "self_attention.linear_r.weight",
          "self_attention.k_conv.weight", "self_attention.v_conv.weight")     # linear_q, fc1: already column
TP_PARTIAL = (".self_attention.rel_logits.",)      # each TP rank mixes the profiles for its heads only

# The published checkpoint (inkling_mm_model, thinkingmachines/Inkling): its text model under model.llm.*, in its
# own names (transformers renames them at load time: transformers.conversion_mapping's "inkling_mm_model"); the
# [gate; up] pairs stored interleaved row by row (w13). transformers' suffix -> the checkpoint's, per layer
NATIVE_PREFIX = "model.llm."
_NATIVE_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn.wq_du.weight",
                 "self_attn.k_proj.weight": "attn.wk_dv.weight", "self_attn.v_proj.weight": "attn.wv_dv.weight",
                 "self_attn.r_proj.weight": "attn.wr_du.weight", "self_attn.o_proj.weight": "attn.wo_ud.weight",
                 "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
                 "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
                 "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight",
                 "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
                 "attn_sconv.conv1d.weight": "attn_sconv.weight", "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
                 "post_attention_layernorm.weight": "mlp_norm.weight", "mlp.down_proj.weight": "mlp.w2_md.weight",
                 "mlp.global_scale": "mlp.global_scale", "mlp.gate.weight": "mlp.gate.weight",
                 "mlp.gate.global_scale": "mlp.gate.global_scale",
                 "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
                 "mlp.experts.down_proj": "mlp.experts.w2_weight",
                 "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight"}
_NATIVE_TOP = {"model.embed_tokens.weight": "embed.weight", "model.embed_tokens.embed_norm.weight": "embed_norm.weight",
               "model.norm.weight": "norm.weight", "lm_head.weight": "unembed.weight"}
# [gate; up] pairs: transformers' (gate, up) names or fused [gate; up] name -> the checkpoint's interleaved one, dim
_NATIVE_W13 = {"mlp.gate_proj.weight": ("mlp.w13_dn.weight", 0), "mlp.up_proj.weight": ("mlp.w13_dn.weight", 0),
               "mlp.experts.gate_up_proj": ("mlp.experts.w13_weight", 1),
               "mlp.shared_experts.gate_proj": ("mlp.shared_experts.shared_w13_weight", 1),
               "mlp.shared_experts.up_proj": ("mlp.shared_experts.shared_w13_weight", 1)}
_LAYER_NAME = re.compile(r"^(?:model\.llm\.|model\.)layers\.(\d+)\.(.+)$")


def is_published(shape) -> bool:
    return shape.model_type == "inkling_mm_model"


def interleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate; up] halves along ``dim`` -> rows interleaved gate, up, gate, up, ... (the checkpoint's w13)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def deinterleave(w13: torch.Tensor, dim: int) -> torch.Tensor:
    """The checkpoint's interleaved w13 -> [gate; up] halves along ``dim`` (transformers' ``Interleave``)."""
    shape = list(w13.shape)
    shape[dim:dim + 1] = [shape[dim] // 2, 2]
    return w13.reshape(shape).transpose(dim, dim + 1).reshape(w13.shape)


def hf_state(hf: dict[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
    """The published checkpoint's text model under transformers' names (idempotent: also after
    ``convert.text_state`` moved ``model.llm.*`` to ``model.*``); other tensors (the towers) left out."""
    if not is_published(shape):
        return hf
    native_layer = {v: k for k, v in _NATIVE_LAYER.items()}
    native_top = {v: k for k, v in _NATIVE_TOP.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        rest = name.removeprefix(NATIVE_PREFIX) if name.startswith(NATIVE_PREFIX) else name.removeprefix("model.")
        if name in _NATIVE_TOP or name.startswith("model.layers.") and _LAYER_NAME.match(name).group(2) in _LAYER.values():
            out[name] = t                                           # already transformers' names
        elif rest in native_top:
            out[native_top[rest]] = t
        elif (m := _LAYER_NAME.match(name)) is not None:
            p, suffix = f"model.layers.{m.group(1)}.", m.group(2)
            if suffix in native_layer:
                out[p + native_layer[suffix]] = t
            elif suffix == "mlp.w13_dn.weight":
                out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = deinterleave(t, 0).chunk(2, dim=0)
            elif suffix == "mlp.experts.w13_weight":
                out[p + "mlp.experts.gate_up_proj"] = deinterleave(t, 1)
            elif suffix == "mlp.shared_experts.shared_w13_weight":
                gate, up = deinterleave(t, 1).chunk(2, dim=1)
                out[p + "mlp.shared_experts.gate_proj"], out[p + "mlp.shared_experts.up_proj"] = gate, up
            else:
                out[name] = t
        elif name.startswith(("mtp.", "model.mtp.", "model.llm.mtp.")):
            continue                                                # MTP layers: not built (as transformers)
        elif name in ("lm_head.weight",) or name.startswith("model."):
            out[name] = t
    return out


def _native(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """The checkpoint's name of one tensor of the export (transformers' names under ``model.llm.``,
    ``lm_head.weight``); None: one half of a w13 pair (joined by ``export_stream``)."""
    if name == "lm_head.weight" or name.startswith(NATIVE_PREFIX) and "model." + name[len(NATIVE_PREFIX):] in _NATIVE_TOP:
        key = name if name == "lm_head.weight" else "model." + name[len(NATIVE_PREFIX):]
        return NATIVE_PREFIX + _NATIVE_TOP[key], t
    m = _LAYER_NAME.match(name)
    if m is None:
        raise KeyError(f"Inkling export: no checkpoint name for {name} (a bug)")
    p, suffix = f"{NATIVE_PREFIX}layers.{m.group(1)}.", m.group(2)
    if suffix in _NATIVE_LAYER:
        return p + _NATIVE_LAYER[suffix], t
    if suffix == "mlp.experts.gate_up_proj":
        return p + "mlp.experts.w13_weight", interleave(t, 1)
    if suffix in _NATIVE_W13:
        return None
    raise KeyError(f"Inkling export: no checkpoint name for {name} (a bug)")


def export_stream(buckets, shape):
    """The published checkpoint's names (``model.llm.*``, w13 interleaved) for an inkling_mm_model checkpoint, as
    it holds them (SGLang loads these); an inkling_text one's stream as it is. A [gate; up] pair is in one bucket
    (both come from one megatron tensor)."""
    if not is_published(shape):
        yield from buckets
        return
    for bucket in buckets:
        out, halves = [], {}
        for name, t in bucket:
            pair = _native(name, t)
            if pair is not None:
                out.append(pair)
                continue
            m = _LAYER_NAME.match(name)
            target, dim = _NATIVE_W13[m.group(2)]
            halves.setdefault(f"{NATIVE_PREFIX}layers.{m.group(1)}.{target}", (dim, {}))[1][m.group(2)] = t
        for target, (dim, parts) in halves.items():
            if len(parts) != 2:
                raise RuntimeError(f"Inkling export: {target}'s gate and up halves are not in one bucket (a bug)")
            gate, up = (parts[k] for k in sorted(parts, key=lambda k: "up_proj" in k))
            out.append((target, interleave(torch.cat([gate, up], dim=dim), dim)))
        yield out


def _get(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"--hf-checkpoint has no tensor {name}: not an Inkling checkpoint of this config.json")
    return hf[name]


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], shape) -> torch.Tensor | None:
    """The full megatron tensor of ``prefix + suffix`` (``prefix`` 'model.layers.L.', or '' for a name outside the
    layers) from transformers' names (``hf_state`` has renamed the published checkpoint's)."""
    if not is_inkling(shape):
        return None
    if not prefix:
        if suffix not in _TOP:
            return None
        t = _get(hf, _TOP[suffix])
        return t[:shape.vocab_size] if suffix in _VOCAB else t
    if suffix == _FC1:
        return torch.cat([_get(hf, prefix + "mlp.gate_proj.weight"), _get(hf, prefix + "mlp.up_proj.weight")])
    if suffix == _SINK_FC1:
        return torch.cat([_get(hf, prefix + "mlp.shared_experts.gate_proj"),
                          _get(hf, prefix + "mlp.shared_experts.up_proj")], dim=1)
    if suffix in _LAYER:
        return _get(hf, prefix + _LAYER[suffix])
    raise KeyError(f"no HF source for Inkling parameter {prefix}{suffix} (a bug)")


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor, shape) -> list[tuple[str, torch.Tensor]] | None:
    """transformers' names and tensors of one full megatron tensor; the vocabulary rows as the checkpoint's
    (``vocab_size``: zero rows past ``unpadded_vocab_size``)."""
    if not is_inkling(shape):
        return None
    if not prefix:
        if suffix not in _TOP:
            return None
        if suffix in _VOCAB:
            rows = shape.variant.hf_vocab_size
            full = full[:shape.vocab_size]
            if rows > full.shape[0]:
                full = torch.cat([full, full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))])
        return [(_TOP[suffix], full)]
    if suffix == _FC1:
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    if suffix == _SINK_FC1:
        gate, up = full.chunk(2, dim=1)
        return [(prefix + "mlp.shared_experts.gate_proj", gate), (prefix + "mlp.shared_experts.up_proj", up)]
    if suffix in _LAYER:
        return [(prefix + _LAYER[suffix], full)]
    raise KeyError(f"no HF name for Inkling parameter {prefix}{suffix} (a bug)")


def exported_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each router's ``expert_bias`` (``mlp.gate.e_score_correction_bias``)."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith(".mlp.router.expert_bias")]


# ------------------------------------------------------------------------------------------- model and flags
def config_kwargs(shape) -> dict:
    """TransformerConfig arguments: megatron-core's MoE fields are not used by our MoE (``inkling_model``); its
    validation needs a score function it knows."""
    if not is_inkling(shape) or not shape.num_experts:
        return {}
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=False, moe_router_pre_softmax=False)


def build_model(shape, config, *, padded_vocab: int, device: torch.device, pre_process: bool = True,
                post_process: bool = True, **_):
    """The family's ``build_model`` hook: ``inkling_model.HiddenInklingModel`` (one pipeline stage only: PP is
    refused; its attention is its own, so the core attention ``model.build_gpt_model`` offers is not used)."""
    from miles.trainer.megatron.families import inkling_model

    if not (pre_process and post_process):
        raise ValueError("Inkling is built whole on each rank (pipeline parallelism is refused)")
    return inkling_model.build_inkling_model(shape, config, padded_vocab=padded_vocab, device=device)


def check_static(o, shape) -> None:
    """What the Inkling build does not run (``o``: ``options.Options``), one line each."""
    for flag, value, bad, why in (
            ("--pipeline-model-parallel-size", o.pp, o.pp > 1, "its decoder is built whole on each rank"),
            ("--context-parallel-size", o.cp, o.cp > 1, "its relative-position attention and short convolutions "
                                                        "run on whole rows")):
        if bad:
            raise ConfigError(f"{flag} {value} with Inkling is not supported by the Megatron backend ({why}); use "
                              "tensor and data parallelism.")
    for flag, given in (("--moe-grouped-gemm", o.moe.grouped_gemm), ("--moe-permute-fusion", o.moe.permute_fusion)):
        if given:           # (without transformer-engine the kernel check refuses them first: miles/config/kernels.py)
            raise ConfigError(f"{flag} with Inkling is not supported by the Megatron backend (its MoE is its own torch "
                              "module, not megatron-core's experts, so transformer-engine's kernels would not run); "
                              "drop it.")
    if o.moe.dispatcher == "flex":      # (without DeepEP the kernel check refuses it too: miles/config/kernels.py)
        raise ConfigError("--moe-token-dispatcher-type flex with Inkling is not supported by the Megatron backend (its "
                          "MoE is its own torch module and dispatches tokens itself; DeepEP's fused dispatcher is not "
                          "wired into it); use alltoall (the default with expert parallelism) or allgather.")
    for flag, value in (("--hidden-dropout", o.hidden_dropout), ("--attention-dropout", o.attention_dropout)):
        if value:
            raise ConfigError(f"{flag} {value:g} with Inkling is not supported by the Megatron backend (its decoder, "
                              "like transformers' Inkling, has no dropout); pass 0 or drop it.")
    g = shape.variant
    for what, n in (("swa_num_attention_heads", g.swa_heads), ("swa_num_key_value_heads", g.swa_kv_heads)):
        if any(g.sliding) and n % o.tp:
            raise ConfigError(f"--tensor-model-parallel-size {o.tp} does not divide config.json's {what} {n} "
                              "(Inkling's sliding layers split their heads over TP); choose a TP size that divides it.")
    if o.mtp_num_layers or shape.mtp_num_layers:
        raise ConfigError(f"--mtp-num-layers {o.mtp_num_layers or shape.mtp_num_layers} with Inkling is not supported (transformers "
                          "builds no Inkling MTP layers to check them against); drop it.")


FAMILY = Family(
    name="Inkling", model_types=MODEL_TYPES, shape_fields=shape_fields, config_kwargs=config_kwargs,
    build_model=build_model, hf_to_megatron=hf_to_megatron, megatron_to_hf=megatron_to_hf, hooks_name_top=True,
    column=COLUMN, tp_partial=TP_PARTIAL, exported_buffers=exported_buffers, hf_state=hf_state,
    export_stream=export_stream, text_prefix=lambda shape: NATIVE_PREFIX if is_published(shape) else None, check_static=check_static,
    position_embedding="none", mtp_key="num_mtp_layers", own_moe_dispatch=True)
