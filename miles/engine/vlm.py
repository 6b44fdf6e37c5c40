"""Vision-language models (Qwen3-VL) in the embedded engine: SGLang's ``image_data`` on ``/generate``.

A request carries ``input_ids`` with each image's placeholder already expanded (one ``<|image_pad|>`` token per
merged patch of that image's grid, as the transformers processor returns them) and ``image_data``: one string per
image, in prompt order (``data:image/<type>;base64,...``, a local path or ``file://`` path, or bare base64).

* :class:`VisionInputs` (the HTTP side, off the event loop): decodes the images, runs the model directory's image
  processor (``preprocessor_config.json``) and checks that each run of image tokens in ``input_ids`` is exactly
  what its image's grid needs; every problem is a ``BadRequest`` (HTTP 400) of one line. The result, an
  :class:`ImageBatch`, rides on the request's ``GenSpec.mm``; its ``key`` (a digest of the image bytes) is part of
  the scheduler's prompt-sharing key, so two prompts with equal token ids but different images never share KV.
* :class:`VLMGenericLM` (the scheduler thread): the HF ``Qwen3VLForConditionalGeneration`` forward, one request at
  a time with one ``DynamicCache`` each (the generic path of ``model_runner``). At prefill it runs the vision tower
  on the request's pixels (the HF forward scatters the image embeddings at the image tokens and adds the deepstack
  features in the first decoder layers) with Qwen3-VL's 3-D M-RoPE positions (``get_rope_index``); it keeps each
  request's rope delta (``max position + 1 - prompt length``) and decodes token ``t`` at position ``t + delta`` on
  all three axes, as HF's ``generate`` does. Positions are passed explicitly, so the model's own ``rope_deltas``
  attribute (one value for the whole model) is never used and interleaved requests cannot see each other's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from miles.engine.generic_lm import _GenericLM
from miles.engine.protocol import BadRequest

VLM_MODEL_TYPES = {"qwen3_vl", "qwen3_vl_moe"}   # Qwen3-VL's M-RoPE (get_rope_index) and deepstack forward
RECENT_IMAGE_SETS = 64   # processed image sets kept by digest (the samples of an RL group reuse one)


def is_vlm(config: Any) -> bool:
    """A vision-language config the engine serves with images (Qwen3-VL)."""
    return getattr(config, "model_type", "") in VLM_MODEL_TYPES and getattr(config, "image_token_id", None) is not None


@dataclass
class ImageBatch:
    """The images of one prompt, ready for the vision tower (CPU tensors; moved to the device at prefill)."""

    pixel_values: torch.Tensor     # [patches, channels * temporal * patch * patch]
    grid: torch.Tensor             # image_grid_thw [images, 3]
    tokens: list[int]              # image tokens each image takes in input_ids
    key: str                       # digest of the images' bytes: prompts share KV only with equal images


def _image_bytes(ref: str, where: str) -> bytes:
    if re.match(r"^(https?|s3|gs)://", ref):
        raise BadRequest(f"{where}: remote images are not fetched by the embedded engine; send the image inline "
                         f"(data:image/png;base64,...) or as a local file path")
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest(f"{where}: a data URL must look like data:image/<type>;base64,<data>, got {ref[:40]!r}...")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"{where}: the data URL's base64 payload does not decode ({e})") from None
    path = ref.removeprefix("file://")
    if len(path) < 4096 and os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    try:
        return base64.b64decode(ref, validate=True)   # SGLang also takes bare base64
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: {ref[:60]!r} is neither a data:image/...;base64 URL, an existing local file, nor "
                         f"base64 image bytes") from None


def _open_image(raw: bytes, where: str):
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        raise BadRequest(f"{where}: not a readable image ({type(e).__name__}: {msg})") from None


def _runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the maximal runs of ``token`` in ``ids``, in order."""
    out, n = [], 0
    for t in ids:
        if t == token:
            n += 1
        elif n:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out


class VisionInputs:
    """A VLM model directory's image side: image processor, image token; builds an :class:`ImageBatch` per prompt."""

    def __init__(self, model_path: str, config: Any) -> None:
        from miles.utils.images import VisionProcessor

        try:
            inputs = VisionProcessor(model_path)
        except ValueError as e:  # one line at start
            raise ValueError(f"--hf-checkpoint {model_path}: {e}") from None
        self.inputs = inputs
        self._recent: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # digest -> (pixels, grid)
        self._lock = threading.Lock()
        self.image_token_id = int(config.image_token_id)
        vid = getattr(config, "video_token_id", None)
        self.video_token_id = int(vid) if vid is not None else None

    def check_text_only(self, ids: list[int], where: str) -> None:
        """A prompt without images must carry no image (or video) tokens."""
        n = sum(1 for t in ids if t == self.image_token_id)
        if n:
            raise BadRequest(f"{where}: input_ids has {n} image token(s) (id {self.image_token_id}) but no image_data; "
                             f"send the images as image_data (one per image, in prompt order)")
        self._no_video(ids, where)

    def _no_video(self, ids: list[int], where: str) -> None:
        if self.video_token_id is not None and self.video_token_id in ids:
            raise BadRequest(f"{where}: input_ids has video tokens (id {self.video_token_id}); video input is not "
                             f"supported by the embedded engine: send images, or use --rollout-engine sglang")

    def prepare(self, refs: list[str], ids: list[int], where: str = "GenerateReqInput.image_data") -> ImageBatch:
        """The pixels of ``refs`` (one per image, in prompt order) for the prompt ``ids``; BadRequest when an image
        does not decode or the image tokens in ``ids`` are not what the images' grids need."""
        self._no_video(ids, where)
        runs = _runs(ids, self.image_token_id)
        if len(runs) != len(refs):   # before any decoding: a request cannot make the engine process images it cannot use
            raise BadRequest(
                f"{where}: {len(refs)} image(s) but input_ids has {len(runs)} run(s) of image tokens (id "
                f"{self.image_token_id}, runs {runs[:16]}): each image's tokens must be one run (Qwen3-VL's template puts "
                f"<|vision_start|> and <|vision_end|> around each), and image_data needs one entry per image, in order")
        digest = hashlib.blake2b(digest_size=16)
        raws = []
        for k, ref in enumerate(refs):
            raw = _image_bytes(ref, f"{where}[{k}]")
            digest.update(len(raw).to_bytes(8, "little"))
            digest.update(raw)
            raws.append(raw)
        key = digest.hexdigest()
        with self._lock:
            hit = self._recent.get(key)
            if hit is not None:
                self._recent.move_to_end(key)
        if hit is None:   # RL sends each sample of a group as its own request: the group's images are processed once
            images = [_open_image(raw, f"{where}[{k}]") for k, raw in enumerate(raws)]
            try:
                out = self.inputs.processor(images=images, return_tensors="pt")
            except Exception as e:  # noqa: BLE001 - the images are the client's: its mistake, one line
                raise BadRequest(f"{where}: the image processor refused the images ({str(e).splitlines()[0][:160]})") from None
            hit = (out["pixel_values"], out["image_grid_thw"].to(torch.long))
            with self._lock:
                self._recent[key] = hit
                while len(self._recent) > RECENT_IMAGE_SETS:
                    self._recent.popitem(last=False)
        pixels, grid = hit
        need = self.inputs.tokens_per_image(grid)
        if runs != need:
            raise BadRequest(
                f"{where}: input_ids has {sum(runs)} image token(s) (id {self.image_token_id}) in runs {runs} but its "
                f"{len(refs)} image(s) need {need} (one per merged patch of each image's grid {grid.tolist()}): expand each "
                f"image's placeholder with this model's processor (AutoProcessor of the same checkpoint) and send one "
                f"image_data entry per image, in prompt order")
        return ImageBatch(pixels, grid, need, key)


class VLMGenericLM(_GenericLM):
    """Qwen3-VL through HF's forward: vision tower at prefill, M-RoPE positions with a per-request rope delta."""

    def __init__(self, model, max_slots: int, max_ctx: int, device: torch.device):
        super().__init__(model, max_slots, max_ctx, device)
        self.image_token_id = int(model.config.image_token_id)
        self.deltas: list[int] = [0] * max_slots

    def rope_positions(self, ids: torch.Tensor, images: ImageBatch | None) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, 1, T]`` of a prompt ``ids`` ``[1, T]`` and its rope delta."""
        if images is None:
            T = ids.shape[1]
            return torch.arange(T, device=ids.device).view(1, 1, T).expand(3, 1, T), 0
        types = (ids == self.image_token_id).to(torch.int32)
        pos, delta = self.model.model.get_rope_index(ids, types, image_grid_thw=images.grid.to(ids.device))
        return pos, int(delta.view(-1)[0])

    @torch.no_grad()
    def prefill(self, slot_start: int, seqs: list[list[int]], full_for: list[bool],
                mm: list[ImageBatch | None] | None = None):
        from transformers import DynamicCache

        def forward(row: int, slot: int, ids: torch.Tensor) -> torch.Tensor:
            images = mm[row] if mm is not None else None
            pos, delta = self.rope_positions(ids, images)
            kw = {}
            if images is not None:
                kw = {"pixel_values": images.pixel_values.to(self.device, non_blocking=True),
                      "image_grid_thw": images.grid.to(self.device)}
            logits, self.caches[slot] = self._run(ids, DynamicCache(), slot, position_ids=pos, **kw)
            self.deltas[slot] = delta
            return logits

        return self._prefill_rows(slot_start, seqs, full_for, forward)

    def _decode_inputs(self, slot: int, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The M-RoPE positions of ``slot``'s next token: its text position plus the request's rope delta."""
        return {"position_ids": (positions[slot: slot + 1] + self.deltas[slot]).view(1, 1, 1).expand(3, 1, 1)}

    def move_slot(self, src: int, dst: int, length: int) -> None:
        super().move_slot(src, dst, length)
        self.deltas[dst], self.deltas[src] = self.deltas[src], 0

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        super().share_prefix(src, dst, length)
        self.deltas[dst] = self.deltas[src]

    def release_slot(self, slot: int) -> None:
        super().release_slot(slot)
        self.deltas[slot] = 0
