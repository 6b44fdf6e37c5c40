"""HF <-> megatron-core weights for the GPT families of ``model.py`` (our own converter).

Layouts (megatron-core names of the local spec; the transformer-engine spec keeps the input and
pre-MLP norms inside ``linear_qkv``/``linear_fc1`` as ``layer_norm_weight``, handled the same way):

- ``linear_qkv`` = per query group g: the group's ``nh/ng`` query heads, then its key head, then its
  value head (rows); bias likewise (Qwen2). Tensor parallelism splits it by whole groups.
- ``linear_fc1`` = ``[gate; up]`` (SwiGLU); under TP rank r holds ``[gate_r; up_r]``.
- Multi-latent attention and shared experts (``families/mla.py``): the HF projections as they are (whole heads per row
  block), the shared experts' ``linear_fc1`` = ``[gate; up]`` like a dense MLP; the router's ``expert_bias``
  buffer = ``mlp.gate.e_score_correction_bias``.
- A multimodal checkpoint trained text-only (``Family.text_prefix``, e.g. Gemma 4's ``model.language_model.*``):
  its text decoder read and written under that prefix, the towers neither loaded nor exported.
- ``word_embeddings`` / ``output_layer`` rows padded with zeros to the padded vocabulary; the output
  layer is absent when embeddings are tied (HF ``tie_word_embeddings``; ``lm_head.weight`` then absent).

``hf_to_megatron`` / ``megatron_to_hf`` convert full (TP=1) tensors; ``shard`` / ``unshard`` move
between a full tensor and the TP shards megatron-core's parameters hold (``partition_dim``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from miles.config.base import ConfigError
from miles.trainer.megatron import families, moe, mtp, vlm
from miles.trainer.megatron.model import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_SIMPLE = {  # megatron suffix -> HF suffix, per layer
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _qkv_split(shape: ModelShape) -> tuple[int, int, int]:
    d = shape.kv_channels
    return shape.num_attention_heads // shape.num_query_groups * d, d, d


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def family_hf_state(hf: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """``hf`` with the family's renames (``Family.hf_state``; e.g. Qwen3-Next's ``mtp.*`` as ``mtp.py`` reads MTP
    layers); idempotent."""
    return hf if shape.family.hf_state is None else shape.family.hf_state(hf, shape)


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape, padded_vocab: int,
                   names: list[str]) -> dict[str, torch.Tensor]:
    """Full megatron tensors for the megatron parameter ``names`` from a HF state dict."""
    out = {}
    q_rows, kv_rows, _ = _qkv_split(shape)
    ng = shape.num_query_groups
    top = shape.family.top_names           # the family's names outside the layers (Nemotron-H: backbone.*)
    if shape.vision and any(k.startswith(vlm.HF_LM_PREFIX) for k in hf):   # Qwen3-VL: the text model's names
        hf = vlm.text_hf_state(hf)
    hf = text_state(hf, shape)
    hf = family_hf_state(hf, shape)              # the family's renames (Family.hf_state)
    fam = shape.family
    for name in names:
        if fam.hooks_name_top and _LAYER.match(name) is None and (t := fam.hf_to_megatron(name, "", hf,
                                                                                       shape)) is not None:
            out[name] = _pad_rows(t, padded_vocab) if name in _VOCAB else t   # the family names it (DeepSeek-V4)
        elif vlm.is_vision(name):               # the vision tower: transformers' own module, names as in HF
            out[name] = hf[vlm.HF_VISION_PREFIX + name[len(vlm.VISION_PREFIX):]]
        elif name == "embedding.word_embeddings.weight":
            out[name] = _pad_rows(hf[top.get(name, "model.embed_tokens.weight")], padded_vocab)
        elif name == "output_layer.weight":
            out[name] = _pad_rows(hf[top.get(name, "lm_head.weight")], padded_vocab)
        elif name in ("decoder.final_layernorm.weight", "decoder.final_norm.weight"):
            out[name] = hf[top.get(name, "model.norm.weight")]
        elif mtp.is_mtp(name):                  # the MTP block: its own tensors, its decoder layer (mtp.py)
            own = mtp.own_hf_name(name, shape.num_layers)
            out[name] = hf[own] if own is not None else hf_to_megatron(
                hf, shape, padded_vocab, [mtp.decoder_name(name, shape.num_layers)]).popitem()[1]
        else:
            m = _LAYER.match(name)
            if m is None:
                raise KeyError(f"no HF source for megatron parameter {name}")
            i, suffix = m.group(1), m.group(2)
            p = f"model.layers.{i}."
            if (t := shape.family.hf_to_megatron(suffix, p, hf, shape)) is not None:    # the family's own names
                out[name] = t
            elif suffix in _SIMPLE:
                out[name] = hf[p + _SIMPLE[suffix]]
            elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = suffix.rsplit(".", 1)[1]
                q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
                rest = tuple(q.shape[1:])
                groups = [q.reshape((ng, q_rows) + rest), k.reshape((ng, kv_rows) + rest),
                          v.reshape((ng, kv_rows) + rest)]
                out[name] = torch.cat(groups, dim=1).reshape((-1,) + rest)
            elif suffix == "mlp.linear_fc1.weight":
                out[name] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0)
            elif (t := moe.hf_to_megatron(name, hf)) is not None:      # router, experts (EP-free names)
                out[name] = t
            else:
                raise KeyError(f"no HF source for megatron parameter {name}")
    return out


def text_state(hf: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint trained text-only (``Family.text_prefix``): its text decoder's tensors under
    ``model.*`` (``lm_head.weight`` as it is; the towers left out); other checkpoints as they are."""
    prefix = shape.family.text_prefix(shape)
    if prefix is None or not any(k.startswith(prefix) for k in hf):
        return hf
    return {("model." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in hf.items()
            if k.startswith(prefix) or not k.startswith("model.")}


def megatron_to_hf(name: str, full: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """HF tensors from one full megatron tensor (the norm copies of the TE spec map once); a vision-language
    model's under its checkpoint's names (``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``), a
    text-only-trained multimodal one's text decoder under its ``Family.text_prefix``."""
    if not shape.vision:
        pairs = _megatron_to_hf(name, full, shape)
        prefix = shape.family.text_prefix(shape)
        if prefix is None:
            return pairs
        return [(prefix + n[len("model."):] if n.startswith("model.") else n, t) for n, t in pairs]
    if vlm.is_vision(name):
        return [(vlm.HF_VISION_PREFIX + name[len(vlm.VISION_PREFIX):], full)]
    return [(vlm.hf_lm_name(n), t) for n, t in _megatron_to_hf(name, full, shape)]


def _megatron_to_hf(name: str, full: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    if name in shape.family.top_names:         # the family's names outside the layers (Nemotron-H: backbone.*)
        return [(shape.family.top_names[name], full[:shape.vocab_size] if name in (
            "embedding.word_embeddings.weight", "output_layer.weight") else full)]
    if shape.family.hooks_name_top and _LAYER.match(name) is None and (
            pairs := shape.family.megatron_to_hf(name, "", full, shape)) is not None:
        return pairs                            # a name the family gives outside the layers (DeepSeek-V4)
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", full[:shape.vocab_size])] + mtp.shared_copies(name, full, shape)
    if name == "output_layer.weight":
        return [("lm_head.weight", full[:shape.vocab_size])] + mtp.shared_copies(name, full, shape)
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", full)]
    if mtp.is_mtp(name):                        # the MTP block (mtp.py)
        own = mtp.own_hf_name(name, shape.num_layers)
        if own is not None:
            return [(own, full)]
        return _megatron_to_hf(mtp.decoder_name(name, shape.num_layers), full, shape)
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF name for megatron parameter {name}")
    p, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    if (pairs := shape.family.megatron_to_hf(suffix, p, full, shape)) is not None:    # the family's own names
        return pairs
    if suffix in _SIMPLE:
        return [(p + _SIMPLE[suffix], full)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q_rows, kv_rows, _ = _qkv_split(shape)
        rest = tuple(full.shape[1:])
        grouped = full.reshape((shape.num_query_groups, q_rows + 2 * kv_rows) + rest)
        q, k, v = grouped.split([q_rows, kv_rows, kv_rows], dim=1)
        return [(f"{p}self_attn.{x}_proj.{kind}", t.reshape((-1,) + rest)) for x, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    if (pairs := moe.megatron_to_hf(name, full)) is not None:         # router, experts (EP-free names)
        return pairs
    raise KeyError(f"no HF name for megatron parameter {name}")


def is_glu_fc1(name: str) -> bool:
    return name.endswith(("mlp.linear_fc1.weight", *families.glu_fc1_endings()))


_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
           "mlp.linear_fc1.weight", *mtp.COLUMN, *families.column_endings())
_ROW = ("linear_proj.weight", "mlp.linear_fc2.weight", *families.row_endings())


def partition_dim(name: str) -> int | None:
    """The TP split dim of a megatron-core parameter (by name: megatron-core only tags the ones it
    initialised itself), None when replicated (the vision tower of a VLM: whole on every rank)."""
    if vlm.is_vision(name):
        return None
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def _sections(name: str, full_rows: int, shape: ModelShape | None) -> list[int] | None:
    """The family's row sections of ``name`` (each split over TP on its own), None when it has none."""
    sec = shape.family.tp_sections(name, shape) if shape is not None else None
    return None if sec is None else [full_rows if s == -1 else s for s in sec]


def shard(name: str, full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int,
          shape: ModelShape | None = None) -> torch.Tensor:
    """This TP rank's piece of a full megatron tensor (``shape``: its family's sectioned tensors)."""
    if dim is None or tp_size == 1:
        return full
    if (sec := _sections(name, full.shape[0], shape)) is not None:
        return torch.cat([part.chunk(tp_size, dim=0)[tp_rank] for part in full.split(sec, dim=0)], dim=0)
    if is_glu_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def unshard(name: str, shards: list[torch.Tensor], dim: int | None, shape: ModelShape | None = None) -> torch.Tensor:
    """The full megatron tensor from every TP rank's piece (inverse of ``shard``)."""
    if dim is None or len(shards) == 1:
        return shards[0]
    tp = len(shards)
    if (sec := _sections(name, shards[0].shape[0] * tp, shape)) is not None:
        local = [s // tp for s in sec]
        parts = [sh.split(local, dim=0) for sh in shards]
        return torch.cat([parts[r][i] for i in range(len(sec)) for r in range(tp)], dim=0)
    if is_glu_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local HF model dir (safetensors, sharded or not), on CPU in float32."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not (path / f).is_file():
            raise ConfigError(f"--hf-checkpoint {path} has no {f}: --train-backend megatron reads HF safetensors "
                              "checkpoints; point --hf-checkpoint at a complete HF model directory.")
        out.update({k: v.float() for k, v in load_file(str(path / f)).items()})
    return out


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, hf: dict[str, torch.Tensor], shape: ModelShape, padded_vocab: int,
                 tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy a HF state dict into this rank's megatron-core parameters (every parameter is written); under
    expert parallelism this rank's experts (``moe.global_name``)."""
    params = dict(model.named_parameters()) | dict(shape.family.exported_buffers(model))
    num_local = shape.num_experts // ep_size if shape.num_experts else 0
    names = {name: moe.global_name(name, ep_rank, num_local) for name in params}
    hf = family_hf_state(hf, shape)
    mtp.check_mtp_tensors(hf, shape)
    full = hf_to_megatron(hf, shape, padded_vocab, list(names.values()))
    for name, p in params.items():
        piece = shard(name, moe.ep_rows(name, full[names[name]], ep_rank, num_local) if ep_size > 1
                      else full[names[name]], partition_dim(name), tp_rank, tp_size, shape)
        if tuple(piece.shape) != tuple(p.shape):
            raise ConfigError(f"--hf-checkpoint: the weight for {name} has shape {tuple(piece.shape)}, but config.json "
                              f"makes it {tuple(p.shape)}: config.json and the weights disagree; fix the checkpoint.")
        p.copy_(piece.to(p.dtype))
