"""The quickstart task's verifier (``--rm-type quickstart``): one-digit addition, exact answer.

A prompt is ``"a+b="`` with ``a + b <= 9``; the label is the sum as a string (``"7"``). The response
scores 1.0 when, with surrounding whitespace and special tokens removed, it equals the label, else 0.0.
The data and model are built by ``examples/quickstart/build.py``.
"""

from __future__ import annotations

from typing import Any

# Special tokens of miles.utils.tiny_model's tokenizer that may survive decoding without
# --rollout-skip-special-tokens.
_SPECIAL = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<pad>")


def normalize_answer(text: str) -> str:
    """The response with special tokens and surrounding whitespace removed."""
    for tok in _SPECIAL:
        text = text.replace(tok, "")
    return text.strip()


def quickstart_reward(response: str, label: Any) -> float:
    """1.0 when ``response`` is exactly the label (an int or its string), else 0.0.

    Raises ValueError when the label is missing: that is a data error (--label-key), not a wrong answer.
    """
    if label is None:
        raise ValueError("quickstart reward needs a label: pass --label-key label (the quickstart data has one).")
    return 1.0 if normalize_answer(response) == str(label).strip() else 0.0
