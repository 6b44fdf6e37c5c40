"""Immediate refill and mixed prefill + decode steps (paged cache), on the tiny model, on CPU.

A freed slot is refilled at the next step; when few requests wait, the head of the queue is prefilled inside
the decode steps' forward (its prompt tokens are extra query rows of its own ride row) instead of a separate
prefill. Greedy and seeded outputs (tokens and log-probs) must equal the slot cache's separate prefills.
"""

from __future__ import annotations

import torch
from test_paged_cache import PROMPTS, _engine, _run, _same, _stats

from miles.engine.model_runner import ModelRunner, RunnerOptions


def _bodies() -> list[dict]:
    """As test_paged_cache's, but without input log-probs (those take the separate prefill)."""
    out = []
    for i, p in enumerate(PROMPTS * 2):
        sp = {"max_new_tokens": 5 + (11 * i) % 37, "ignore_eos": i % 2 == 0}
        sp.update({"temperature": 0} if i % 3 else {"temperature": 1.0, "sampling_seed": 100 + i})
        out.append({"input_ids": p, "sampling_params": sp, "return_logprob": True})
    return out


def test_refills_ride_in_the_decode_step_and_match_separate_prefills(engine_model):
    ref_eng = _engine(engine_model, kv_cache="slots")
    try:
        ref = _run(ref_eng, _bodies())
    finally:
        ref_eng.stop()
    # (engine options, prompt tokens a mixed step carries, mix_below): 8 makes the 10- and 17-token prompts ride in
    # 2-3 steps; a mix_below of 6 makes every refill ride, several at once
    cases = {"one chunk": (dict(), None, None), "chunks of 8 over several steps": (dict(), 8, None),
             "tight pool (retractions)": (dict(max_total_tokens=128, max_running_requests=8), 8, None),
             "several prompts a step": (dict(max_running_requests=6), None, 6),
             "several prompts a step, chunks of 12": (dict(max_running_requests=6), 12, 6)}
    for name, (kw, mix, below) in cases.items():
        eng = _engine(engine_model, kv_cache="paged", page_size=4, **kw)
        try:
            assert eng.runner.mix_tokens > 0
            if mix is not None:
                eng.runner.impl.mix_tokens = mix
            if below is not None:
                eng.scheduler.mix_below = below
            got = _run(eng, _bodies())
            stats = _stats(eng)
        finally:
            eng.stop()
        _same(got, ref)
        assert stats["mixed_prefills"] > 0, (name, stats)
        if below is None:  # riders one at a time: every prompt takes at least one step of its own
            assert stats["mixed_steps"] >= stats["mixed_prefills"], (name, stats)
        # (whether several riders share a step here depends on when the requests reach the scheduler thread:
        # test_several_refills_ride_in_one_step makes it happen)
        if mix is not None and below is None:  # some prompt took more than one mixed step
            assert stats["mixed_steps"] > stats["mixed_prefills"], (name, stats)
        assert stats["kv_pages_in_use"] == 0 and stats["num_prefilling_reqs"] == 0, (name, stats)
        if "tight" in name:
            assert stats["retractions"] > 0, stats


def test_a_mixed_forward_equals_a_chunk_prefill_then_a_decode_step(engine_model):
    """Runner level: decode_mixed's decode rows and chunk logits equal decode + prefill_chunk run separately."""
    opts = RunnerOptions(max_running_requests=4, max_context_len=96, kv_cache="paged", page_size=4)
    seqs = [[5 + i for i in range(13)], [7, 8, 9], [11] * 6]
    chunk = [20 + i for i in range(10)]
    out = []
    for mixed in (False, True):
        rn = ModelRunner(engine_model, opts)
        rn.prefill(0, seqs, [False] * 3)
        rn.grow_pages([i for i, s in enumerate(seqs) if len(s) % 4 == 0])
        toks, pos = torch.tensor([3, 4, 5]), torch.tensor([len(s) for s in seqs])
        row = rn.chunk_row
        first, _ = rn.prefill_chunk(row, chunk[:4], 0, False)  # an earlier chunk already in the pages
        if mixed:
            logits = rn.decode_mixed(toks, pos, int(pos.max()) + 1, row, chunk[4:], 4)
            dec, last = logits[:3], logits[3]
        else:
            dec = rn.decode(toks, pos, int(pos.max()) + 1)
            last, _ = rn.prefill_chunk(row, chunk[4:], 4, False)
        out.append((dec, last))
        assert rn.pages_held(row) == 3  # 10 prompt tokens in pages of 4
    # fp32 logits, one mixed step against two: measured 1.9e-6 / 2.9e-6 (CPU, 2026-12-07)
    torch.testing.assert_close(out[1][0], out[0][0], atol=4e-6, rtol=0)
    torch.testing.assert_close(out[1][1], out[0][1], atol=6e-6, rtol=0)


def test_a_mixed_forward_with_several_prompt_chunks(engine_model):
    """Runner level: decode_mixed_many with a continued chunk and a whole prompt, each in its own ride row, equals
    the decode step and the two prefills run separately; the rows keep exactly their pages."""
    opts = RunnerOptions(max_running_requests=4, max_context_len=96, kv_cache="paged", page_size=4)
    seqs = [[5 + i for i in range(13)], [7, 8, 9]]
    long, short = [20 + i for i in range(10)], [50 + i for i in range(7)]
    out = []
    for mixed in (False, True):
        rn = ModelRunner(engine_model, opts)
        ra, rb = rn.ride_rows[:2]
        assert min(ra, rb) > rn.chunk_row and rn.mix_step_tokens >= len(long) + len(short)
        rn.prefill(0, seqs, [False] * 2)
        rn.grow_pages([i for i, s in enumerate(seqs) if len(s) % 4 == 0])
        toks, pos = torch.tensor([3, 4]), torch.tensor([len(s) for s in seqs])
        rn.prefill_chunk(ra, long[:4], 0, False)  # an earlier chunk of the first prompt already in the pages
        if mixed:
            logits = rn.decode_mixed_many(toks, pos, int(pos.max()) + 1, [(ra, long[4:], 4), (rb, short, 0)])
            assert logits.shape[0] == 4
            dec, last_a, last_b = logits[:2], logits[2], logits[3]
        else:
            dec = rn.decode(toks, pos, int(pos.max()) + 1)
            last_a, _ = rn.prefill_chunk(ra, long[4:], 4, False)
            last_b, _ = rn.prefill_chunk(rb, short, 0, False)
        out.append((dec, last_a, last_b))
        assert rn.pages_held(ra) == 3 and rn.pages_held(rb) == 2
    for got, want in zip(out[1], out[0]):
        torch.testing.assert_close(got, want, atol=7e-6, rtol=0)       # measured 3.3e-6 (CPU, 2026-12-07)


def test_several_refills_ride_in_one_step(engine_model):
    """Three requests of a full batch finish at the same step and three queued ones take their slots as riders: one
    decode step's forward carries all three prompts (each in its own ride row), and every output equals the slot
    cache's separate prefills."""
    first = {"input_ids": [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[2]],
             "sampling_params": [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in (6, 6, 6, 30)],
             "return_logprob": True}
    queued = {"input_ids": [PROMPTS[5], PROMPTS[6], PROMPTS[7], PROMPTS[3]],
              "sampling_params": [{"max_new_tokens": 9, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 7 + i}
                                  for i in range(4)], "return_logprob": True}
    ref_eng = _engine(engine_model, kv_cache="slots", max_running_requests=4)
    try:
        ref = _run(ref_eng, [first, queued], sequential=False)
    finally:
        ref_eng.stop()
    eng = _engine(engine_model, kv_cache="paged", page_size=4, max_running_requests=4)
    carried: list[int] = []
    inner = eng.runner.decode_mixed_many

    def spy(tokens, positions, max_len, chunks):
        carried.append(len(chunks))
        return inner(tokens, positions, max_len, chunks)
    eng.runner.decode_mixed_many = spy
    try:
        eng.scheduler.mix_below = 4     # refills of up to three requests ride (the default for 4 slots: 2)
        got = _run(eng, [first, queued])
        stats = _stats(eng)
    finally:
        eng.stop()
    _same(got, ref)
    assert max(carried) == 3 and stats["mixed_prefills"] >= 3, (carried, stats)
    assert stats["kv_pages_in_use"] == 0 and stats["num_prefilling_reqs"] == 0, stats
