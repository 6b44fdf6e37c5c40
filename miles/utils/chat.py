"""Tokens and loss mask of a chat conversation, rendered with the tokenizer's chat template: the one implementation
behind the SFT rollout (``miles.rollout.sft_rollout``) and Miles's ``miles.utils.mask_utils``.

    ids, mask = conversation_tokens(tokenizer, messages, tools, where="row 3")   # mask: 1 on assistant turns' tokens
"""

from __future__ import annotations

from typing import Any

from miles.config.base import ConfigError
from miles.utils.errors import DataError

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
