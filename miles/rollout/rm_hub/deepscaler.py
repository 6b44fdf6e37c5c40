"""``--rm-type deepscaler`` and ``gemma_math``: grade the boxed answer after the model's thinking.

- ``deepscaler``: the solution is what follows the last ``</think>`` (or the first ``###Response``); a
  response with neither scores 0, so a model that never closes its thinking earns nothing.
- ``gemma_math``: the solution is what follows the last ``<channel|>`` (how Gemma-4 closes its
  thinking), or the whole response without one.

The solution's last ``\\boxed{...}`` is graded against the label by :func:`math_grader.grade` (string
check, then symbolic check). Rewards are 1 or 0 (ints, as Miles returns them).
"""

from __future__ import annotations

from typing import Any

from miles.rollout.rm_hub.math_answer import extract_boxed
from miles.rollout.rm_hub.math_grader import grade, reference_answer


def grade_solution(solution: str, label: Any) -> int:
    given = extract_boxed(solution)
    if given is None or label == "":
        return 0
    if not isinstance(label, str | int | float):
        raise ValueError(f"the label must be a string or a number, got {type(label).__name__} {str(label)[:80]!r}")
    truth = reference_answer(str(label))
    return 1 if truth is not None and grade(given, truth) else 0


def deepscaler_reward(response: str, label: Any) -> int:
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    return grade_solution(solution, label)


def gemma_math_reward(response: str, label: Any) -> int:
    return grade_solution(response.rsplit("<channel|>", 1)[-1], label)


get_deepscaler_rule_based_reward = deepscaler_reward  # Miles's names
get_gemma_math_reward = gemma_math_reward
