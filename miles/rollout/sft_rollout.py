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

__all__ = ["conversation_tokens", "generate_rollout", "multimodal_tokens"]

ROLLOUT_PATH = "--rollout-function-path miles.rollout.sft_rollout.generate_rollout"


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, **kwargs) if messages or generation_prompt else ""


def conversation_tokens(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None,
                        where: str = "a row") -> tuple[list[int], list[int]]:
    """(token ids, loss mask over all of them) of one conversation: 1 on assistant turns' own tokens."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"{ROLLOUT_PATH} renders conversations with the tokenizer's chat template, and the "
                          "tokenizer of --hf-checkpoint has none: use a tokenizer that ships one.")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"{where}: {ROLLOUT_PATH} needs a list of chat messages under --input-key, got "
                        f"{type(messages).__name__} {str(messages)[:80]!r}.")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so there is nothing to train on.")
    segments: list[tuple[str, int]] = []
    done = ""
    for i, m in enumerate(messages):
        trained = m["role"] == "assistant" and m.get("step_loss_mask", 1) == 1
        head = _render(tokenizer, messages[:i], tools, generation_prompt=True) if trained else done
        full = _render(tokenizer, messages[:i + 1], tools, generation_prompt=False)
        if not (head.startswith(done) and full.startswith(head)):
            raise DataError(f"{where}: the chat template does not render message {i} ({m['role']}) by appending to "
                            "the text before it, so its tokens cannot be located; use a ChatML-style template.")
        segments += [(head[len(done):], 0), (full[len(head):], 1 if trained else 0)]
        done = full
    ids: list[int] = []
    mask: list[int] = []
    for text, bit in segments:
        if text:
            piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids += piece
            mask += [bit] * len(piece)
    return ids, mask


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
