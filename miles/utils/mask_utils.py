"""Miles's ``miles.utils.mask_utils``: loss masks of chat conversations for plugins.

    gen = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type="qwen3")
    token_ids, loss_mask = gen.get_loss_mask(messages, tools=None)   # 1 on the assistant turns' own tokens
    gen.get_text_from_loss_mask(token_ids, loss_mask)                # the trained spans, decoded

Every template type (``qwen``, ``qwen3``) is rendered by this project's one implementation,
:func:`miles.utils.chat.conversation_tokens` (the chat template renders each message by appending, the
text an assistant message adds after the generation prompt is trained on, ``"step_loss_mask": 0`` turns a message
off); ``distill_qwen`` (or a ``qwen`` tokenizer with DeepSeek-R1-distill's ``<｜Assistant｜>`` token) trains on
the last message's raw content after the first message's prompt, as Miles does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MultiTurnLossMaskGenerator", "get_response_lengths"]

TYPES = ("qwen", "qwen3", "distill_qwen")


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask: the length from its first 1 to its end (0 without a 1), Miles's response length."""
    return [len(m) - m.index(1) if 1 in m else 0 for m in loss_masks]


class MultiTurnLossMaskGenerator:
    """Miles's class (see the module docstring)."""

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in TYPES:
            raise ValueError(f"tokenizer_type {tokenizer_type!r} is not supported; use one of {', '.join(TYPES)}.")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def _template(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        from miles.utils.chat import conversation_tokens

        return conversation_tokens(self.tokenizer, messages, tools, where="MultiTurnLossMaskGenerator")

    def gen_multi_turn_loss_mask_qwen(self, messages: list[dict], tools: list[dict] | None = None):
        return self._template(messages, tools)

    def gen_multi_turn_loss_mask_qwen3(self, messages: list[dict], tools: list[dict] | None = None):
        return self._template(messages, tools)

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: list[dict], tools: list[dict] | None = None):
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        prompt = self.tokenizer.apply_chat_template(messages[:1], **kwargs)
        prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        response_ids = list(self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
        trained = 1 if messages[-1].get("step_loss_mask", 1) == 1 else 0
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [trained] * len(response_ids)

    def get_loss_mask(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of ``messages`` by this generator's template type."""
        distill = self.tokenizer_type == "distill_qwen" or (
            self.tokenizer_type == "qwen" and "<｜Assistant｜>" in self.tokenizer.get_added_vocab())
        if distill:
            return self.gen_multi_turn_loss_mask_distill_qwen(messages, tools)
        return self._template(messages, tools)

    def get_loss_mask_with_multimodal_alignment(self, messages: list[dict], input_ids: list[int],
                                                tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """The loss mask of the messages' text parts, left-padded with 0 to the processor's ``input_ids``."""
        text = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                parts = [c.get("text", "") if isinstance(c, dict) and c.get("type") == "text" else c
                         for c in content if isinstance(c, str) or (isinstance(c, dict) and c.get("type") == "text")]
                m = {**m, "content": " ".join(parts)}
            text.append(m)
        _, mask = self.get_loss_mask(text, tools=tools)
        if len(input_ids) < len(mask):
            raise ValueError(f"input_ids ({len(input_ids)} tokens) are shorter than the text's loss mask "
                             f"({len(mask)}): the processor and the tokenizer tokenize differently.")
        return input_ids, [0] * (len(input_ids) - len(mask)) + mask

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """Each run of consecutive trained tokens, decoded."""
        spans: list[str] = []
        run: list[int] = []
        for tok, bit in zip(token_ids, loss_masks):
            if bit == 1:
                run.append(tok)
            elif run:
                spans.append(self.tokenizer.decode(run))
                run = []
        if run:
            spans.append(self.tokenizer.decode(run))
        return spans
