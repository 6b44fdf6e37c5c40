"""Images of vision-language models, shared by the planes that read them (rollout data, engine, trainer).

:func:`load_image` opens a reference as the rollout stores it (a local path or a ``data:image/...;base64,`` URI)
as an RGB PIL image; :class:`VisionProcessor` is a VLM checkpoint's image side: its image processor
(``preprocessor_config.json``), the image placeholder token (``image_token_id`` of ``config.json``) and how many
placeholder tokens an image takes (one per merged patch, as the model's processor expands them).
:func:`train_inputs` is Miles's ``Sample.multimodal_train_inputs`` (the processor's tensors of a sample's images,
from the checkpoint the rollout manager names with :func:`set_rollout_checkpoint`); :func:`raw_inputs` and
:func:`inputs_refs` are Miles's ``Sample.multimodal_inputs`` (the images as PIL objects) and its way back to the
references the sample carries.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from functools import lru_cache
from pathlib import Path
from typing import Any


def decode_data_uri(ref: str) -> bytes:
    """The bytes of a ``data:image/<type>;base64,`` URI; ValueError saying what is wrong otherwise."""
    head, _, payload = ref.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError("not a data:image/<type>;base64, URI")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"bad base64 payload ({e})") from None


def png_data_uri(image: Any) -> str:
    """``data:image/png;base64,...`` of a PIL image's RGB pixels (what the engines take in ``image_data``)."""
    buf = io.BytesIO()
    (image if image.mode == "RGB" else image.convert("RGB")).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def load_image(ref: str) -> Any:
    """A PIL RGB image from a reference: an absolute path or a data URI."""
    from PIL import Image

    img = Image.open(io.BytesIO(decode_data_uri(ref))) if ref.startswith("data:") else Image.open(ref)
    img.load()
    return img.convert("RGB")


class VisionProcessor:
    """A VLM checkpoint's image processor and image token. Raises ValueError (one line, naming the directory and
    what is missing) for a directory that is not a VLM or has no loadable image processor."""

    def __init__(self, hf_checkpoint: str) -> None:
        from transformers import AutoImageProcessor

        cfg_path = Path(hf_checkpoint) / "config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.image_token_id = config.get("image_token_id")
        if self.image_token_id is None or "vision_config" not in config:
            raise ValueError(f"{hf_checkpoint} is not a vision-language model (its config.json needs vision_config and "
                             f"image_token_id; model_type {config.get('model_type')!r})")
        if not (Path(hf_checkpoint) / "preprocessor_config.json").is_file():
            raise ValueError(f"{hf_checkpoint} has no preprocessor_config.json (the image processor); copy it from the "
                             "model's release")
        try:
            self.processor = AutoImageProcessor.from_pretrained(hf_checkpoint)
        except (OSError, ValueError) as e:
            raise ValueError(f"the image processor of {hf_checkpoint} does not load ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]})") from None
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)

    def pixels(self, refs: list[str]) -> dict[str, Any]:
        """``{"pixel_values": [P, D], "image_grid_thw": [n, 3]}`` (CPU tensors) of the images, in order."""
        out = self.processor(images=[load_image(r) for r in refs], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def tokens_per_image(self, grid: Any) -> list[int]:
        return [int(t * h * w) // (self.merge ** 2) for t, h, w in grid.tolist()]


# ----------------------------------------------------------------------------- Sample.multimodal_train_inputs
MEDIA_KEY = "multimodal_inputs"          # the Sample.metadata entry holding {"images": [refs]}


def sample_images(metadata: dict[str, Any]) -> list[str]:
    """The image references of a sample (``metadata[MEDIA_KEY]["images"]``, in prompt order); [] without images."""
    media = metadata.get(MEDIA_KEY) if isinstance(metadata, dict) else None
    refs = media.get("images") if isinstance(media, dict) else None
    return list(refs) if refs else []


_ROLLOUT_CHECKPOINT: list[str] = []     # the --hf-checkpoint whose processor makes Sample.multimodal_train_inputs


def set_rollout_checkpoint(hf_checkpoint: str) -> None:
    """Name the checkpoint whose image processor ``Sample.multimodal_train_inputs`` uses (the rollout manager)."""
    _ROLLOUT_CHECKPOINT[:] = [str(hf_checkpoint)]


@lru_cache(maxsize=4)
def _processor(hf_checkpoint: str) -> VisionProcessor:
    return VisionProcessor(hf_checkpoint)


@lru_cache(maxsize=64)      # a group's samples share one computation (and its tensors)
def _train_inputs(hf_checkpoint: str, refs: tuple[str, ...]) -> dict[str, Any]:
    return _processor(hf_checkpoint).pixels(list(refs))


def train_inputs(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """Miles's ``Sample.multimodal_train_inputs`` of a sample: the image processor's ``pixel_values`` and
    ``image_grid_thw`` tensors of its images (None for a text sample). For plugins that read them: the trainer does
    not take them from the sample, it recomputes them from ``metadata[MEDIA_KEY]`` (the samples travel to the
    trainer ranks as references, not pixels)."""
    refs = sample_images(metadata)
    if not refs:
        return None
    if not _ROLLOUT_CHECKPOINT:
        raise RuntimeError("Sample.multimodal_train_inputs is computed by the rollout manager's image processor; "
                           "none is set here (miles.utils.images.set_rollout_checkpoint).")
    return dict(_train_inputs(_ROLLOUT_CHECKPOINT[0], tuple(refs)))


# ----------------------------------------------------------------------------- Sample.multimodal_inputs
def raw_inputs(metadata: dict[str, Any]) -> tuple[dict[str, Any] | None, list[tuple[Any, str]]]:
    """Miles's ``Sample.multimodal_inputs`` of a sample: ``{"images": [PIL RGB images], "videos": None}`` in prompt
    order (None without images), and each image paired with the reference it was loaded from."""
    refs = sample_images(metadata)
    images = [load_image(r) for r in refs]
    return ({"images": images, "videos": None} if refs else None), list(zip(images, refs))


def inputs_refs(inputs: Any, loaded: list[tuple[Any, str]]) -> list[str]:
    """The references of a ``Sample.multimodal_inputs`` value, in order: an image loaded from a reference keeps it, a
    new PIL image becomes a PNG data URI, a string must be an absolute path or a ``data:image/`` URI. ValueError (one
    line) for a value the trainer could not use: not a dict, videos or other media (only images are supported)."""
    if inputs is None:
        return []
    if not isinstance(inputs, dict):
        raise ValueError(f"Sample.multimodal_inputs must be a dict such as {{'images': [...]}} or None, got "
                         f"{type(inputs).__name__}")
    other = [k for k, v in inputs.items() if k != "images" and v]
    if other:
        raise ValueError(f"Sample.multimodal_inputs[{other[0]!r}]: only images are supported here (as --multimodal-keys "
                         "takes image columns only); leave it None or empty")
    images = inputs.get("images") or []
    if not isinstance(images, list | tuple):
        raise ValueError(f"Sample.multimodal_inputs['images'] must be a list, got {type(images).__name__}")
    refs = []
    for i, img in enumerate(images):
        ref = next((r for im, r in loaded if im is img), None)
        if ref is None and isinstance(img, str):
            if not (img.startswith("data:image/") or Path(img).is_absolute()):
                raise ValueError(f"Sample.multimodal_inputs['images'][{i}] {img[:60]!r}: a string must be an absolute "
                                 "path or a data:image/...;base64, URI")
            ref = img
        elif ref is None:
            if not (hasattr(img, "mode") and hasattr(img, "save")):
                raise ValueError(f"Sample.multimodal_inputs['images'][{i}] is a {type(img).__name__}; expected a PIL "
                                 "image, an absolute path or a data:image URI")
            ref = png_data_uri(img)
        refs.append(ref)
    return refs
