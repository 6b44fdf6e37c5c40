"""The ``--rm-type math`` verifier: extract the final answer, normalise it, compare with the label.

Extraction: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces allowed); without
one, the last number in the response. Normalisation removes ``$``, spaces, ``\\left``/``\\right``,
``\\text{}``/``\\mathrm{}`` wrappers, degree and percent signs, thousands separators, a leading ``x =``
and a trailing period, and turns ``\\frac{a}{b}`` / ``\\dfrac`` / ``a/b`` into a fraction. Two answers
match when their normalised strings are equal or both are numbers within 1e-6 (relative).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if i < len(text) and text[i] == " ":
        m = re.match(r" ([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced braces: no answer


def extract_answer(text: str) -> str | None:
    """The boxed answer, else the last number in ``text``, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_wrappers(s: str) -> str:
    for cmd in ("\\text", "\\mathrm", "\\textbf", "\\mathbf", "\\boxed"):
        while (k := s.find(cmd + "{")) >= 0:
            depth, j = 0, k + len(cmd)
            for j in range(k + len(cmd), len(s)):
                if s[j] == "{":
                    depth += 1
                elif s[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
            s = s[:k] + s[k + len(cmd) + 1:j] + s[j + 1:]
    return s


def normalize(answer: str) -> str:
    s = _strip_wrappers(str(answer).strip())
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
                     ("$", ""), ("dfrac", "frac"), ("tfrac", "frac"), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\%", ""), ("%", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[a-zA-Z]\w*=", "", s)  # "x=5" -> "5"
    s = s.rstrip(".")
    s = re.sub(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def to_number(s: str) -> Fraction | float | None:
    try:
        if re.fullmatch(r"-?\d+/\d+", s):
            return Fraction(s)
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(e-?\d+)?", s):
            return float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(predicted: str, reference: str) -> bool:
    a, b = normalize(predicted), normalize(reference)
    if a == b and a != "":
        return True
    x, y = to_number(a), to_number(b)
    if x is None or y is None:
        return False
    x, y = float(x), float(y)
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def math_reward(response: str, label: Any) -> float:
    """1.0 when the response's final answer equals the label's, else 0.0. A missing label is an error."""
    if label is None:
        raise ValueError("--rm-type math needs a label: pass --label-key naming the answer field.")
    reference = str(label)
    boxed_label = extract_boxed(reference)
    if boxed_label is not None:
        reference = boxed_label
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, reference) else 0.0
