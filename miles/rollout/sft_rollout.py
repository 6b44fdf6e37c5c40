"""SFT on chat ``messages`` the way Miles's SFT launchers run it.

    --rollout-function-path miles.rollout.sft_rollout.generate_rollout --loss-type sft_loss
    --input-key messages --prompt-data conversations.jsonl [--apply-chat-template] [--debug-train-only]

Each row's ``--input-key`` holds a conversation (a list of ``{"role", "content"}`` messages; tool specs
under ``--tool-key``). It is rendered with the tokenizer's chat template and the loss covers the
assistant turns only: the text each assistant message adds after the template's generation prompt
(its content and end-of-turn marker), unless the message sets ``"step_loss_mask": 0``. The response
runs from the first trained token to the end (Miles's ``response_length``); everything before it is
the prompt. No engine is involved; the reward is 0.

The template must render conversations incrementally (rendering one more message only appends
text), as ChatML-style templates do; otherwise the row is refused naming the turn.

With ``--multimodal-keys`` (a vision-language --hf-checkpoint, e.g. Qwen3-VL), each ``<image>`` placeholder
of a message becomes an image item (:mod:`miles.rollout.multimodal`), the template renders it (Qwen3-VL:
``<|vision_start|><|image_pad|><|vision_end|>``) and the image token is expanded to the image's merged-patch
count, as the model's processor does; image tokens are never trained on. The images themselves travel as
references in ``metadata["multimodal_inputs"]`` and the trainer turns them into pixel values.
"""

from __future__ import annotations

from typing import Any

from miles.config.base import ConfigError
from miles.rollout.data import DataError
from miles.rollout.multimodal import MEDIA_KEY
from miles.types import Sample, SampleStatus
from miles.utils.chat import ROLLOUT_PATH, conversation_tokens

__all__ = ["conversation_tokens", "generate_rollout", "multimodal_tokens"]



def multimodal_tokens(args: Any, messages: Any, media: dict[str, list[str]], tools: Any,
                      where: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation with images: ``<image>`` placeholders become image items that the
    chat template renders, and each image's placeholder token is repeated to its merged-patch count (the
    processor of --hf-checkpoint), masked out of the loss."""
    from miles.rollout.multimodal import content_messages, image_inputs

    if not isinstance(messages, list):
        raise DataError(f"{where}: {ROLLOUT_PATH} with --multimodal-keys needs a list of chat messages under "
                        f"--input-key, got {type(messages).__name__}.")
    images = image_inputs(str(args.hf_checkpoint))
    ids, mask = conversation_tokens(args.tokenizer, content_messages(messages, media, where), tools, where)
    refs = media.get("images", [])
    if not refs:
        return ids, mask
    counts = images.tokens_per_image(images.pixels(refs)["image_grid_thw"])
    return images.expand(ids, mask, counts, where)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list[list[Sample]]:
    """Miles's SFT rollout: ``--rollout-batch-size`` conversations as training samples (one per group)."""
    if evaluation:
        raise ConfigError(f"{ROLLOUT_PATH} makes training data only; evaluation uses the built-in rollout.")
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            where = data_source.where(sample) if hasattr(data_source, "where") else f"group {sample.group_index}"
            media = sample.metadata.get(MEDIA_KEY)
            if media:  # --multimodal-keys: image items in the messages, placeholder tokens expanded per image
                ids, mask = multimodal_tokens(args, sample.prompt, media, sample.metadata.get("tools"), where)
            else:
                ids, mask = conversation_tokens(args.tokenizer, sample.prompt, sample.metadata.get("tools"), where)
            first = mask.index(1) if 1 in mask else len(mask)
            if first == 0:
                raise DataError(f"{where}: the conversation starts with a trained assistant turn; the trainer needs "
                                "at least one prompt token (start with a system or user message).")
            sample.tokens = ids
            sample.response_length = len(ids) - first
            sample.loss_mask = mask[first:]
            sample.response = sample.prompt[-1].get("content", "") if sample.prompt[-1]["role"] == "assistant" else ""
            sample.reward = 0.0
            sample.status = SampleStatus.COMPLETED
    return groups
