"""``--rm-type dapo``: DAPO's integer-answer check, with Miles's result shape.

The answer is the text after the last ``Answer:`` (case-insensitive, to the end of its line) within the
last 300 characters of the response; ``[INVALID]`` when there is none. It is normalised Minerva-style
(:func:`normalize_final_answer`: the part after the last ``=``, units and ``$``/``\\text{}``/``\\boxed{}``
wrappers removed, ``\\fracab`` braced, thousands commas dropped) and compared with the label,
normalised the same way and read as an integer (DAPO's answers all are; a non-integer label fails the
sample). The result is ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``; the trained reward is
``score`` (``--reward-key score`` as Miles's DAPO scripts pass; ``score`` is also used when
``--reward-key`` is unset).
"""

from __future__ import annotations

import re
from typing import Any

_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
         "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
         "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
         "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
         ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")


def normalize_final_answer(answer: str) -> str:
    s = str(answer).split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _DROP:
        s = s.replace(word, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for cmd in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{cmd}\{{)(.*?)(\}})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_reward(response: str, label: Any) -> dict[str, Any]:
    """``--rm-type dapo`` (Miles's ``math_dapo_utils.compute_score``)."""
    from miles.rollout.rm_hub.math_dapo_utils import compute_score

    return compute_score(response, str(label))
