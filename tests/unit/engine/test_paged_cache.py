"""The paged KV cache (``--kv-cache paged``) against the slot cache, on the tiny model, on CPU.

In-process engines (``Engine`` = ModelRunner + Scheduler, what the HTTP server drives) for the numerics and
the page accounting; a real server process for client disconnects, ``/abort_request`` and retracting pauses.
Small pages (4-8 tokens) so that every request crosses many page boundaries.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import requests

from miles.engine.engine import Engine, EngineArgs
from miles.engine.protocol import GenerateReqInput
from miles.engine.testing import EngineProc

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40 + i for i in range(17)], [60], [70, 71, 72, 73, 74],
           [20 + i for i in range(33)], [33] * 8, [80, 81, 82, 83, 84, 85]]


def _engine(model, **kw) -> Engine:
    args = dict(hf_checkpoint=str(model), max_context_len=128, max_running_requests=3, random_seed=0)
    eng = Engine(EngineArgs(**{**args, **kw}))
    eng.start()
    return eng


def _run(eng: Engine, bodies: list[dict], sequential: bool = False) -> list[dict]:
    """Submit every body at once (or one after another) and wait for all of them."""
    async def go():
        if sequential:
            out = []
            for b in bodies:
                out += await go_one(b)
            return out
        return [o for res in await asyncio.gather(*[go_one(b) for b in bodies]) for o in res]

    async def go_one(b):
        specs, _ = eng.prepare(GenerateReqInput(**b))
        return await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 120)
    return asyncio.run(go())


def _bodies() -> list[dict]:
    out = []
    for i, p in enumerate(PROMPTS):
        sp = {"max_new_tokens": 20 + 7 * i, "ignore_eos": i % 2 == 0}
        sp.update({"temperature": 0} if i % 3 else {"temperature": 1.0, "sampling_seed": 100 + i})
        out.append({"input_ids": p, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 0})
    return out


def _same(a: list[dict], b: list[dict], atol: float = 1e-5) -> None:
    """The same tokens, finish reasons and log-probs within ``atol``: on CPU (fp32) measured 4.8e-6 at most over this
    file's, test_overlap.py's and test_mixed_steps.py's comparisons (2026-12-07); test_gpu.py passes its own."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        assert x["meta_info"]["finish_reason"] == y["meta_info"]["finish_reason"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            lx, ly = x["meta_info"].get(key, []), y["meta_info"].get(key, [])
            assert [t[1] for t in lx] == [t[1] for t in ly]
            assert all((u[0] is None and v[0] is None) or abs(u[0] - v[0]) < atol for u, v in zip(lx, ly)), key


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def _stats(eng: Engine) -> dict:
    return eng.scheduler.call(eng.scheduler.load).result(30)


def _reference(engine_model) -> list[dict]:
    eng = _engine(engine_model, kv_cache="slots")
    try:
        return _run(eng, _bodies())
    finally:
        eng.stop()


def test_paged_and_slot_caches_give_identical_tokens_and_logprobs(engine_model):
    ref = _reference(engine_model)
    eng = _engine(engine_model, kv_cache="paged", page_size=4)
    try:
        assert eng.runner.kv is not None
        got = _run(eng, _bodies())
        stats = _stats(eng)
    finally:
        eng.stop()
    _same(got, ref)
    assert stats["kv_pages_in_use"] == 0 and stats["kv_pages_peak"] > 0, stats
    # the slot cache is still the CPU default
    eng = _engine(engine_model)
    try:
        assert eng.runner.kv is None and not eng.runner.paged
    finally:
        eng.stop()


def test_admission_under_a_full_cache_queues_retracts_and_completes_every_request(engine_model):
    """A pool of 128 tokens (32 pages) for 8 requests of up to 88 tokens each: requests queue for pages,
    running ones are retracted when the pool runs dry, and every output equals the unconstrained run."""
    ref = _reference(engine_model)
    eng = _engine(engine_model, kv_cache="paged", page_size=4, max_total_tokens=128, max_running_requests=8)
    try:
        assert eng.runner.kv.pool.num_pages - 1 == 32
        got = _run(eng, _bodies())
        stats = _stats(eng)
    finally:
        eng.stop()
    _same(got, ref)
    assert stats["retractions"] > 0, stats
    assert stats["kv_pages_in_use"] == 0 and stats["kv_pages_peak"] <= 32, stats


def test_n_samples_share_the_prompt_pages(engine_model):
    """4 samples of a 37-token prompt, 3 new tokens each, pages of 8: the prompt's 4 full pages are shared
    and each sample owns one copied partial page (8 pages, not 20); samples equal unshared requests."""
    prompt = [7 + (i * 5) % 90 for i in range(37)]
    sp = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    eng = _engine(engine_model, kv_cache="paged", page_size=8, max_running_requests=8)
    try:
        group = _run(eng, [{"input_ids": prompt, "sampling_params": {**sp, "n": 4, "sampling_seed": 11},
                            "return_logprob": True}])
        stats = _stats(eng)
        alone = _run(eng, [{"input_ids": prompt, "sampling_params": {**sp, "sampling_seed": 11 + j}, "return_logprob": True}
                           for j in range(4)], sequential=True)
        stats_alone = _stats(eng)
    finally:
        eng.stop()
    assert stats["kv_pages_peak"] == 4 + 4, stats
    assert stats["kv_pages_in_use"] == 0 and stats_alone["kv_pages_in_use"] == 0
    assert stats_alone["kv_pages_peak"] == 8  # one at a time: 5 pages each, the peak is the group's
    _same(group, alone)
    assert len({tuple(o["output_ids"]) for o in group}) > 1  # distinct samples, not one copied
    # the slot cache copies the prompt's KV for the group's samples: the same outputs
    eng = _engine(engine_model, kv_cache="slots", max_running_requests=8)
    try:
        _same(_run(eng, [{"input_ids": prompt, "sampling_params": {**sp, "n": 4, "sampling_seed": 11},
                          "return_logprob": True}]), alone)
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def paged_server(engine_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("paged_log") / "engine.log"
    e = EngineProc(engine_model, "--kv-cache", "paged", "--page-size", "4", "--max-running-requests", "4",
                   "--max-context-len", "512", log=log)
    yield e
    e.stop()


def _load(eng) -> dict:
    return eng.get("/get_load").json()[0]


def _wait(eng, pred, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = _load(eng)
        if pred(load) or time.monotonic() > deadline:
            return load
        time.sleep(0.005)


LONG = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}


def test_pages_are_returned_after_abort_retract_and_disconnect(paged_server):
    eng = paged_server
    info = eng.get("/get_server_info").json()
    assert info["internal_states"][0]["kv_page_size"] == 4 and info["max_total_num_tokens"] == 4 * 512
    # /abort_request of a rid with 2 samples, mid-generation
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=eng.generate({"input_ids": [5, 6, 7], "rid": "victim",
                                                                  "sampling_params": {**LONG, "n": 2}})))
    t.start()
    assert _wait(eng, lambda ld: ld["num_running_reqs"] == 2)["kv_pages_in_use"] > 0
    assert eng.post("/abort_request", {"rid": "victim"}).status_code == 200
    t.join(30)
    assert [o["meta_info"]["finish_reason"]["type"] for o in out["r"]] == ["abort", "abort"]
    assert _wait(eng, lambda ld: ld["kv_pages_in_use"] == 0)["kv_pages_in_use"] == 0
    # a retracting pause frees every page; continue recomputes them and the output is seamless
    ref = eng.generate({"input_ids": [9, 8, 7, 6], "sampling_params": LONG})["output_ids"]
    t = threading.Thread(target=lambda: out.update(r=eng.generate({"input_ids": [9, 8, 7, 6], "sampling_params": LONG})))
    t.start()
    _wait(eng, lambda ld: ld["num_running_reqs"] == 1 and ld["kv_pages_in_use"] > 2)
    assert eng.post("/pause_generation", {"mode": "retract"}).status_code == 200
    paused = _load(eng)
    assert paused["num_running_reqs"] == 0 and paused["num_waiting_reqs"] == 1 and paused["kv_pages_in_use"] == 0, paused
    assert eng.post("/continue_generation", {}).status_code == 200
    t.join(60)
    assert out["r"]["output_ids"] == ref
    assert _wait(eng, lambda ld: ld["kv_pages_in_use"] == 0)["kv_pages_in_use"] == 0
    # a streaming client that disconnects after its first chunks aborts its requests and frees their pages
    body = {"input_ids": [4, 5, 6, 7, 8], "sampling_params": {**LONG, "n": 3}, "stream": True}
    with requests.post(eng.url + "/generate", json=body, stream=True, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if line and i > 2:
                assert json.loads(line[6:])["output_ids"]
                break
    load = _wait(eng, lambda ld: ld["num_running_reqs"] == 0 and ld["kv_pages_in_use"] == 0)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 and load["kv_pages_in_use"] == 0, load
    assert eng.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})["output_ids"]


KERNEL_CHECK = r"""
import torch
import miles.engine.sampling as S
from miles.engine import fused_ops as fo, paged_attention as pa, sample_kernel
torch.manual_seed(0)
worst = 0.0
# paged attention: queries of arbitrary block-table rows, one split and several (the split-K merge)
for B, H, n_kv, D, ps, splits in [(3, 4, 2, 16, 4, None), (5, 16, 8, 32, 16, 3), (2, 8, 8, 16, 8, 1), (4, 4, 2, 16, 4, 5)]:
    kp, vp = torch.randn(40, ps, n_kv, D), torch.randn(40, ps, n_kv, D)
    bt = torch.randint(1, 40, (B + 2, 12))
    pos = torch.randint(0, 12 * ps, (B,))
    rows = torch.randint(0, B + 2, (B,))
    q = torch.randn(B, H, D)
    ref = pa.reference(q, kp, vp, bt, pos, 0.3, 12 * ps, rows=rows)
    worst = max(worst, (ref - pa.paged_decode(q, kp, vp, bt, pos, 0.3, rows=rows, splits=splits)).abs().max().item())
# q/k RMSNorm + RoPE on a strided view
for N, NH, D, norm in [(3, 4, 16, True), (5, 6, 32, False)]:
    x = torch.randn(N, NH * 3, D)[:, :NH]
    w = torch.randn(D) if norm else None
    cos, sin = torch.randn(40, D), torch.randn(40, D)
    p = torch.randint(0, 40, (N,))
    worst = max(worst, (fo.norm_rope(x, w, 1e-6, cos, sin, p) - fo.reference(x, w, 1e-6, cos, sin, p)).abs().max().item())
# the sampler over several vocabulary chunks: the torch path's tokens and log-probs
for B, V in [(5, 3000), (3, 20000)]:
    logits = torch.randn(B, V) * 3
    sb = S.SamplingBatch([S.RowParams(0.5 + (i % 4) * 0.3, 1.0, 1 if i % 3 == 0 else 1 << 30, 0.0, 1000 + i)
                          for i in range(B)], V, logits.device)
    steps = torch.arange(B) * 3
    tok, lp = sample_kernel.fused_sample(logits, sb.temperature, S.row_keys(sb.seeds, steps), sb.greedy)
    S.USE_FUSED_KERNEL = False
    ref = S.sample(logits, sb, steps, want_logprobs=True)
    assert tok.tolist() == ref.tokens.tolist(), (tok, ref.tokens)
    worst = max(worst, (lp - ref.logprobs).abs().max().item())
print(worst)
"""


def test_triton_kernels_equal_the_torch_reference_in_the_interpreter():
    """The GPU kernels, run by Triton's CPU interpreter (where Triton is installed; the GPU tests run them
    compiled): split-K paged attention (each query attends to its own row's live length through the block
    table, as the gather + SDPA path), the fused q/k-norm + RoPE, and the vocabulary-chunked sampler."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


def _staggered(eng: Engine, first: dict, later: list[dict], between=None) -> list[dict]:
    """Submit ``first``; once it is running (its prompt's KV held), optionally call ``between``, then submit
    ``later`` (a later admission batch); wait for all."""
    async def go():
        specs, _ = eng.prepare(GenerateReqInput(**first))
        head = eng.submit(specs, stream=False)
        deadline = time.monotonic() + 60
        while not any(r.state in ("running", "done") for r in head) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert head[0].state == "running", "the first request finished before the later ones were sent"
        if between is not None:
            eng.scheduler.call(between).result(30)
        tails = []
        for b in later:
            specs, _ = eng.prepare(GenerateReqInput(**b))
            tails.append(eng.submit(specs, stream=False))
        outs = [eng.wait_final(head)] + [eng.wait_final(t) for t in tails]
        return [o for res in await asyncio.wait_for(asyncio.gather(*outs), 120) for o in res]
    return asyncio.run(go())


@pytest.mark.parametrize("kv_cache", ["paged", "slots"])
def test_samples_of_a_prompt_share_its_kv_across_admission_batches(engine_model, kv_cache):
    """RL sends a group's samples as separate requests; those admitted after the first one is running reuse its
    prompt KV (no prefill: shared pages, or a slot copy) and its post-prompt logits, with the same tokens and
    log-probs as unshared requests; a weight update in between turns the sharing off (stale KV)."""
    prompt = [7 + (i * 5) % 90 for i in range(37)]
    sp = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    bodies = [{"input_ids": prompt, "sampling_params": {**sp, "sampling_seed": 11 + j}, "return_logprob": True}
              for j in range(4)]
    eng = _engine(engine_model, kv_cache=kv_cache, page_size=8, max_running_requests=8)
    try:
        alone = _run(eng, bodies, sequential=True)
        assert _stats(eng)["shared_prompts"] == 0
        head = {**bodies[0], "sampling_params": {**sp, "sampling_seed": 11, "max_new_tokens": 80}}
        got = _staggered(eng, head, bodies[1:])
        stats = _stats(eng)
        reload = lambda: eng.runner.load_tensors(eng.runner.snapshot())  # noqa: E731 - same values, new weights epoch
        _staggered(eng, head, bodies[1:2], between=reload)
        after_update = _stats(eng)
    finally:
        eng.stop()
    assert stats["shared_prompts"] == 3, stats
    _same(got[1:], alone[1:])
    assert got[0]["output_ids"][:12] == alone[0]["output_ids"]
    assert after_update["shared_prompts"] == 3, after_update  # not shared: the holder's KV predates the update
    if kv_cache == "paged":
        # 4 full prompt pages shared; each sample owns its copied partial page and the pages it generates into
        assert stats["kv_pages_in_use"] == 0 and stats["kv_pages_peak"] < 4 * 7, stats


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(engine_model):
    """Prompts longer than --max-prefill-tokens (8 here) are prefilled 8 tokens at a time into the paged cache's
    spare row, one chunk between two decode steps of the running requests (which keep generating meanwhile):
    the same tokens and (input and output) log-probs as the slot cache's one-shot prefill, also with a pool so
    small that chunked prompts and running requests are retracted; an abort mid-prompt frees its pages."""
    ref = _reference(engine_model)
    for kw in (dict(), dict(max_total_tokens=128, max_running_requests=8)):
        eng = _engine(engine_model, kv_cache="paged", page_size=4, max_prefill_tokens=8, **kw)
        sch = eng.scheduler
        progress: list[tuple[int, int]] = []  # (chunked prompt's computed tokens, tokens generated so far)
        orig = sch._prefill_chunk

        def spy(orig=orig, sch=sch, progress=progress):
            progress.append((sch.chunking.kv_len, sch.generated_tokens))
            orig()
        sch._prefill_chunk = spy
        try:
            got = _run(eng, _bodies())
            stats = _stats(eng)
        finally:
            eng.stop()
        _same(got, ref)
        assert stats["chunked_prefills"] >= 3 and stats["kv_pages_in_use"] == 0, stats
        if not kw:  # decode went on between the chunks of one prompt
            steps = [b - a for (k0, a), (k1, b) in zip(progress, progress[1:]) if k1 > k0 > 0]
            assert steps and all(d > 0 for d in steps), progress
        else:
            assert stats["retractions"] > 0, stats
    # top-k and token-id input log-probs gathered chunk by chunk equal the one-shot prefill's
    body = {"input_ids": PROMPTS[5], "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
            "token_ids_logprob": [4, 9], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    outs = []
    for mpt in (16384, 8):
        eng = _engine(engine_model, kv_cache="paged", page_size=4, max_prefill_tokens=mpt)
        try:
            outs.append(_run(eng, [body])[0]["meta_info"])
        finally:
            eng.stop()
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        a, b = _flat(outs[0][key]), _flat(outs[1][key])
        assert len(outs[0][key]) == len(PROMPTS[5]) - 2 and len(a) == len(b) > 0, key
        assert all(abs(u - v) < 8e-6 if isinstance(u, float) else u == v for u, v in zip(a, b)), key   # measured 3.8e-6
    # aborted while its prompt is half prefilled: the request ends as aborted, its pages come back
    eng = _engine(engine_model, kv_cache="paged", page_size=4, max_prefill_tokens=8)
    sch = eng.scheduler
    orig = sch._prefill_chunk

    def abort_at_second_chunk():
        if sch.chunking.kv_len > 0:
            sch.abort_reqs([sch.chunking], "test abort")
        else:
            orig()
    sch._prefill_chunk = abort_at_second_chunk
    try:
        out = _run(eng, [{"input_ids": PROMPTS[5], "sampling_params": {"max_new_tokens": 4}}])
        stats = _stats(eng)
        sch._prefill_chunk = orig
        again = _run(eng, [{"input_ids": PROMPTS[5], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}])
    finally:
        eng.stop()
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert stats["kv_pages_in_use"] == 0 and sch.chunking is None, stats
    assert len(again[0]["output_ids"]) == 4


def test_get_load_says_where_decode_steps_went(paged_server):
    """/get_load's decode timers grow with decode steps, and the phases and the device wait fit inside the step."""
    eng = paged_server
    before = _load(eng)
    eng.generate({"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}})
    after = _load(eng)
    assert after["steps"] - before["steps"] >= 39
    spent = after["decode_seconds"] - before["decode_seconds"]
    phases = ("grow", "inputs", "forward", "sample", "append", "remove")
    parts = [after[f"decode_{p}_seconds"] - before[f"decode_{p}_seconds"] for p in phases]
    wait = after["decode_wait_seconds"] - before["decode_wait_seconds"]
    assert spent > 0 and wait >= 0 and all(p >= 0 for p in parts), after
    assert parts[phases.index("forward")] > 0, after   # the CPU forward runs inside its phase
    assert sum(parts) + wait <= spent + 1e-3, (parts, wait, spent)
