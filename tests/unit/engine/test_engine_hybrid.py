"""The embedded engine serves the hybrid linear-attention families (Qwen3.5-MoE, Qwen3-Next; tiny,
``miles.utils.tiny_qwen35``) on the generic transformers path: each request keeps its own cache (the gated DeltaNet's
conv and recurrent states with the attention layers' keys and values), so a batch of different-length requests
gives the same tokens as each request alone, and both equal transformers' own greedy decoding."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engine.engine import Engine, EngineArgs
from miles.engine.protocol import GenerateReqInput
from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

PROMPTS = [[5, 9, 13, 2, 7, 30, 44, 45, 46, 12, 11], [40, 41, 8], [11, 12, 13, 14, 15, 16, 17]]
NEW = [9, 14, 6]


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def hybrid_model(request, tmp_path_factory):
    return build_tiny_qwen35_model(tmp_path_factory.mktemp(request.param), kind=request.param)


def _run(model, bodies: list[dict], running: int) -> list[dict]:
    eng = Engine(EngineArgs(hf_checkpoint=str(model), max_context_len=96, max_running_requests=running,
                            random_seed=0))
    eng.start()

    async def one(b):
        specs, _ = eng.prepare(GenerateReqInput(**b))
        return await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 120)

    async def go():
        return [o for res in await asyncio.gather(*[one(b) for b in bodies]) for o in res]
    try:
        return asyncio.run(go())
    finally:
        eng.stop()


def _bodies() -> list[dict]:
    return [{"input_ids": p, "return_logprob": True,
             "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
            for p, n in zip(PROMPTS, NEW)]


def _hf_greedy(model_dir, prompt: list[int], new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def test_batched_requests_keep_their_own_recurrent_state(hybrid_model):
    batched = _run(hybrid_model, _bodies(), running=3)                 # 3 requests of 3 lengths at once
    alone = [_run(hybrid_model, [b], running=1)[0] for b in _bodies()]
    assert len(batched) == len(alone) == len(PROMPTS)                  # one answer per request: none left unchecked
    for i, (b, a) in enumerate(zip(batched, alone)):
        assert b["output_ids"] == a["output_ids"], i
        assert len(b["output_ids"]) == NEW[i]
        ref = _hf_greedy(hybrid_model, PROMPTS[i], NEW[i])
        assert b["output_ids"] == ref, (i, b["output_ids"], ref)
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        assert lp_b == lp_a, i                      # one request at a time on the generic path: the same forwards
