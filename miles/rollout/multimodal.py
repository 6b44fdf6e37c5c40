"""Multimodal (image) prompts: Miles's ``--multimodal-keys`` for SFT and RL of vision-language models.

``--multimodal-keys '{"image": "images"}'`` (Miles's meaning) maps a media type to the data column that holds
that row's media, in order. Each ``<image>`` placeholder in a message's string content takes the next item
of the column; the message becomes a content list ``[{"type": "text", ...}, {"type": "image"}, ...]`` that the
model's chat template renders (Qwen3-VL: ``<|vision_start|><|image_pad|><|vision_end|>``). Only images are
supported (Miles also names ``video`` and ``audio``).

An image item is a local path (absolute, ``file://``, or relative to the data file's folder, then to the
working directory), a ``data:image/...;base64,`` URI, or a Parquet image struct ``{"bytes": ..., "path": ...}``
(as Hugging Face datasets write them). Every image is opened when the data is loaded (so ``--dry-run`` names
a bad one: ``file:line``, the column, the item, the fix); remote URLs are refused (download them first).
Rows carry their images as JSON-able references in ``metadata["multimodal_inputs"] = {"images": [...]}``
(absolute paths or data URIs) from the data source to the trainer.

:class:`ImageInputs` is the model side, loaded from ``--hf-checkpoint``: its image processor
(``preprocessor_config.json``) turns a sample's images into ``pixel_values`` / ``image_grid_thw``, and the
placeholder token (``image_token_id`` of ``config.json``) is expanded to one token per merged patch, as
the model's processor does. RL prompts are expanded when the data is loaded (``miles.rollout.data``), SFT
conversations by the SFT rollout; the trainer recomputes the pixels from the same references (the same
processor, so the counts agree; checked). The engines get each image as SGLang's ``image_data`` entry
(:func:`image_data`: ``data:image/png;base64,...``, as Miles sends them); :func:`train_inputs` (from
:mod:`miles.utils.images`, where ``Sample`` reads it) is Miles's ``Sample.multimodal_train_inputs`` for plugins.
"""

from __future__ import annotations

import base64
import io
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from miles.config.base import ConfigError
from miles.rollout.data import DataError
from miles.utils.images import (
    MEDIA_KEY,
    VisionProcessor,
    load_image,
    png_data_uri,
    sample_images,
    set_rollout_checkpoint,
    train_inputs,
)
from miles.utils.images import decode_data_uri as _decode_data_uri

__all__ = ["MEDIA_KEY", "PLACEHOLDERS", "ImageInputs", "content_messages", "engine_image", "image_data",
           "image_inputs", "load_image", "row_media", "sample_images", "set_rollout_checkpoint", "train_inputs"]

PLACEHOLDERS = {"image": "<image>"}     # Miles's MultimodalTypes placeholders this project supports


class MediaError(DataError):
    """A row's media cannot be used; the message names the row, the column, the item and the fix."""


def _normalize(item: Any, base_dir: Path) -> str:
    """One image item -> a checked reference (absolute path or data URI); ValueError says why not."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, dict) and (item.get("bytes") is not None or item.get("path")):
        if item.get("bytes") is not None:
            raw = item["bytes"]
            data = raw if isinstance(raw, bytes | bytearray) else base64.b64decode(str(raw))
            item = "data:image/png;base64," + base64.b64encode(bytes(data)).decode("ascii")
        else:
            item = item["path"]
    if not isinstance(item, str) or not item:
        raise ValueError(f"expected a path, a data:image URI or an image struct, got {type(item).__name__} "
                         f"{str(item)[:60]!r}")
    if re.match(r"^(https?|s3|gs)://", item):
        raise ValueError("remote images are not fetched: download them and give local paths")
    if item.startswith("data:"):
        ref = item
        try:
            Image.open(io.BytesIO(_decode_data_uri(item))).verify()
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"the data URI is not a readable image ({e})") from None
        return ref
    path = Path(item.removeprefix("file://"))
    if not path.is_absolute():
        tried = [base_dir / path, Path.cwd() / path]
        path = next((p for p in tried if p.is_file()), tried[0])
        if not path.is_file():
            raise ValueError(f"image file {item!r} does not exist (looked in the data file's folder {str(base_dir)!r} "
                             f"and the working directory {str(Path.cwd())!r})")
    if not path.is_file():
        raise ValueError(f"image file {str(path)!r} does not exist")
    try:
        with Image.open(path) as img:
            img.verify()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{str(path)!r} is not a readable image ({type(e).__name__}: {e})") from None
    return str(path.resolve())


def row_media(row: dict[str, Any], keys: dict[str, str], where: str, base_dir: Path) -> dict[str, list[str]]:
    """``{"images": [refs]}`` of one data row (checked: every image opens), for ``metadata[MEDIA_KEY]``."""
    out: dict[str, list[str]] = {}
    for kind, column in keys.items():
        value = row.get(column)
        if value is None:
            raise MediaError(f"{where}: missing column '{column}' (set by --multimodal-keys for {kind}); keys present: "
                             f"{sorted(row)}. Fix the data or --multimodal-keys.")
        items = list(value) if isinstance(value, list | tuple) else [value]
        refs = []
        for i, item in enumerate(items):
            try:
                refs.append(_normalize(item, base_dir))
            except ValueError as e:
                raise MediaError(f"{where}: --multimodal-keys {kind} column '{column}' item {i}: {e}.") from None
        out[f"{kind}s"] = refs
    return out


def content_messages(messages: list[dict[str, Any]], media: dict[str, list[str]], where: str) -> list[dict[str, Any]]:
    """Miles's placeholder split: each ``<image>`` in a string content becomes ``{"type": "image"}`` (the images
    stay in ``media``); the count of placeholders must match the row's images."""
    n_images = len(media.get("images", []))
    pattern = "(" + "|".join(re.escape(p) for p in PLACEHOLDERS.values()) + ")"
    out, used = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and PLACEHOLDERS["image"] in content:
            parts = []
            for seg in re.split(pattern, content):
                if seg == PLACEHOLDERS["image"]:
                    parts.append({"type": "image"})
                    used += 1
                elif seg:
                    parts.append({"type": "text", "text": seg})
            m = {**m, "content": parts}
        elif isinstance(content, list):
            used += sum(1 for c in content if isinstance(c, dict) and c.get("type") == "image")
        out.append(m)
    if used != n_images:
        raise MediaError(f"{where}: the conversation has {used} image placeholder(s) ('<image>' in a message) but the "
                         f"row has {n_images} image(s) under --multimodal-keys: make them match.")
    return out


class ImageInputs(VisionProcessor):
    """A VLM checkpoint's image side (:class:`~miles.utils.images.VisionProcessor`), its problems named under
    ``--multimodal-keys``, and the expansion of each image's placeholder token."""

    def __init__(self, hf_checkpoint: str) -> None:
        try:
            super().__init__(hf_checkpoint)
        except ValueError as e:
            raise ConfigError(f"--multimodal-keys needs a vision-language --hf-checkpoint: {e}.") from None

    def expand(self, ids: list[int], mask: list[int], counts: list[int], where: str) -> tuple[list[int], list[int]]:
        """Each placeholder token (one per image, in order) repeated to its image's token count."""
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(counts):
            raise MediaError(f"{where}: the rendered conversation has {len(slots)} image token(s) but {len(counts)} "
                             "image(s); the chat template must render each image item once.")
        out_ids: list[int] = []
        out_mask: list[int] = []
        prev = 0
        for slot, n in zip(slots, counts):
            out_ids += ids[prev:slot] + [self.image_token_id] * n
            out_mask += mask[prev:slot] + [0] * n
            prev = slot + 1
        return out_ids + ids[prev:], out_mask + mask[prev:]


@lru_cache(maxsize=4)
def image_inputs(hf_checkpoint: str) -> ImageInputs:
    """The (cached) :class:`ImageInputs` of a checkpoint."""
    return ImageInputs(hf_checkpoint)


# ----------------------------------------------------------------------------- rollout requests
@lru_cache(maxsize=128)     # a group's samples (and its retries) send the same images
def engine_image(ref: str) -> str:
    """One image as the engines take it in ``image_data``: ``data:image/png;base64,...`` of its RGB pixels (what
    Miles's ``encode_image_for_rollout_engine`` sends to SGLang)."""
    return png_data_uri(load_image(ref))


def image_data(metadata: dict[str, Any]) -> list[str] | None:
    """SGLang's ``image_data`` of a sample's ``/generate`` requests (one entry per image, in prompt order), or None
    for a text sample. Every request of the sample sends them: its ``input_ids`` hold the images' tokens."""
    refs = sample_images(metadata)
    return [engine_image(r) for r in refs] if refs else None
