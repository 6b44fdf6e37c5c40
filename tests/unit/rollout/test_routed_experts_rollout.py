"""R3 on the rollout side: the request asks for routed experts, the answer's base64 lands in
``Sample.rollout_routed_experts`` (Miles's field) and travels to the trainer in the wire format unchanged."""

from __future__ import annotations

import asyncio

import numpy as np

from miles.engine.routed_experts import decode, encode
from miles.rollout import generate as gen
from miles.run.wire import decode_samples, encode_samples
from miles.types import Sample


class _Client:
    def __init__(self):
        self.bodies: list[dict] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, extra=None, **kw):
        self.bodies.append(dict(extra or {}))
        n = len(input_ids) + 2 - 1
        rows = np.arange(n * 3 * 2, dtype=np.int32).reshape(n, 3, 2) % 4
        return {"text": "ab", "output_ids": [5, 6], "meta_info": {
            "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
            "output_token_logprobs": [[-0.5, 5, None], [-0.7, 6, None]], "routed_experts": encode(rows)}}


def test_request_asks_and_sample_keeps_the_routed_experts():
    client = _Client()
    s = asyncio.run(gen.generate(client, Sample(tokens=[1, 2, 3]), {"max_new_tokens": 2}, routed_experts=True))
    assert client.bodies == [{"return_routed_experts": True}]
    got = decode(s.rollout_routed_experts, 3, 2)
    assert got.shape == (len(s.tokens) - 1, 3, 2)
    back = decode_samples(encode_samples([s]))[0]
    assert back.rollout_routed_experts == s.rollout_routed_experts
    plain = asyncio.run(gen.generate(client, Sample(tokens=[1, 2]), {"max_new_tokens": 2}))
    assert client.bodies[-1] == {} and plain.rollout_routed_experts is not None  # kept whenever an engine sends it


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "x" * len(ids)


def test_multi_turn_keeps_the_latest_answer_covering_the_whole_stream():
    client = _Client()
    turn = gen.MultiTurn(Sample(tokens=[1, 2, 3]), _Tok(), {"max_new_tokens": 8}, routed_experts=True)
    asyncio.run(turn.generate_turn(client))
    first = turn.sample.rollout_routed_experts
    turn.add_observation(ids=[7, 8])
    asyncio.run(turn.generate_turn(client))
    assert client.bodies == [{"return_routed_experts": True}] * 2
    got = decode(turn.sample.rollout_routed_experts, 3, 2)
    assert got.shape[0] == len(turn.sample.tokens) - 1 and turn.sample.rollout_routed_experts != first
    assert gen.request_extra(4, True) == {"top_logprobs_num": 4, "return_routed_experts": True}
    assert gen.request_extra() is None


def test_the_generate_hub_asks_what_the_default_asks():
    """Miles's ``generate_hub.single_turn.generate`` (GenerateFnInput form) is the default generate: under R3 it asks
    for and keeps the routed experts, under top-k OPD it asks for the student's top-k (radixark/miles@v0.1.0:
    tests/fast/rollout/generate_hub/test_single_turn.py, TestRoutedExperts, checks the former); so does
    ``benchmarkers.generate_with_random_osl``, which Miles builds on the default's call."""
    from types import SimpleNamespace

    from miles.rollout.base_types import input_form
    from miles.rollout.generate_hub import single_turn

    client = _Client()
    args = SimpleNamespace(client=client, use_rollout_routing_replay=True, use_opd=True, opd_log_prob_top_k=4,
                           opd_top_k_strategy="only-student")
    s = asyncio.run(input_form(single_turn.generate)(args, Sample(tokens=[1, 2, 3]), {"max_new_tokens": 2}))
    assert client.bodies == [{"return_routed_experts": True, "top_logprobs_num": 4}]
    assert decode(s.rollout_routed_experts, 3, 2).shape == (len(s.tokens) - 1, 3, 2)
    plain = SimpleNamespace(client=client)
    asyncio.run(input_form(single_turn.generate)(plain, Sample(tokens=[1, 2]), {"max_new_tokens": 2}))
    assert client.bodies[-1] == {}

    from miles.rollout.generate_hub.benchmarkers import generate_with_random_osl

    s = asyncio.run(generate_with_random_osl(args, Sample(tokens=[1, 2, 3]), {"max_new_tokens": 2}))
    assert client.bodies[-1] == {"return_routed_experts": True, "top_logprobs_num": 4}
    assert decode(s.rollout_routed_experts, 3, 2).shape == (len(s.tokens) - 1, 3, 2)     # kept, covering the stream
