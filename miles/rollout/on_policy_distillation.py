"""On-policy distillation the way Miles's launch scripts run it (``--opd-type sglang`` with ``--rm-url``).

    --use-opd --opd-type sglang --rm-url http://TEACHER:PORT/generate
    --custom-rm-path miles.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path miles.rollout.on_policy_distillation.post_process_rewards

``reward_func`` sends each finished sample's exact token ids (prompt + response) to the teacher as a
prefill-only SGLang ``/generate`` (``max_new_tokens: 0``, ``return_logprob``, ``logprob_start_len: 0``)
and returns the teacher's answer as the sample's (raw) reward. ``post_process_rewards`` then takes the
teacher's log-prob of every response token from ``meta_info.input_token_logprobs`` into
``sample.metadata["teacher_log_probs"]`` (where the trainer's OPD term reads them; Miles keeps them
on ``sample.teacher_log_probs``) and gives every sample the task reward 0.0, so the learning signal is
the OPD term ``-opd_kl_coef * (log pi_student - log pi_teacher)`` alone.

With ``--opd-teacher-urls NAME=URL ...`` (Miles's multi-teacher map) each sample goes to the teacher
named by ``sample.metadata[--opd-teacher-key]``; the name ``default`` catches missing or unknown
names. Token ids are never re-tokenized: student and teacher must share a tokenizer. Each request is
bounded by ``--rm-timeout`` and retried ``--rm-max-retries`` times on connection errors, 429 and 5xx.
With ``--opd-log-prob-top-k K`` > 0 (top-k OPD, :mod:`miles.rollout.opd_topk`) ``reward_func`` asks the
teacher for its top-K and/or its log-probs of the student's top-K ids (``--opd-top-k-strategy``), and
the student's engines for theirs of the teacher's ids where the strategy needs them; ``post_process_rewards``
stores the per-token top-k reverse KL in ``metadata["opd_reverse_kl"]``, which the trainer's OPD term
uses instead of the sampled token's log-prob difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.config.base import ConfigError
from miles.rollout import opd_topk
from miles.rollout.opd_topk import student_top_k
from miles.rollout.plugins import reward_value
from miles.rollout.teacher import TeacherError, response_log_probs
from miles.types import Sample

__all__ = ["parse_teacher_urls", "post_process_rewards", "reward_func", "student_top_k"]

DEFAULT_TEACHER = "default"


def is_named_map(values: Iterable[str] | None) -> bool:
    """True when ``--opd-teacher-urls`` holds Miles's ``NAME=URL`` entries (not plain URLs)."""
    return any("=" in v and "://" not in v.split("=", 1)[0] for v in values or [])


def parse_teacher_urls(values: Iterable[str] | None) -> dict[str, str]:
    """``--opd-teacher-urls NAME=URL ...`` as a routing map; ConfigError for malformed or repeated names."""
    out: dict[str, str] = {}
    for value in values or []:
        name, sep, url = value.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url or "://" in name:
            raise ConfigError(f"--opd-teacher-urls entry {value!r}: expected NAME=URL (e.g. math=http://h1:30001/generate); "
                              "do not mix NAME=URL entries with plain URLs.")
        if name in out:
            raise ConfigError(f"Duplicate teacher name {name!r} in --opd-teacher-urls: give each name one URL.")
        out[name] = url
    return out


def teacher_url(args: Any, sample: Sample) -> str:
    """The teacher endpoint for ``sample``: routed by metadata with a NAME=URL map, else ``--rm-url``."""
    values = getattr(args, "opd_teacher_urls", None)
    if not is_named_map(values):
        url = getattr(args, "rm_url", None)
        if not url:
            raise ConfigError("miles.rollout.on_policy_distillation.reward_func sends samples to the teacher at --rm-url: "
                              "pass --rm-url http://TEACHER:PORT/generate (or --opd-teacher-urls NAME=URL ...).")
        return url
    routes = parse_teacher_urls(values)
    key = getattr(args, "opd_teacher_key", "opd_teacher")
    name = sample.metadata.get(key) if isinstance(sample.metadata, dict) else None
    if name is not None and str(name) in routes:
        return routes[str(name)]
    if DEFAULT_TEACHER in routes:
        return routes[DEFAULT_TEACHER]
    what = (f"sample {sample.index}: metadata[{key!r}] = {name!r} matches no --opd-teacher-urls name" if name is not None
            else f"sample {sample.index} is missing teacher key metadata[{key!r}] of --opd-teacher-urls")
    raise ValueError(f"{what} ({', '.join(sorted(routes))}) and there is no '{DEFAULT_TEACHER}=URL' entry to fall back to")


def score_payload(input_ids: list[int], top_k: int = 0, token_ids: list[int] | None = None,
                  token_ids_positions: list[list[int]] | None = None) -> dict[str, Any]:
    """A prefill-only SGLang /generate request returning the log-prob of every input token; ``top_k`` > 0: also
    each position's top-k (``top_logprobs_num``); ``token_ids``: also the log-probs of those ids at every position
    (``token_ids_logprob``); ``token_ids_positions``: one id list per input position instead (a patched SGLang's
    ``token_ids_logprob_positions``, Miles's ``--opd-topk-per-position``, refused here)."""
    payload: dict[str, Any] = {"input_ids": list(input_ids), "return_logprob": True, "logprob_start_len": 0,
                               "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False}}
    if top_k > 0:
        payload["top_logprobs_num"] = top_k
    if token_ids_positions is not None:
        payload["token_ids_logprob_positions"] = token_ids_positions
    elif token_ids:
        payload["token_ids_logprob"] = list(token_ids)
    return payload


async def post_json(url: str, payload: dict[str, Any], timeout: float, max_retries: int) -> dict[str, Any]:
    """POST with a total ``timeout`` per try; retried on connection errors, timeouts, 429 and 5xx."""
    import aiohttp

    from miles.utils.http_utils import post_json_retrying

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        return await post_json_retrying(session, url, payload, timeout=timeout, max_retries=max_retries,
                                        name=f"teacher {url}", error=TeacherError)


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> dict[str, Any]:
    """The teacher's prefill answer for ``sample`` (``--custom-rm-path``); ``post_process_rewards`` reads it."""
    url = teacher_url(args, sample)
    payload = score_payload(sample.tokens)
    k = opd_topk.top_k(args)
    if k > 0:
        payload.update(opd_topk.teacher_request(args, sample))
    out = await post_json(url, payload, float(getattr(args, "rm_timeout", 60.0)), int(getattr(args, "rm_max_retries", 3)))
    if not isinstance(out, dict):
        raise TeacherError(f"teacher {url} answered {type(out).__name__}, expected SGLang's /generate JSON object")
    out.setdefault("miles", {})["url"] = url
    if k <= 0:
        return out
    answer: dict[str, Any] = {"teacher": out}
    if args.opd_top_k_strategy in opd_topk.STUDENT_SCORES_TEACHER:  # the student's engines score the teacher's ids
        ids = opd_topk.union_ids(opd_topk.response_rows(out, "input_top_logprobs", sample.response_length,
                                                         f"teacher {url}"))
        params = dict(score_payload([])["sampling_params"])
        answer["student_on_teacher"] = await args.client.generate(
            list(sample.tokens), params, return_logprob=True, extra={"logprob_start_len": 0, "token_ids_logprob": ids})
    return answer


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """Teacher log-probs from each sample's teacher answer into ``metadata["teacher_log_probs"]`` (top-k OPD: the
    per-token top-k reverse KL into ``metadata["opd_reverse_kl"]``); rewards 0.0.

    Returns ``(raw_rewards, rewards)``, both all zeros (pure distillation: the OPD term is the signal).
    """
    topk = opd_topk.top_k(args) > 0
    for s in samples:
        answer = reward_value(s, args)
        if not isinstance(answer, dict):
            raise TeacherError(f"sample {s.index}: post_process_rewards expects the teacher's answer as the reward "
                               f"(--custom-rm-path miles.rollout.on_policy_distillation.reward_func), got "
                               f"{type(answer).__name__}")
        if topk:
            s.metadata[opd_topk.RKL_KEY] = opd_topk.reverse_kl(args, s, answer)
        else:
            s.metadata["teacher_log_probs"] = response_log_probs(answer, s)
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)


# Miles's private helper names (radixark/miles@v0.1.0:miles/rollout/on_policy_distillation.py), which Miles's own
# tests/fast/rollout/test_on_policy_distillation.py imports: thin names over the implementation above, so that test
# checks this module's routing, request bodies and top-k reverse KL against Miles's expectations.
_teacher_url_for_sample = teacher_url
_score_payload = score_payload


def _compute_topk_reverse_kl(args: Any, sample: Sample, reward_payload: dict[str, Any]) -> Any:
    """The per-response-token top-k reverse KL (``opd_topk.reverse_kl``) as a float32 tensor, as Miles returns it."""
    import torch

    return torch.tensor(opd_topk.reverse_kl(args, sample, reward_payload), dtype=torch.float32)


def _per_position_ids(top_logprobs: list[list[Any]], prompt_len: int) -> list[list[int]]:
    """One id list per scored input position for ``token_ids_logprob_positions``: ``prompt_len`` empty lists, then
    each response position's ids (``[logprob, id, ...]`` entries) in order."""
    return [[] for _ in range(prompt_len)] + [[int(e[1]) for e in row or [] if e is not None] for row in top_logprobs]
