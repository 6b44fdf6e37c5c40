"""Immediate refill and mixed prefill + decode steps (paged cache), on the tiny model, on CPU.

A freed slot is refilled at the next step; when few requests wait, the head of the queue is prefilled inside
the decode steps' forward (its prompt tokens are extra query rows of the chunk row) instead of a separate
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
    # (engine options, prompt tokens a mixed step carries): 8 makes the 10- and 17-token prompts ride in 2-3 steps
    cases = {"one chunk": (dict(), None), "chunks of 8 over several steps": (dict(), 8),
             "tight pool (retractions)": (dict(max_total_tokens=128, max_running_requests=8), 8)}
    for name, (kw, mix) in cases.items():
        eng = _engine(engine_model, kv_cache="paged", page_size=4, **kw)
        try:
            assert eng.runner.mix_tokens > 0
            if mix is not None:
                eng.runner.impl.mix_tokens = mix
            got = _run(eng, _bodies())
            stats = _stats(eng)
        finally:
            eng.stop()
        _same(got, ref)
        assert stats["mixed_prefills"] > 0 and stats["mixed_steps"] >= stats["mixed_prefills"], (name, stats)
        if mix is not None:  # some prompt took more than one mixed step
            assert stats["mixed_steps"] > stats["mixed_prefills"], (name, stats)
        assert stats["kv_pages_in_use"] == 0, (name, stats)
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
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-4, rtol=0)
