"""Top-k on-policy distillation (``--opd-log-prob-top-k K`` > 0), Miles's recipe through its OPD plugin.

Instead of the teacher's log-prob of the one sampled token, each response position t compares student and
teacher on a set S_t of token ids (``--opd-top-k-strategy``):

- ``only-student``: the student's top-K ids at t (kept from generation: ``top_logprobs_num`` K, in
  ``metadata["opd_student_top_logprobs"]``); the teacher scores those ids (``token_ids_logprob``);
- ``only-teacher``: the teacher's top-K ids (``top_logprobs_num`` K on its prefill); the student's engines
  score those ids (a prefill through the rollout client);
- ``intersection`` / ``union`` / ``xor``: of the two top-K sets (both sides score what they lack).

The per-token estimate ``rkl_t = sum_{v in S_t} w_v (log p_student(v) - log p_teacher(v))`` with weights
(``--opd-reward-weight-mode``) ``student_p`` (``p_student``), ``teacher_p`` or ``none`` (1), normalised over
S_t (a softmax of the log-probs; ``xor``: unnormalised ``exp``), is stored in
``metadata["opd_reverse_kl"]`` and the trainer uses it in place of ``log pi_student - log pi_teacher`` of
the sampled token: ``A_t -= --opd-kl-coef * rkl_t``. Log-probs come from SGLang's answers
(``output_top_logprobs``; ``input_top_logprobs`` / ``input_token_ids_logprobs`` of a prefill with
``logprob_start_len`` 0, whose first entry is a placeholder), so student and teacher share a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from miles.rollout.teacher import TeacherError
from miles.types import Sample

STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
STUDENT_TOP = frozenset(STRATEGIES) - {"only-teacher"}        # need the student's top-K from generation
TEACHER_TOP = frozenset(STRATEGIES) - {"only-student"}        # ask the teacher for its top-K
TEACHER_SCORES_STUDENT = frozenset({"only-student", "union", "xor"})
STUDENT_SCORES_TEACHER = frozenset({"only-teacher", "union", "xor"})
STUDENT_KEY = "opd_student_top_logprobs"
RKL_KEY = "opd_reverse_kl"

Rows = list[dict[int, float]]


def top_k(args: Any) -> int:
    return int(getattr(args, "opd_log_prob_top_k", 0) or 0) if getattr(args, "use_opd", False) else 0


def student_top_k(args: Any) -> int:
    """K when generation must keep the student's top-K log-probs (top-k OPD with a student-side strategy), else 0."""
    k = top_k(args)
    return k if k > 0 and getattr(args, "opd_top_k_strategy", "only-student") in STUDENT_TOP else 0


def _rows(entries: Iterable[Any] | None) -> Rows:
    """SGLang's per-position ``[[logprob, id, text], ...]`` lists as ``{id: logprob}`` (None/empty: {})."""
    return [{int(e[1]): float(e[0]) for e in (row or []) if e is not None and e[0] is not None}
            for row in entries or []]


def response_rows(answer: dict[str, Any], field: str, n: int, who: str) -> Rows:
    """The response positions' rows of a prefill answer's ``meta_info[field]`` (the first entry is a placeholder)."""
    values = (answer.get("meta_info") or {}).get(field) if isinstance(answer, dict) else None
    if values is None:
        raise TeacherError(f"{who}'s answer has no meta_info.{field}; top-k OPD needs an SGLang that returns it")
    rows = _rows(values[1:][-n:] if n else [])
    if len(rows) != n:
        raise TeacherError(f"{who}'s meta_info.{field} covers {len(rows)} response positions, expected {n}")
    return rows


def student_rows(sample: Sample) -> Rows:
    top = sample.metadata.get(STUDENT_KEY)
    n = sample.response_length
    if top is None or len(top) < n:
        got = "none" if top is None else f"{len(top)} positions"
        raise TeacherError(f"sample {sample.index}: top-k OPD needs the student's top-K log-probs of each of its {n} "
                           f"response tokens from generation (metadata[{STUDENT_KEY!r}]: {got}); a "
                           "--custom-generate-function-path must keep them (the default generate does)")
    return _rows(top[-n:] if n else [])


def union_ids(rows: Rows) -> list[int]:
    return sorted({i for row in rows for i in row})


def teacher_request(args: Any, sample: Sample) -> dict[str, Any]:
    """The extra fields of the teacher's prefill request."""
    strategy = args.opd_top_k_strategy
    extra: dict[str, Any] = {}
    if strategy in TEACHER_TOP:
        extra["top_logprobs_num"] = top_k(args)
    if strategy in TEACHER_SCORES_STUDENT:
        extra["token_ids_logprob"] = union_ids(student_rows(sample))
    return extra


def selected(strategy: str, student: list[int], teacher: list[int]) -> list[int]:
    s, t = set(student), set(teacher)
    if strategy == "only-student":
        return list(student)
    if strategy == "only-teacher":
        return list(teacher)
    if strategy == "intersection":
        return [i for i in student if i in t]
    if strategy == "union":
        return list(dict.fromkeys([*student, *teacher]))
    return [i for i in [*student, *teacher] if (i in s) != (i in t)]  # xor


def weights(student: list[float], teacher: list[float], mode: str, normalize: bool) -> list[float]:
    logps = student if mode == "student_p" else teacher if mode == "teacher_p" else [0.0] * len(student)
    if not logps:
        return []
    if not normalize:
        return [math.exp(x) for x in logps]
    top = max(logps)
    e = [math.exp(x - top) for x in logps]
    total = sum(e)
    return [x / total for x in e]


def _lookup(token: int, first: dict[int, float], second: dict[int, float], who: str, t: int) -> float:
    if token in first:
        return first[token]
    if token in second:
        return second[token]
    raise TeacherError(f"top-k OPD: no {who} log-prob for token {token} at response position {t}")


def reverse_kl(args: Any, sample: Sample, answer: dict[str, Any]) -> list[float]:
    """The per-response-token top-k reverse KL estimate of ``sample`` from ``reward_func``'s answer."""
    n = sample.response_length
    strategy, mode = args.opd_top_k_strategy, args.opd_reward_weight_mode
    teacher = answer.get("teacher") if isinstance(answer, dict) else None
    if not isinstance(teacher, dict):
        raise TeacherError(f"sample {sample.index}: top-k OPD expects reward_func's answer {{'teacher': ...}}, got "
                           f"{type(answer).__name__}")
    empty: Rows = [{} for _ in range(n)]
    s_top = student_rows(sample) if strategy in STUDENT_TOP else empty
    t_top = response_rows(teacher, "input_top_logprobs", n, "the teacher") if strategy in TEACHER_TOP else empty
    t_on_s = (response_rows(teacher, "input_token_ids_logprobs", n, "the teacher")
              if strategy in TEACHER_SCORES_STUDENT else empty)
    s_on_t = (response_rows(answer.get("student_on_teacher") or {}, "input_token_ids_logprobs", n, "the student")
              if strategy in STUDENT_SCORES_TEACHER else empty)
    out = []
    for t in range(n):
        ids = selected(strategy, list(s_top[t]), list(t_top[t]))
        s_lp = [_lookup(i, s_top[t], s_on_t[t], "student", t) for i in ids]
        t_lp = [_lookup(i, t_top[t], t_on_s[t], "teacher", t) for i in ids]
        w = weights(s_lp, t_lp, mode, normalize=strategy != "xor")
        out.append(sum(wi * (a - b) for wi, a, b in zip(w, s_lp, t_lp)))
    return out
