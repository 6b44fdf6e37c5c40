"""The model families the Megatron backend builds: one module per family, one registry.

    fam = family_of(shape.model_type)       # the Family that builds this config.json's model_type
    FAMILIES                                 # model_type -> name shown to users, every family's

A family is one module of this package that defines ``FAMILY = Family(...)``: how its config.json is read into
``model.ModelShape``, what it adds to megatron-core's ``TransformerConfig`` and layer spec, the HF <-> Megatron names
of its own weights, the Miles flags it checks against config.json and the parallel layouts it refuses. ``model.py``,
``convert.py``, ``export.py`` and ``options.py`` hold what every family shares and call the hooks below; they name no
family. A hook left at its default adds nothing.

Adding a family: write ``families/<name>.py`` (its shape fields, its blocks from megatron-core, our own torch module
only where megatron-core has none), append its ``FAMILY`` to ``_MODULES`` below, and give it a tiny builder under
``miles/utils/`` and a parity test against transformers (``tests/multiprocess/test_megatron_<name>.py``); its row in
docs/trainer.md's family table names those tests.

Families today: ``dense`` (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3-VL: the generic reader of ``model.py``),
``mla`` (multi-latent attention and DeepSeek-style MoE: GLM-4.7-Flash, DeepSeek-V3, Kimi-K2, JoyAI; YaRN in
``yarn.py``), ``kimi_k25`` (Kimi-K2.5's text model, trained text-only: mla's hooks on the multimodal checkpoint's
``language_model.model.*`` names), ``gpt_oss`` (sinks, sliding windows, clamped SwiGLU, biases), ``dsa`` (DeepSeek
sparse attention: DeepSeek-V3.2, GLM-5 / 5.1 / 5.2; mla's plus megatron-core's DSAttention), ``nemotron_h``
(hybrid Mamba-2 / attention / latent MoE on megatron-core's MambaModel; the torch Mamba-2 scan and mixer in
``mamba.py``),
``gemma4`` (Gemma 4's text decoder: its own layer spec, the multimodal checkpoint's
``model.language_model.*`` names, final logit softcapping; 26B-A4B's MoE block in ``gemma4_moe.py``),
``deepseek_v4`` (hyper-connections, compressed sparse attention, sqrtsoftplus / hash routing: its own decoder,
``dsv4_model.py``), ``qwen3_next``
(Qwen3-Next, Qwen3.5 / 3.6: hybrid gated DeltaNet and gated attention layers, MoE with a gated shared expert, MTP;
the torch gated delta rule in ``gated_delta.py``), ``glm4_moe`` (GLM-4.5 / 4.5-Air: GQA with partial RoPE, q/k/v
biases and optional q/k norms on megatron-core's standard layer, and mla's DeepSeek-style MoE hooks), ``inkling``
(Inkling's text model: relative-position attention, short convolutions, sliding / full layers, a sink-routed MoE:
its own decoder, ``inkling_model.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Buckets = Iterator[list[tuple[str, torch.Tensor]]]


def _empty(*_args) -> dict:
    return {}


def _nothing(*_args) -> None:
    return None


def _no_buffers(_model) -> list:
    return []


def _no_prefix(_shape) -> str:
    return ""


@dataclass(frozen=True)
class Family:
    """One model family's hooks (defaults: the family adds nothing there)."""

    name: str                                   # shown in messages and docs ("gpt-oss")
    model_types: Mapping[str, str]              # config.json model_type -> the name shown for it
    # --- shape (model.ModelShape.from_hf_config)
    shape_fields: Callable[[Any], dict] | None = None   # every ModelShape field from config.json (the family reads
    #                                                    it all); None: model.py's generic reader with the 2 hooks below
    attention_fields: Callable[[Any], dict] = _empty     # generic reader: the attention's fields it sets differently
    moe_fields: Callable[[Any], dict] | None = None      # generic reader: the MoE fields (None: moe.hf_moe_fields)
    rope_types: tuple[str, ...] = ("default",)          # config.json rope_type values the generic reader accepts
    # --- model (model.transformer_config / build_gpt_model)
    config_kwargs: Callable[[Any], dict] = _empty        # TransformerConfig arguments it adds or overrides
    prepare: Callable[[torch.device], None] = _nothing   # megatron-core compatibility patches before a build
    core_attention: Callable[[Any], type | None] = _nothing     # the local spec's core attention for "sdpa" (None:
    #                                                             model.SDPACoreAttention)
    adapt_local_spec: Callable[[Any], None] = _nothing   # the local layer/block spec, after the core attention is set
    local_spec: Callable[[Any, type | None], Any] = _nothing   # (shape, core attention or None: megatron-core's
    #                                                 unfused) -> the family's own layer spec, used instead of the TE
    #                                                 and the default local spec (on every device); None: those
    block_spec: Callable[[Any, Any, Any], Any] | None = None   # (config, shape, core attention) -> the decoder block
    #                                                    spec of this pipeline stage, built by the family (per-layer
    #                                                    kinds, e.g. Qwen3-Next's hybrid layers); None: model.py's
    adapt_spec: Callable[[Any, Any, bool], None] = _nothing   # (spec, shape, te): either layer/block spec, last
    after_build: Callable[[Any, Any], None] = _nothing   # the built model (model, shape), before its first forward
    build_model: Callable[..., Any] | None = None        # builds the family's own model in place of model.py's GPTModel
    #                                                      (shape, config, padded_vocab=, device=, core_attention=, ...)
    own_context_parallel: bool = False          # its core attention runs CP itself where megatron-core's config
    #                                             refuses CP for the attention it names (DSA): model.py sets the CP
    #                                             size after the config's checks
    # --- weights (convert.py, export.py)
    hf_to_megatron: Callable[[str, str, dict, Any], torch.Tensor | None] = _nothing   # (suffix, 'model.layers.L.',
    #                                                                                    hf, shape); None: not its own
    hooks_name_top: bool = False                # the two hooks above also take the names outside the layers (whole,
    #                                             prefix ''), before top_names and the generic ones (DeepSeek-V4)
    megatron_to_hf: Callable[[str, str, torch.Tensor, Any], list | None] = _nothing  # (suffix, prefix, full, shape)
    text_prefix: Callable[[Any], str | None] = _nothing  # a multimodal checkpoint trained text-only: the prefix of its
    #      text decoder's ``model.*`` names (e.g. "model.language_model."): loaded from there, exported (weight sync,
    #      --save-hf) under it, the checkpoint's other tensors (towers) copied as they are by --save-hf; None: "model."
    column: tuple[str, ...] = ()                # parameter-name endings split over TP on dim 0 ...
    row: tuple[str, ...] = ()                   # ... and on dim 1
    glu_fc1: tuple[str, ...] = ()               # endings holding [gate; up] (each half split over TP on its own)
    tp_sections: Callable[[str, Any], tuple[int, ...] | None] = _nothing   # (name, shape): row sections of a full
    #                                             tensor, each split over TP on its own ((-1,): one; None: default)
    top_names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # megatron name outside the layers -> HF
    #                                             name, where it is not model.embed_tokens / model.norm / lm_head
    tp_partial: tuple[str, ...] = ()            # name parts of replicated parameters whose gradient each TP rank
    #                                             holds for its own heads only (summed over TP, as q/k layernorms')
    replicated_kv: bool = False                 # its attention replicates config.json's KV heads over a TP size that
    #                                             is a multiple of them (kv_replicate.py); else TP must divide them
    exported_buffers: Callable[[torch.nn.Module], list] = _no_buffers   # buffers exported with the parameters
    export_stream: Callable[[Buckets, Any], Buckets] | None = None     # the HF weight stream's last transform
    hf_state: Callable[[dict, Any], dict] | None = None  # (hf, shape) -> the checkpoint's tensors under the names
    #                                                    convert.py reads (e.g. Qwen3-Next's mtp.* as model.layers.N.*)
    mtp_prefix: str | None = None               # the HF name prefix of the MTP layers the export gives (None:
    #                                             model.layers.{num_layers + k}., DeepSeek-V3's)
    adapt_mtp_spec: Callable[[Any], Any] | None = None   # the MTP block spec -> the family's (e.g. its norms)
    # --- flags (options.py)
    check_flags: Callable[[Any, Any], None] = _nothing   # (megatron flags, shape): runs for EVERY shape, so a family
    #                                                     refuses its own flags on another one
    check_static: Callable[[Any, Any], None] = _nothing  # (options.Options, shape): runs for its own shapes only
    own_moe_dispatch: bool = False              # its MoE dispatches tokens over EP itself (Inkling's, in torch), not
    #                                             through megatron-core's dispatchers: moe.check_moe_static leaves
    #                                             --moe-token-dispatcher-type to its check_static
    fork_flags: Callable[[Any], dict] = _empty  # (shape) -> {MegatronConfig field: (config.json key, value)}: the
    #      flags of Miles's Megatron fork its config.json fixes (fork_flags.FORK_FLAGS: --experimental-attention-variant,
    #      --dsv4-*, --dsa-indexer-*, --activation-func-clamp-value) and any MLA / YaRN flag it reads in that fork's
    #      spelling (DeepSeek-V4's); fork_flags.py checks each one given, a FORK_FLAGS one not listed is refused
    linear_biases: bool = False                 # every linear has a bias (no --disable-bias-linear)
    mtp_key: str = "num_nextn_predict_layers"   # config.json's count of MTP layers (ModelShape.nextn_layers)
    swiglu: bool = True                         # its MLPs are SwiGLU (--swiglu with --num-layers; else refused)
    position_embedding: str = "rope"            # --position-embedding-type it accepts (Megatron-LM's name)
    # --- LoRA (miles/trainer/lora.py)
    lora_targets: tuple[str, ...] = ()          # leaf names of miles.config.lora.FAMILY_TARGETS it builds as LoRA targets
    #                                             (the gated DeltaNet's in_proj / out_proj); elsewhere refused
    lora_path_prefix: Callable[[Any], str] = _no_prefix  # (shape) -> what Megatron-Bridge's model puts before the
    #                                             decoder's module names (e.g. "language_model." for a multimodal
    #                                             checkpoint's text model): --target-modules paths are matched with it
    bridge_only: bool = False                   # Miles builds it only through Megatron-Bridge (from config.json):
    #                                             its scripts' shape flags are compared, switches (--swiglu, ...) not
    #                                             required with --num-layers


def _load() -> tuple[Family, ...]:
    from miles.trainer.megatron.families import (
        deepseek_v4,
        dense,
        dsa,
        gemma4,
        glm4_moe,
        gpt_oss,
        inkling,
        kimi_k25,
        mla,
        nemotron_h,
        qwen3_next,
    )

    return (dense.FAMILY, mla.FAMILY, kimi_k25.FAMILY, gpt_oss.FAMILY, dsa.FAMILY, nemotron_h.FAMILY, gemma4.FAMILY,
            deepseek_v4.FAMILY, qwen3_next.FAMILY, glm4_moe.FAMILY, inkling.FAMILY)


ALL: tuple[Family, ...] = _load()
FAMILIES: dict[str, str] = {mt: shown for f in ALL for mt, shown in f.model_types.items()}
_BY_TYPE = {mt: f for f in ALL for mt in f.model_types}


# model types no family builds whose nearest family is not the closest spelling (a family's helper removes its row)
NEAREST: dict[str, str] = {}


def nearest_family(model_type: str, families: Mapping[str, str] = FAMILIES) -> str:
    """The model type in ``families`` (and its name) closest to ``model_type``, for the refusal of a family not built."""
    if model_type in NEAREST:
        return NEAREST[model_type]
    close = difflib.get_close_matches(str(model_type), list(families), n=1, cutoff=0.75)
    return f"{close[0]} ({families[close[0]]})" if close else "none close to it"


def family_of(model_type: str | None) -> Family:
    """The family that builds ``model_type`` (KeyError when none does: ``model.ModelShape`` says so in one line)."""
    return _BY_TYPE[model_type]


def check_flags(m, shape) -> None:
    """Every family's flag checks (each refuses its own flags on another family's checkpoint)."""
    for f in ALL:
        f.check_flags(m, shape)


def column_endings() -> tuple[str, ...]:
    return tuple(c for f in ALL for c in f.column)


def row_endings() -> tuple[str, ...]:
    return tuple(c for f in ALL for c in f.row)


def glu_fc1_endings() -> tuple[str, ...]:
    return tuple(c for f in ALL for c in f.glu_fc1)


def tp_partial_parts() -> tuple[str, ...]:
    return tuple(c for f in ALL for c in f.tp_partial)
