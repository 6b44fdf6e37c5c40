"""On-policy distillation from teacher engines (``--use-opd --opd-type sglang --opd-teacher-urls``).

After the student's samples are generated, each sample's exact token ids (prompt + response) are sent
to a teacher engine as a prefill-only ``/generate`` (``max_new_tokens: 0``) with ``return_logprob`` and
``logprob_start_len`` = prompt length, so ``meta_info.input_token_logprobs`` holds the teacher's
log-prob of every response token (SGLang's protocol; the embedded engine speaks it too). They are
stored in ``sample.metadata["teacher_log_probs"]``, where the trainer's OPD term reads them. Token ids
are never re-tokenised, so student and teacher must share a tokenizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from miles.fleet.client import EngineClient
from miles.types import Sample, SampleStatus
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)


class TeacherError(MilesError):
    """A teacher engine's answer cannot give the response tokens' log-probs."""


def teacher_client(urls: Sequence[str], api_key: str | None, timeout: float, max_retries: int,
                   concurrency: int) -> EngineClient:
    """A client rotating among the teacher engines (``--opd-teacher-urls``)."""
    return EngineClient(list(urls), api_key=api_key, timeout=timeout, max_retries=max_retries,
                        concurrency=concurrency)


async def teacher_log_probs(client: EngineClient, sample: Sample, temperature: float = 1.0) -> list[float]:
    """The teacher's log-prob of each of ``sample``'s response tokens (length ``response_length``)."""
    start = sample.prompt_length
    if sample.response_length <= 0 or start <= 0:
        return []
    resp = await client.generate(sample.tokens, {"max_new_tokens": 0, "temperature": temperature},
                                 return_logprob=True, extra={"logprob_start_len": start})
    return response_log_probs(resp, sample)


def response_log_probs(resp: dict[str, Any], sample: Sample) -> list[float]:
    """The log-probs of ``sample``'s response tokens in a prefill answer's ``meta_info.input_token_logprobs``.

    The answer may cover the prompt too (``logprob_start_len`` 0: its first entry has no log-prob); the
    last ``response_length`` entries must be the response's token ids, else TeacherError.
    """
    url = (resp.get("miles") or {}).get("url") if isinstance(resp, dict) else None
    rows = ((resp.get("meta_info") or {}) if isinstance(resp, dict) else {}).get("input_token_logprobs")
    n = sample.response_length
    if not isinstance(rows, list) or len(rows) < n:
        got = f"{len(rows)} entries" if isinstance(rows, list) else "none"
        raise TeacherError(f"teacher at {url} returned {got} in meta_info.input_token_logprobs for a prefill of "
                           f"{len(sample.tokens)} tokens ({n} response tokens); it must support return_logprob "
                           "with logprob_start_len")
    rows = rows[len(rows) - n:] if n else []
    try:
        got_ids, lps = [int(r[1]) for r in rows], [float(r[0]) for r in rows]
    except (TypeError, ValueError, IndexError) as e:
        raise TeacherError(f"teacher at {url}: malformed input_token_logprobs entry ({e}): {str(rows[:3])[:200]}") from e
    want = list(sample.tokens[len(sample.tokens) - n:]) if n else []
    if got_ids != want:
        raise TeacherError(f"teacher log-probs are for tokens {got_ids[:8]}..., not the response {want[:8]}...: "
                           "student and teacher must share a tokenizer")
    return lps


async def fill_teacher_log_probs(client: EngineClient, samples: Sequence[Sample], temperature: float = 1.0) -> int:
    """Fill ``metadata["teacher_log_probs"]`` of every trainable sample; returns how many were filled."""
    todo = [s for s in samples if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
    results = await asyncio.gather(*(teacher_log_probs(client, s, temperature) for s in todo))
    for s, lps in zip(todo, results):
        s.metadata["teacher_log_probs"] = lps
    return len(todo)
