"""Kimi-K2.5 (config.json ``model_type`` ``kimi_k25``) on the Megatron backend: its text model, trained text-only.

    shape = ModelShape.from_hf_config(Kimi_K25Config)   # text_config's shape (DeepSeek-V3: MLA, YaRN, MoE)

Kimi-K2.5 is a vision-language model: a MoonViT tower and a projector in front of a text model whose ``text_config``
is DeepSeek-V3's architecture (model type ``deepseek_v3``; the hub's config.json says ``kimi_k2``, which transformers
maps to it). Miles trains it on text (radixark/miles@v0.1.0:scripts/run_kimi_k25.py: dapo-math prompts, the model's
shape flags those of Kimi-K2, scripts/models/kimi-k25.py), its converter
(radixark/miles@v0.1.0:miles/backends/megatron_utils/megatron_to_hf/kimi_vl.py) sending the text model under the
checkpoint's ``language_model.model.*`` / ``language_model.lm_head.weight`` names and the tower's (``vision_tower.*``,
``mm_projector.*``) as they are. Here the text model is built, loaded and exported by ``mla.py`` (every hook of its
family: MLA, YaRN, the DeepSeek-style MoE, their TP / EP layouts and checks); this module adds only the multimodal
checkpoint's layout:

- shape: ``text_config``'s (``mla.py``'s reader), the model type ``kimi_k25``; the embeddings are tied only when
  both config.json's ``tie_word_embeddings`` and ``text_config``'s say so (transformers' ``Kimi_K25Config`` defaults
  the outer one to true; K2.5's text model is untied, Miles's ``--untie-embeddings-and-output-weights``).
- names: the text decoder read from and exported under ``language_model.model.`` (``Family.text_prefix``), the output
  layer as ``language_model.lm_head.weight``; the tower's tensors are neither built nor exported (the engines keep
  the ones they loaded), and ``--save-hf`` copies them from ``--hf-checkpoint`` as they are. A checkpoint in another
  layout (transformers' in-memory names ``model.language_model.*``) is refused in one line.

Not built: the vision tower (images in Kimi-K2.5's prompts: the family trains text-only, as Miles's recipes do); a
prompt holding the image / video token ids is embedded as any token (transformers embeds them as id 0 before it
places image features there).
"""

from __future__ import annotations

import dataclasses

from miles.config.base import ConfigError
from miles.trainer.megatron.families import mla, yarn

MODEL_TYPES = {"kimi_k25": "Kimi-K2.5"}
TEXT_PREFIX = "language_model.model."          # the published checkpoint's text decoder (DeepSeek-V3's ``model.``)
LM_HEAD = "language_model.lm_head.weight"


def shape_fields(c) -> dict:
    """Every ``ModelShape`` field of a Kimi-K2.5 config.json: its ``text_config``'s (a DeepSeek-V3 config read by
    ``mla.py``'s hooks), model type ``kimi_k25``."""
    from miles.trainer.megatron.model import ModelShape

    text = getattr(c, "text_config", None)
    text_type = getattr(text, "model_type", None)
    if text_type not in yarn.FAMILIES:
        raise ValueError(f"a kimi_k25 config.json whose text_config has model_type {text_type!r}; Kimi-K2.5's text "
                         f"model is DeepSeek-V3's ({', '.join(sorted(yarn.FAMILIES))})")
    s = ModelShape.from_hf_config(text)
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    fields.update(model_type="kimi_k25",
                  tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)) and s.tie_embeddings)
    return fields


def hf_state(hf: dict, shape) -> dict:
    """The checkpoint as it is when it has the published layout (idempotent: also after ``convert.text_state`` moved
    the text decoder to ``model.*``); any other layout is refused in one line."""
    if any(k.startswith((TEXT_PREFIX, "model.layers.")) for k in hf):
        return hf
    some = next(iter(sorted(hf)), "(no tensor)")
    raise ConfigError(f"--hf-checkpoint: a Kimi-K2.5 (kimi_k25) checkpoint keeps its text model under {TEXT_PREFIX}* "
                      f"and {LM_HEAD} (moonshotai/Kimi-K2.5's layout), but this one has none of those names (e.g. "
                      f"{some}); use the published checkpoint's layout.")


FAMILY = dataclasses.replace(
    mla.FAMILY, name="Kimi-K2.5", model_types=MODEL_TYPES, shape_fields=shape_fields, hf_state=hf_state,
    text_prefix=lambda shape: TEXT_PREFIX, top_names={"output_layer.weight": LM_HEAD},
    # mla.py's FAMILY already checks the MLA / rope flags on every shape and gives its TP split endings: not twice
    check_flags=lambda m, shape: None, column=(), row=(), glu_fc1=())
