"""Miles's default generate call, ``miles.rollout.sglang_rollout.generate(args, sample, sampling_params)`` (and
``generate_hub.single_turn.generate``, which makes it), on a sample a plugin hands it again: as Miles's (radixark/
miles@v0.1.0:miles/rollout/sglang_rollout.py; its tests/fast/rollout/generate_hub/test_single_turn.py checks it), a
resumed (aborted) sample continues within what is left of ``max_new_tokens``, none left is TRUNCATED without a
request, and a finished sample is refused (an AssertionError, as Miles's ``assert``, in one line)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from miles.rollout import sglang_rollout
from miles.rollout.base_types import input_form
from miles.rollout.generate_hub import single_turn
from miles.types import Sample, SampleError, SampleStatus


class _Engine:
    """Answers /generate with the next of ``answers`` (token ids, finish reason), recording what it was asked."""

    def __init__(self, *answers: tuple[list[int], str]):
        self.answers, self.asked = list(answers), []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, extra=None, **kw):
        self.asked.append((list(input_ids), dict(sampling_params)))
        ids, finish = self.answers.pop(0)
        return {"text": "t" * len(ids), "meta_info": {"finish_reason": {"type": finish},
                                                      "output_token_logprobs": [[-0.5, i, None] for i in ids]}}


PATHS = {"sglang_rollout": sglang_rollout.generate, "single_turn": input_form(single_turn.generate)}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_an_aborted_sample_resumes_within_the_budget_left(path):
    engine = _Engine(([7, 8], "abort"), ([9, 10, 11], "stop"))
    args = SimpleNamespace(client=engine)
    s = asyncio.run(PATHS[path](args, Sample(tokens=[1, 2, 3]), {"max_new_tokens": 16, "temperature": 0.7}))
    assert s.status is SampleStatus.ABORTED and s.response_length == 2
    s = asyncio.run(PATHS[path](args, s, {"max_new_tokens": 16, "temperature": 0.7}))
    assert engine.asked == [([1, 2, 3], {"max_new_tokens": 16, "temperature": 0.7}),
                            ([1, 2, 3, 7, 8], {"max_new_tokens": 14, "temperature": 0.7})]
    assert (s.status, s.tokens, s.response_length, s.loss_mask) == (SampleStatus.COMPLETED, [1, 2, 3, 7, 8, 9, 10, 11],
                                                                    5, [1] * 5)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_no_budget_left_is_truncated_without_a_request(path):
    engine = _Engine()
    s = Sample(tokens=[1, 2, 3, 7, 8], response="tt", response_length=2, status=SampleStatus.ABORTED)
    s = asyncio.run(PATHS[path](SimpleNamespace(client=engine), s, {"max_new_tokens": 2}))
    assert engine.asked == [] and s.status is SampleStatus.TRUNCATED and s.tokens == [1, 2, 3, 7, 8]
    over = Sample(tokens=[1, 2, 3, 7, 8], response="tt", response_length=2, status=SampleStatus.ABORTED)
    with pytest.raises(SampleError, match=r"has 2 response tokens already, more than max_new_tokens 1") as e:
        asyncio.run(PATHS[path](SimpleNamespace(client=engine), over, {"max_new_tokens": 1}))
    assert isinstance(e.value, AssertionError) and "\n" not in str(e.value)


@pytest.mark.parametrize("status", [SampleStatus.COMPLETED, SampleStatus.TRUNCATED, "completed"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_finished_sample_is_refused(path, status):
    engine = _Engine()
    s = Sample(tokens=[1, 2, 3, 7], response="t", response_length=1, status=status)
    with pytest.raises(AssertionError, match=f"status {status}; only a pending or an aborted"):   # a str too
        asyncio.run(PATHS[path](SimpleNamespace(client=engine), s, {"max_new_tokens": 4}))
    assert engine.asked == []
