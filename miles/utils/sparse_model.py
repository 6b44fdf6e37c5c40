"""A full-size HF model directory whose weights take no disk space: for checks that read shapes, never data.

    build_sparse_model("/tmp/qwen3-4b", config)   # config: the real model's config.json, as a dict

The directory holds the given ``config.json``, the tiny model's tokenizer (``miles.utils.tiny_model``; for a
vision-language config, with the vision tokens at the config's ids and Qwen3-VL's content-list chat template:
``miles.utils.tiny_vlm.build_vlm_tokenizer``) and
safetensors shards named and split the way ``save_pretrained`` names and splits them
(``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``). The tensor names and shapes
come from the transformers class of ``architectures[0]`` built on the meta device and converted back to the
on-disk layout (``revert_weight_conversion``: per-expert tensors of a MoE, as real checkpoints store them),
so each header is the one the real checkpoint has. Checkpoints with multi-token-prediction layers the
transformers class skips (GLM-4.7-Flash's and DeepSeek-V3's ``num_nextn_predict_layers``: ``model.layers.N..``
after the ``num_hidden_layers`` decoder layers) get them too, as the hub checkpoints store them: a decoder layer
plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.{norm,head}``. The data region is a sparse hole (seek and truncate):
the files have their full size, which ``miles.utils.model_dir`` compares with the headers, and take no
blocks. Reading a tensor gives zeros; nothing here is meant to be loaded into a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SAFETENSORS_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
MAX_SHARD_BYTES = 5 * 2**30  # the "5GB" shards of hub checkpoints (transformers 4 default; 5 * 10**9 there, 50GB in 5)


def checkpoint_tensors(config: dict[str, Any]) -> dict[str, list[int]]:
    """The tensor names and shapes of ``config``'s model as ``save_pretrained`` writes them (no memory used)."""
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    from miles.utils.hf_aliases import register_for

    d = dict(config)
    register_for(d.get("model_type"))          # kimi_k2 (hf_aliases)
    hf_config = AutoConfig.for_model(d.pop("model_type"), **d)
    if config.get("model_type") == "inkling_mm_model":    # transformers' class needs scipy (its vision tower)
        return _inkling_text_tensors(hf_config)
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ValueError(f"config.json names architecture {arch!r}, which transformers does not define")
    with torch.device("meta"):
        model = cls(hf_config)
    state = dict(model.named_parameters())  # tied weights appear once, as save_pretrained writes them
    skip = _non_persistent_names(model)
    state.update((n, b) for n, b in model.named_buffers() if n not in skip)
    state = revert_weight_conversion(model, state)
    out = {name: list(t.shape) for name, t in state.items()}
    if config.get("model_type") == "kimi_k25":   # the published names of its text layers (save_pretrained's differ)
        from miles.utils.tiny_kimi_k25 import published_name

        out = {published_name(name): shape for name, shape in out.items()}
    out.update(_mtp_tensors(config))
    return dict(sorted(out.items()))


def _inkling_text_tensors(hf_config) -> dict[str, list[int]]:
    """The released Inkling checkpoint's text-model tensors (``model.llm.*``, its own names: transformers' revert of
    the ``inkling_mm_model`` load-time conversion, on ``InklingForCausalLM`` of ``text_config``); the vision and
    audio towers are not listed (``InklingForConditionalGeneration`` needs scipy, not installed here)."""
    import types

    import torch
    from transformers import InklingForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = InklingForCausalLM(hf_config.text_config)
    state = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
             for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    layout = types.SimpleNamespace(_weight_conversions=get_checkpoint_conversion_mapping("inkling_mm_model"),
                                   config=None)
    return dict(sorted((n, list(t.shape)) for n, t in revert_weight_conversion(layout, state).items()))


MTP_MODEL_TYPES = ("glm4_moe", "glm4_moe_lite", "deepseek_v3", "kimi_k2", "joyai_llm_flash")   # transformers skips their model.layers.N.. (MTP) on load


def _mtp_tensors(config: dict[str, Any]) -> dict[str, list[int]]:
    """The multi-token-prediction layers' tensors of a GLM-4.5 / GLM-4.7-Flash / DeepSeek-V3 checkpoint (empty otherwise)."""
    n = int(config.get("num_nextn_predict_layers") or 0)
    if config.get("model_type") not in MTP_MODEL_TYPES or n <= 0:
        return {}
    layers = int(config["num_hidden_layers"])
    bigger = dict(config, num_hidden_layers=layers + n)
    if bigger.get("mlp_layer_types"):
        bigger["mlp_layer_types"] = list(bigger["mlp_layer_types"]) + ["sparse"] * n
    full = checkpoint_tensors({k: v for k, v in bigger.items() if k != "num_nextn_predict_layers"})
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    out: dict[str, list[int]] = {}
    for k in range(layers, layers + n):
        p = f"model.layers.{k}."
        out.update((name, shape) for name, shape in full.items() if name.startswith(p))
        out.update({p + "embed_tokens.weight": [v, h], p + "enorm.weight": [h], p + "hnorm.weight": [h],
                    p + "eh_proj.weight": [h, 2 * h], p + "shared_head.norm.weight": [h],
                    p + "shared_head.head.weight": [v, h]})
    return out


def _non_persistent_names(model) -> set[str]:
    return {f"{prefix}.{name}" if prefix else name for prefix, mod in model.named_modules()
            for name in getattr(mod, "_non_persistent_buffers_set", ())}


def _write_shard(path: Path, entries: dict[str, list[int]], dtype: str, width: int) -> int:
    """A safetensors file of ``entries``: a real header, then a hole of the data's size; returns the data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries.items():
        size = math.prod(shape) * width
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole, no blocks written
    return offset


def build_sparse_model(out_dir: str | Path, config: dict[str, Any], *,
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write ``config.json``, the tiny tokenizer and sparse safetensors shards of ``config``'s model to ``out_dir``
    (and for a vision-language config, a ``preprocessor_config.json`` with its vision tower's patch sizes)."""
    from miles.utils.tiny_model import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    from miles.utils.tiny_vlm import VISION_ID_KEYS, build_vlm_tokenizer

    # a Qwen3-VL-style VLM (its vision-start/end tokens): the vision tokens at the config's ids; another multimodal
    # checkpoint trained text-only (Gemma 4) gets the text tokenizer
    qwen_vl = isinstance(config.get("vision_config"), dict) and all(k in config for k in VISION_ID_KEYS)
    if qwen_vl:
        build_vlm_tokenizer(out, {k: int(config[k]) for k in VISION_ID_KEYS})
    else:
        build_tokenizer(out)
    if qwen_vl:                                            # its image processor's settings
        v = config["vision_config"]
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "patch_size": v.get("patch_size", 16),
            "temporal_patch_size": v.get("temporal_patch_size", 2), "merge_size": v.get("spatial_merge_size", 2),
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": 65536, "longest_edge": 16777216}}, indent=2) + "\n")
    dtype_name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    dtype, width = SAFETENSORS_DTYPES[dtype_name]
    shards: list[dict[str, list[int]]] = [{}]
    used = 0
    for name, shape in checkpoint_tensors(config).items():
        size = math.prod(shape) * width
        if shards[-1] and used + size > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = shape
        used += size
    weight_map: dict[str, str] = {}
    total = 0
    for i, entries in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(out / file, entries, dtype, width)
        weight_map.update((name, file) for name in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
