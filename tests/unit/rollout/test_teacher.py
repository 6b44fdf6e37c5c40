"""Teacher log-probs for on-policy distillation (--opd-type sglang), from a real embedded engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from embedded_engines import start_engine, wait_engines
from transformers import AutoModelForCausalLM

from miles.fleet.client import EngineClient
from miles.rollout.teacher import TeacherError, fill_teacher_log_probs, teacher_log_probs
from miles.types import Sample, SampleStatus

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory):
    sup, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("teacher") / "engine.log", None, name="teacher")
    try:
        asyncio.run(wait_engines([(url, sup)]))
        yield url
    finally:
        sup.stop()


def _sample(tokens: list[int], response_length: int) -> Sample:
    return Sample(tokens=tokens, response_length=response_length, status=SampleStatus.COMPLETED)


def test_teacher_log_probs_match_a_reference_forward(teacher, tiny_model_dir):
    tokens = [5, 6, 76, 7, 84, 9, 1]  # prompt "12+3=" + response "5<eos>"
    sample = _sample(tokens, response_length=2)

    async def go():
        async with EngineClient(teacher, timeout=60, max_retries=1, concurrency=4) as client:
            n = await fill_teacher_log_probs(client, [sample, _sample(tokens, 2)])
            return n, await teacher_log_probs(client, sample, temperature=1.0)

    n, lps = asyncio.run(go())
    assert n == 2 and sample.metadata["teacher_log_probs"] == pytest.approx(lps)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(4, 6), torch.tensor(tokens[5:])]
    assert lps == ref.tolist()                                   # measured: bit for bit (CPU, 2026-12-07)


def test_failed_samples_are_skipped_and_bad_answers_are_named(teacher):
    failed = Sample(tokens=[5, 6, 7], response_length=1, status=SampleStatus.FAILED)

    async def go():
        async with EngineClient(teacher, timeout=60, max_retries=0, concurrency=2) as client:
            assert await fill_teacher_log_probs(client, [failed]) == 0

            async def wrong(*a, **k):  # a teacher answering for other tokens (another tokenizer)
                return {"meta_info": {"input_token_logprobs": [[-1.0, 99, None]]}}

            client.generate = wrong
            with pytest.raises(TeacherError, match="share a tokenizer"):
                await teacher_log_probs(client, _sample([5, 6, 7], 1))

    asyncio.run(go())
    assert "teacher_log_probs" not in failed.metadata


def test_response_log_probs_reads_a_whole_prefill_answer():
    from miles.rollout.teacher import response_log_probs

    s = _sample([5, 6, 7, 8], response_length=2)
    full = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.1, 6, None], [-0.2, 7, None], [-0.3, 8, None]]}}
    assert response_log_probs(full, s) == [-0.2, -0.3]  # logprob_start_len 0: the first entry has no log-prob
    short = {"meta_info": {"input_token_logprobs": [[-0.3, 8, None]]}, "miles": {"url": "http://t"}}
    with pytest.raises(TeacherError, match=r"teacher at http://t returned 1 entries .* for a prefill of 4 tokens"):
        response_log_probs(short, s)
    with pytest.raises(TeacherError, match="malformed input_token_logprobs entry"):
        response_log_probs({"meta_info": {"input_token_logprobs": [[None, 7, None], ["x", 8, None]]}}, s)
