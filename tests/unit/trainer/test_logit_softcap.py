"""Final logit softcapping (Gemma 4's ``final_logit_softcapping``) in the shared log-prob head, and the FSDP policy
model's log-probs of the tiny Gemma 4 against transformers' own capped logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.trainer import modeling
from miles.trainer.logprobs import logprobs_and_entropy, reference_logprobs


@pytest.mark.parametrize("chunk", [2, -1])
def test_softcap_caps_logits_before_the_temperature(chunk):
    torch.manual_seed(0)
    head = nn.Linear(8, 30, bias=False)
    h = torch.randn(5, 8) * 4
    t = torch.randint(0, 30, (5,))
    lp, ent = logprobs_and_entropy(h, head, t, temperature=0.7, chunk_size=chunk, with_entropy=True, softcap=1.5)
    capped = 1.5 * torch.tanh(head(h) / 1.5)
    # fp32 in another order: measured 4.8e-7 / 2.4e-7 (CPU, 2026-12-07)
    torch.testing.assert_close(lp, reference_logprobs(capped, t, 0.7), rtol=0, atol=1e-6)
    p = torch.softmax(capped / 0.7, -1)
    torch.testing.assert_close(ent, -(p * torch.log_softmax(capped / 0.7, -1)).sum(-1), rtol=0, atol=5e-7)
    uncapped, _ = logprobs_and_entropy(h, head, t, temperature=0.7, chunk_size=chunk)
    assert (uncapped - lp).abs().max() > 1e-2                  # the cap bends these logits (|z| up to ~10)


def test_fsdp_policy_model_matches_gemma4_logits(tmp_path):
    from transformers import AutoModelForImageTextToText

    from miles.utils.tiny_gemma4 import build_tiny_gemma4

    path = build_tiny_gemma4(tmp_path / "g4")
    hf = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    assert modeling.final_logit_softcapping(hf.config) == 1.0
    torch.manual_seed(0)
    ids = torch.randint(4, hf.config.text_config.vocab_size - 4, (1, 16))
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        pos = torch.arange(16)[None]
        lp, _ = modeling.PolicyModel(hf)(ids, pos, torch.arange(15), ids[0, 1:], torch.tensor([0, 16]), 16)
        hf.config.text_config.final_logit_softcapping = None          # the head without the cap: visibly off
        uncapped, _ = modeling.PolicyModel(hf)(ids, pos, torch.arange(15), ids[0, 1:], torch.tensor([0, 16]), 16)
    # measured 9.5e-7 (fp32, CPU): pytest tests/unit/trainer/test_logit_softcap.py -k fsdp
    assert (lp - ref).abs().max() < 2e-6
    assert (uncapped - ref).abs().max() > 1e-3
