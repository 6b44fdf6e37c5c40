"""``--enable-deterministic-inference`` (SGLang's batch-invariant mode): a request's tokens and log-probs (its output
log-probs, its prompt's input log-probs, its top log-probs) are bitwise the same whether it runs alone or among
varied other requests that arrive before and after it, so that the batches it decodes in change under it (others
finish, queued ones join), on both KV caches, with and without the overlap scheduler. The same workload without the
flag gives other bits (on CPU a [1, h] matmul rounds differently from a [B, h] one), so the comparison can fail.

On CPU here; the GPU twin (bf16, CUDA graphs, the paged Triton kernel, the fused sampler) is marked ``gpu``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engine.engine import Engine, EngineArgs
from miles.engine.protocol import GenerateReqInput
from miles.engine.testing import build_engine_model

PROMPT = [7, 8, 9, 10, 11]
LONG_PROMPT = [30 + (5 * j) % 61 for j in range(40)]   # longer than MAX_PREFILL: prefilled in chunks (paged cache)
MAX_PREFILL = 32

TARGETS = [
    # greedy, with the prompt's input log-probs and the top-3 log-probs of every output token
    {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3},
    # seeded sampling with top-p (reproducible only with a sampling_seed, as in SGLang)
    {"input_ids": [50, 51, 52], "sampling_params": {"max_new_tokens": 30, "temperature": 0.9, "top_p": 0.9,
                                                    "sampling_seed": 5, "ignore_eos": True}, "return_logprob": True},
    # a long prompt: chunked prefill on the paged cache
    {"input_ids": LONG_PROMPT, "sampling_params": {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 9,
                                                   "ignore_eos": True}, "return_logprob": True},
]


def _others(i0: int) -> list[dict]:
    """Varied other requests: prompt lengths 2..42, 3..39 new tokens, greedy and seeded, one with n=2, one with the
    first target's prompt (the target may then take its first token and prompt KV from it, or it from the target)."""
    out = []
    for i in range(i0, i0 + 6):
        sp = {"max_new_tokens": 3 + (9 * i) % 37, "ignore_eos": True}
        sp.update({"temperature": 0} if i % 2 else {"temperature": 0.7, "sampling_seed": i})
        out.append({"input_ids": [3 + (i * 7 + j) % 90 for j in range(2 + (8 * i) % 41)], "sampling_params": sp,
                    "return_logprob": True})
    out[1]["sampling_params"]["n"] = 2
    out[2]["input_ids"] = PROMPT
    return out


def _engine(model, **kw) -> Engine:
    args = dict(hf_checkpoint=str(model), max_context_len=128, max_running_requests=4, random_seed=0,
                max_prefill_tokens=MAX_PREFILL)
    eng = Engine(EngineArgs(**{**args, **kw}))
    eng.start()
    return eng


def _generate(eng: Engine, body: dict, delay: float) -> asyncio.Future:
    async def go():
        await asyncio.sleep(delay)
        specs, _ = eng.prepare(GenerateReqInput(**body))
        return await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 120)
    return go()


def _alone(eng: Engine) -> list[dict]:
    async def go():
        return [(await _generate(eng, t, 0.0))[0] for t in TARGETS]
    return asyncio.run(go())


def _among_others(eng: Engine) -> list[dict]:
    """Six others at once, the targets one by one while those decode, six more in between: the batch changes
    around every target as others finish and queued ones (beyond the 4 running) join."""
    async def go():
        early, late = _others(0), _others(6)
        jobs = [_generate(eng, b, 0.0) for b in early]
        jobs += [_generate(eng, t, 0.015 * (k + 1)) for k, t in enumerate(TARGETS)]
        jobs += [_generate(eng, b, 0.01 * (k + 1)) for k, b in enumerate(late)]
        res = await asyncio.gather(*jobs)
        return [res[len(early) + k][0] for k in range(len(TARGETS))]
    return asyncio.run(go())


def _bits(o: dict) -> tuple:
    m = o["meta_info"]
    return (o["output_ids"], m["finish_reason"], m["output_token_logprobs"], m.get("input_token_logprobs"),
            m.get("output_top_logprobs"))


def _run(model, **kw) -> tuple[list[dict], list[dict], dict]:
    eng = _engine(model, **kw)
    try:
        alone = _alone(eng)
        mixed = _among_others(eng)
        return alone, mixed, eng.scheduler.call(eng.scheduler.load).result(30)
    finally:
        eng.stop()


CASES = {"slots": dict(kv_cache="slots"), "paged": dict(kv_cache="paged", page_size=4),
         # a pool of 40 pages for 4 running requests: without the flag decode runs short of pages and retracts
         "tight pool": dict(kv_cache="paged", page_size=4, max_total_tokens=160)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_engine_model(tmp_path_factory.mktemp("det_model"))


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_do_not_depend_on_the_batch(model, case, overlap):
    alone, mixed, load = _run(model, deterministic=True, overlap_schedule=overlap, **CASES[case])
    for a, b in zip(alone, mixed):
        assert _bits(a) == _bits(b)
    assert len(alone[0]["meta_info"]["input_token_logprobs"]) == len(PROMPT)
    assert load["retractions"] == 0   # a retracted request's KV would be recomputed by a prefill (other bits)
    if case != "slots":
        # the long prompt alone and in the batch, and the four others longer than MAX_PREFILL; no refill rode in a
        # decode step (that would change the step's shape)
        assert load["chunked_prefills"] == 6 and load["mixed_steps"] == 0
    if overlap:
        assert load["overlap_steps"] > 0


def test_without_the_flag_the_bits_differ(model):
    """What the flag is for (and what makes the test above able to fail): the same workload without it."""
    alone, mixed, _ = _run(model, kv_cache="slots", overlap_schedule=False)
    assert [_bits(a) for a in alone] != [_bits(b) for b in mixed]


def test_tight_pool_retracts_without_the_flag(model):
    """The tight-pool case does exercise retraction, which the flag's admission (every running request's final
    pages reserved) avoids."""
    *_, load = _run(model, overlap_schedule=False, **CASES["tight pool"])
    assert load["retractions"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_outputs_do_not_depend_on_the_batch_on_gpu(tmp_path_factory, overlap):
    """bf16, the paged cache with its Triton kernel, CUDA graphs (the one decode graph of all the slots), the fused
    sampler's batches: the same bitwise invariance; and without the flag the bits differ."""
    gpu_model = build_engine_model(tmp_path_factory.mktemp("det_gpu"), hidden_size=256, num_layers=4,
                                   num_heads=8, num_kv_heads=2)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache="paged", max_running_requests=8, overlap_schedule=overlap)
    alone, mixed, load = _run(gpu_model, deterministic=True, **kw)
    for a, b in zip(alone, mixed):
        assert _bits(a) == _bits(b)
    assert load["retractions"] == 0 and load["mixed_steps"] == 0
    eng = _engine(gpu_model, deterministic=True, **kw)
    try:
        info = eng.server_info()
        assert info["cuda_graph"] and info["cuda_graph_bs"] == [8] and info["enable_deterministic_inference"]
    finally:
        eng.stop()
    alone, mixed, _ = _run(gpu_model, **kw)
    assert [_bits(a) for a in alone] != [_bits(b) for b in mixed]
