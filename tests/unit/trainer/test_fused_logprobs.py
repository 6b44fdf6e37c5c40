"""``fused_logprobs`` (the GPU path of ``logprobs_and_entropy``) gives the checkpointed path's values and
gradients: with and without chunking, temperature, entropy with and without its gradient."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.fused_logprobs import head_logprobs_and_entropy
from miles.trainer.logprobs import logprobs_and_entropy


@pytest.mark.parametrize("chunk,entropy_grad", [(-1, False), (-1, True), (3, True), (4, False)])
def test_fused_matches_checkpointed_path(chunk: int, entropy_grad: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    g_lp, g_ent = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    out = {}
    for name, fn in (("fused", head_logprobs_and_entropy), ("ref", logprobs_and_entropy)):
        lp, ent = fn(hidden, weight, targets, temperature=0.7, chunk_size=chunk, with_entropy=True,
                     entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        out[name] = (lp.detach(), ent.detach(), gh, gw)
    for a, b in zip(out["fused"], out["ref"]):
        # both in fp32, another op order: measured at most 6.8e-6 (the weight gradient, entries up to 13; CPU)
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1.4e-5)


def test_fused_without_entropy_and_bf16() -> None:
    torch.manual_seed(1)
    weight = torch.randn(40, 16).bfloat16().requires_grad_()
    hidden = torch.randn(5, 16).bfloat16().requires_grad_()
    targets = torch.randint(0, 40, (5,))
    lp, ent = head_logprobs_and_entropy(hidden, weight, targets)
    assert ent is None and lp.dtype == torch.float32
    ref = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=0, atol=5e-7)     # fp32 in another order: measured 2.4e-7 (CPU, 2026-12-08)
    lp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    empty, none = head_logprobs_and_entropy(hidden[:0], weight, targets[:0])
    assert empty.shape == (0,) and none is None


@pytest.mark.gpu
def test_fused_compiled_on_gpu_matches_checkpointed_path() -> None:
    """On CUDA the row functions are compiled (torch.compile, dynamic shapes: two chunk sizes here)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.utils.checkpoint import checkpoint

    from miles.trainer.logprobs import _chunk_logprobs

    torch.manual_seed(0)
    dev = torch.device("cuda")
    weight = torch.randn(1000, 64, device=dev, requires_grad=True)
    hidden = torch.randn(37, 64, device=dev, requires_grad=True)
    targets = torch.randint(0, 1000, (37,), device=dev)
    g_lp, g_ent = torch.randn(37, device=dev), torch.randn(37, device=dev)
    out = []
    for fused in (True, False):
        if fused:
            lp, ent = logprobs_and_entropy(hidden, weight, targets, temperature=0.8, chunk_size=16, with_entropy=True,
                                           entropy_grad=True)
        else:
            lp, ent = checkpoint(_chunk_logprobs, lambda x: x @ weight.t(), 0.8, True, True, hidden, targets, None,
                                 use_reentrant=False)
        gh, gw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
        out.append((lp.detach(), ent.detach(), gh, gw))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
