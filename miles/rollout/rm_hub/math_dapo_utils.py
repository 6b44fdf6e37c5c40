"""Miles's ``rm_hub.math_dapo_utils``: DAPO's answer checks by Miles's names (``--rm-type dapo`` runs
:func:`compute_score`; the normalisation is :func:`miles.rollout.rm_hub.dapo.normalize_final_answer`).

- ``compute_score(solution_str, ground_truth, strict_box_verify=False)`` -> ``{"score": +-1.0, "acc", "pred"}``
  on the last 300 characters of the solution;
- ``is_correct_minerva(solution_str, gt, gt_need_extract=False)`` -> (correct, pred): the text after the last
  ``Answer:``, normalised, against the integer ground truth (its box content with ``gt_need_extract``);
- ``is_correct_strict_box(pred, gt)`` -> (1 | -1, box content or None): the last box of the final 100 characters,
  compared verbatim;
- ``last_boxed_only_string`` / ``remove_boxed``: the last ``\\boxed{...}`` and its content.
"""

from __future__ import annotations

import re
from typing import Any

from miles.rollout.rm_hub.dapo import normalize_final_answer
from miles.rollout.rm_hub.math_utils import last_boxed_only_string

__all__ = ["compute_score", "is_correct_minerva", "is_correct_strict_box", "last_boxed_only_string",
           "normalize_final_answer", "remove_boxed", "verify"]

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
_TAIL_CHARS = 300
_STRICT_TAIL_CHARS = 100


def remove_boxed(s: str) -> str:
    """The content of ``\\boxed{...}`` (AssertionError when ``s`` is not one box, as Miles's)."""
    left = "\\boxed{"
    assert s is not None and s.startswith(left) and s.endswith("}"), f"not a \\boxed{{...}} string: {s!r}"
    return s[len(left):-1]


def _integer(answer: str, raw: Any) -> str:
    try:
        return str(int(float(answer)))
    except ValueError:
        raise ValueError(f"--rm-type dapo needs an integer label, got {str(raw)[:80]!r}") from None


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = ANSWER_PATTERN) -> tuple[bool, str]:
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    truth = remove_boxed(last_boxed_only_string(gt) or "") if gt_need_extract else gt
    return pred == _integer(normalize_final_answer(truth), gt), pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index takes 4 indices, got {pause_tokens_index}")
        pred = pred[pause_tokens_index[-1] - _STRICT_TAIL_CHARS:]
    else:
        pred = pred[-_STRICT_TAIL_CHARS:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    correct, pred = verify(solution_str[-_TAIL_CHARS:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
