"""Vision-language models (Qwen3-VL) in the FSDP trainer: image inputs of a micro-batch.

The samples carry their images as references (``metadata["multimodal_inputs"]``, see
:mod:`miles.rollout.multimodal`) and their token ids with the image placeholder already expanded. On each
trainer rank :func:`sample_inputs` turns a sample's images into ``pixel_values`` / ``image_grid_thw`` with the
image processor of --hf-checkpoint and checks that the sample has exactly the image tokens those grids need.

A VLM micro-batch always runs as right-padded rows (``batching.padded_rows``) with no ``position_ids``: the
HF model computes Qwen3-VL's M-RoPE 3-D positions per row itself (``get_rope_index`` over
``mm_token_type_ids``), runs the vision tower on the micro-batch's images, scatters the image embeddings at
the image tokens and adds the deepstack features in its first decoder layers. The vision tower is not a
separate FSDP unit (:func:`is_vision_block`): it belongs to the root, which every rank gathers on every
forward, and a micro-batch without images adds ``0 * sum`` of its parameters (:func:`vision_anchor`), so
every rank has gradients for the same parameters (FSDP's reduce-scatter needs that).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles.config.base import ConfigError
from miles.types import Sample
from miles.utils.images import load_image

MEDIA_KEY = "multimodal_inputs"   # miles.rollout.multimodal.MEDIA_KEY (the trainer does not import the rollout)


def is_vlm(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def text_config(config: Any) -> Any:
    """The language model's config (``text_config`` of a VLM, else the config itself)."""
    return getattr(config, "text_config", None) or config if is_vlm(config) else config


def is_vision_block(module: nn.Module) -> bool:
    return "Vision" in type(module).__name__


class ImageProcessor:
    """The image processor of a VLM checkpoint (``preprocessor_config.json``)."""

    def __init__(self, hf_checkpoint: str, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(hf_checkpoint)
        except (OSError, ValueError, ImportError) as e:      # no preprocessor_config.json, a backend not installed
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"--hf-checkpoint {hf_checkpoint}: the FSDP backend could not load this "
                              f"vision-language checkpoint's image processor ({why}); give the checkpoint its "
                              "preprocessor_config.json and install what its image processor needs, or add "
                              "--train-backend megatron.") from None
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)
        self.image_token_id = int(image_token_id)

    def sample_inputs(self, s: Sample, where: str) -> dict[str, torch.Tensor] | None:
        """``{"pixel_values", "image_grid_thw"}`` of one sample's images (None without images); the sample's
        image-token count must be what the grids need."""
        refs = (s.metadata.get(MEDIA_KEY) or {}).get("images") or []
        n_tokens = sum(1 for t in s.tokens if t == self.image_token_id)
        if not refs:
            if n_tokens:
                raise ValueError(f"{where}: {n_tokens} image token(s) but no images in metadata['{MEDIA_KEY}'].")
            return None
        out = self.processor(images=[load_image(r) for r in refs], return_tensors="pt")
        grid = out["image_grid_thw"]
        need = int(grid.prod(dim=-1).sum()) // (self.merge ** 2)
        if need != n_tokens:
            raise ValueError(f"{where}: {n_tokens} image token(s) but its {len(refs)} image(s) need {need}: the rollout "
                             "and the trainer used different image processors (same --hf-checkpoint on both).")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}


def batch_inputs(per_sample: list[dict[str, torch.Tensor] | None], sample_ids: list[int], input_ids: torch.Tensor,
                 image_token_id: int, device: torch.device, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The forward kwargs of one micro-batch (rows in ``sample_ids`` order): images concatenated in row order,
    ``mm_token_type_ids`` 1 at image tokens. Empty for a micro-batch without images."""
    chosen = [per_sample[i] for i in sample_ids if per_sample[i] is not None]
    if not chosen:
        return {}
    pixels = torch.cat([c["pixel_values"] for c in chosen]).to(device)
    return {"pixel_values": pixels.to(dtype) if dtype is not None else pixels,
            "image_grid_thw": torch.cat([c["image_grid_thw"] for c in chosen]).to(device),
            "mm_token_type_ids": (input_ids == image_token_id).to(torch.int32)}


def vision_anchor(hf_model: nn.Module) -> torch.Tensor:
    """``0 * sum`` of the vision tower's parameters: a zero that gives each of them a (zero) gradient."""
    visual = getattr(getattr(hf_model, "model", hf_model), "visual", None)
    params = [p for p in visual.parameters() if p.requires_grad] if visual is not None else []
    if not params:
        return torch.zeros(())
    return torch.stack([p.sum() for p in params]).sum() * 0.0
