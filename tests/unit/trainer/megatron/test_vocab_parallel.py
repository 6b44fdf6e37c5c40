"""Vocabulary-parallel log-probs (``logprobs.VocabShard``) on a one-rank gloo group (``one_rank_group``, tests/conftest.py): padding columns are
excluded, values and gradients equal the unsharded path (the 2-rank split is covered by
tests/multiprocess/test_megatron.py's parity with the FSDP backend)."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.logprobs import VocabShard, logprobs_and_entropy


@pytest.mark.parametrize("chunk", [3, -1])
def test_sharded_logprobs_match_unsharded_and_ignore_padding(one_rank_group, chunk: int) -> None:
    torch.manual_seed(0)
    vocab, pad, hid, n = 11, 5, 8, 7
    w = torch.randn(vocab + pad, hid)
    w[vocab:] = 50.0                      # padding rows with huge logits: they must take no probability mass
    h1 = torch.randn(n, hid, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    w1 = w.clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    targets = torch.randint(0, vocab, (n,))
    lp1, ent1 = logprobs_and_entropy(h1, lambda x: x @ w1.t(), targets, temperature=0.7, chunk_size=chunk,
                                     with_entropy=True, entropy_grad=True,
                                     vocab_shard=VocabShard(one_rank_group, 0, vocab))
    lp2, ent2 = logprobs_and_entropy(h2, lambda x: x @ w2[:vocab].t(), targets, temperature=0.7, chunk_size=chunk,
                                     with_entropy=True, entropy_grad=True)
    torch.testing.assert_close(lp1, lp2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent1, ent2, rtol=1e-5, atol=1e-5)   # lse - sum p z cancels (logits ~20)
    (lp1.sum() + 0.3 * ent1.sum()).backward()
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad[:vocab], w2.grad[:vocab], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(w1.grad[vocab:]) == 0
