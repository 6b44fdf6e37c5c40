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

from miles.rollout.client import EngineClient
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
    rows = (resp.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(rows, list):
        raise TeacherError(f"teacher at {resp.get('miles', {}).get('url')} returned no meta_info.input_token_logprobs "
                           "for a prefill request; it must support return_logprob with logprob_start_len")
    rows = rows[-sample.response_length:]
    got = [int(r[1]) for r in rows]
    want = sample.tokens[start:]
    if got != want:
        raise TeacherError(f"teacher log-probs are for tokens {got[:8]}..., not the response {want[:8]}...: "
                           "student and teacher must share a tokenizer")
    return [float(r[0]) for r in rows]


async def fill_teacher_log_probs(client: EngineClient, samples: Sequence[Sample], temperature: float = 1.0) -> int:
    """Fill ``metadata["teacher_log_probs"]`` of every trainable sample; returns how many were filled."""
    todo = [s for s in samples if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
    results = await asyncio.gather(*(teacher_log_probs(client, s, temperature) for s in todo))
    for s, lps in zip(todo, results):
        s.metadata["teacher_log_probs"] = lps
    return len(todo)
