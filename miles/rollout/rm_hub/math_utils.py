"""Miles's ``rm_hub.math_utils``: boxed-answer extraction and the MATH graders by Miles's names, over this project's
grader (:mod:`miles.rollout.rm_hub.math_grader`, ``--rm-type math``).

- ``grade_answer_verl(solution_str, ground_truth)``: the last box of the solution against the label (itself boxed
  or not) under the string check or the symbolic check; False for an empty or missing label;
- ``grade_answer_mathd(given, truth)``: the Hendrycks-MATH string check on extracted answers;
- ``grade_answer_sympy(given, truth)``: the symbolic check (tuples element by element, sympy when safe);
- ``extract_answer(passage)``: the last box's content or None; ``last_boxed_only_string`` the box itself;
  ``remove_boxed`` its content (None when not a box); ``_normalize`` the symbolic check's normalisation.
"""

from __future__ import annotations

from miles.rollout.rm_hub.math_answer import extract_boxed
from miles.rollout.rm_hub.math_grader import grade_boxed, loose_normalize, strict_equal, symbolic_equal

__all__ = ["extract_answer", "grade_answer_mathd", "grade_answer_sympy", "grade_answer_verl",
           "last_boxed_only_string", "remove_boxed"]

_normalize = loose_normalize


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed x``) of ``string``, whole; None without one."""
    if not string:
        return None
    start = max(string.rfind("\\boxed"), string.rfind("\\fbox"))
    content = extract_boxed(string) if start >= 0 else None
    if content is None:
        return None
    cmd = "\\boxed" if string.startswith("\\boxed", start) else "\\fbox"
    if string.startswith(cmd + " ", start):
        return f"{cmd} {content}"
    return f"{cmd}{{{content}}}"


def remove_boxed(s: str | None) -> str | None:
    """The content of a whole ``\\boxed{...}`` / ``\\boxed x`` string, else None."""
    if not s:
        return None
    for left in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if s.startswith(left) and (left.endswith(" ") or s.endswith("}")):
            return s[len(left):] if left.endswith(" ") else s[len(left):-1]
    return None


def extract_answer(passage: str) -> str | None:
    """The content of the last box in ``passage``, or None."""
    return extract_boxed(passage) if passage else None


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    if not given_answer or ground_truth is None:
        return False
    return strict_equal(given_answer, ground_truth)


def grade_answer_sympy(given_answer: str, ground_truth: str | None) -> bool:
    if not given_answer or ground_truth is None:
        return False
    return symbolic_equal(given_answer, ground_truth)


def grade_answer_verl(solution_str: str, ground_truth: object) -> bool:
    if not ground_truth or not solution_str:
        return False
    return grade_boxed(solution_str, str(ground_truth))
