"""``--rm-type gpqa``: multiple choice, scored 1.0 or 0.0.

The right letter comes from ``metadata["correct_letter"]``, else from a one-letter label, else from a
numeric label (an index into the letters), else from the choice whose text equals the label. The
letters are ``metadata["valid_letters"]``, else one per ``metadata["choices"]``, else ``A``-``H``.

The response's letter (after any ``</think>``) is the first of ``answer/option/choice [is|:] X``,
``X is (the) correct``, ``final answer [is|:] X`` (case-insensitive), else the last standalone valid
capital letter. When both letters are known they decide. Otherwise the response scores 1.0 when it
contains (normalised: lower case, non-alphanumerics as spaces) the right choice's text,
``metadata["correct_answer"]``, ``metadata["answer_text"]`` or the label; and a found letter equal to a
letter-like label also scores 1.0.
"""

from __future__ import annotations

import re
import string
from typing import Any

DEFAULT_LETTERS = list(string.ascii_uppercase[:8])
_PATTERNS = (r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
             r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
             r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])")


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if text else ""


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def extract_letter(response: str, letters: list[str]) -> str | None:
    text = _after_thinking(response)
    valid = {x.upper() for x in letters}
    for pattern in _PATTERNS:
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m and m.group(1).upper() in valid:
            return m.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def gpqa_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    if response is None:
        return 0.0
    metadata = metadata or {}
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    elif choices is not None:
        choices = list(choices)
    if metadata.get("valid_letters"):
        letters = [str(x).upper() for x in metadata["valid_letters"]]
    elif choices:
        letters = list(string.ascii_uppercase[:len(choices)])
    else:
        letters = DEFAULT_LETTERS
    right = metadata.get("correct_letter")
    right = right.strip().upper() if isinstance(right, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if not right and len(label_text) == 1 and label_text.upper() in letters:
            right = label_text.upper()
    elif isinstance(label, int | float) and not isinstance(label, bool):
        if 0 <= int(label) < len(letters):
            right = letters[int(label)]
    right_text = None
    if not right and choices and label_text:
        for i, choice in enumerate(choices):
            if _norm(str(choice)) == _norm(label_text) and i < len(letters):
                right, right_text = letters[i], str(choice)
                break
    found = extract_letter(response, letters)
    if found and right:
        return 1.0 if found == right else 0.0
    targets = []
    if right and choices and right in letters and letters.index(right) < len(choices):
        targets.append(str(choices[letters.index(right)]))
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if right_text:
        targets.append(right_text)
    if label_text:
        targets.append(label_text)
    said = _norm(_after_thinking(response))
    if any(_norm(t) and _norm(t) in said for t in targets):
        return 1.0
    if found and not right and label_text:
        return 1.0 if found == label_text.upper() else 0.0
    return 0.0


# Miles's names (radixark/miles@v0.1.0:miles/rollout/rm_hub/gpqa.py)
compute_gpqa_reward = gpqa_reward
_normalize_text = _norm


def _strip_chain_of_thought(text: str | None) -> str:
    return _after_thinking(text or "")


def _extract_letter_from_response(response: str | None, valid_letters: Any) -> str | None:
    return extract_letter(response or "", list(valid_letters)) if response else None
