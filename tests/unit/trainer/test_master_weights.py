"""``optim.MasterWeights``: bf16 compute on fp32 master parameters, fp32 gradient accumulation (the bf16 recipe
of the Megatron backend, the same as FSDP2's bf16 parameters with fp32 reduction)."""

from __future__ import annotations

import torch
from torch import nn

from miles.trainer.optim import MasterWeights


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.SiLU(), nn.Linear(5, 3))


def test_compute_runs_bf16_copies_and_accumulates_fp32_grads() -> None:
    model, ref = _model(), _model()
    masters = [p.data for p in model.parameters()]
    mw = MasterWeights([model, model])                           # a module listed twice: its parameters once
    assert len(mw.params) == 4
    xs = [torch.randn(4, 6) for _ in range(3)]
    with mw.compute():
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for x in xs:
            out = model(x.bfloat16())
            assert out.dtype == torch.bfloat16                   # activations in bf16 too, not only the matmuls
            out.float().square().sum().backward()
            assert all(p.grad is None for p in model.parameters())   # moved into the fp32 sums as they arrive
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == torch.float32 and p.data_ptr() == m.data_ptr() and p.grad.dtype == torch.float32
    # the same sum computed by hand: bf16 parameters (rounded masters), each backward's bf16 gradient in fp32
    bf = _model().bfloat16()
    expect = [torch.zeros_like(p, dtype=torch.float32) for p in bf.parameters()]
    for x in xs:
        grads = torch.autograd.grad(bf(x.bfloat16()).float().square().sum(), list(bf.parameters()))
        for e, g in zip(expect, grads):
            e.add_(g.float())
    for p, e in zip(model.parameters(), expect):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)                                 # the masters were not touched


def test_compute_sees_updated_masters_and_keeps_earlier_grads() -> None:
    model = _model()
    mw = MasterWeights([model])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(2, 6)
    with mw.compute():
        model(x.bfloat16()).float().sum().backward()
    opt.step()
    first = [p.grad.clone() for p in model.parameters()]
    with mw.compute():                                           # copies refreshed from the stepped masters
        for p, c in zip(model.parameters(), mw.copies):
            assert p.data_ptr() == c.data_ptr()
        assert all(torch.equal(c, p.detach().bfloat16()) for p, c in zip(model.parameters(), mw.copies))
        with mw.compute():                                       # nested: the same window
            model(x.bfloat16()).float().sum().backward()
    summed = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    with mw.compute():
        model(x.bfloat16()).float().sum().backward()
    for s, g, p in zip(summed, first, model.parameters()):      # grads present on entry are part of the sum
        torch.testing.assert_close(s, g + p.grad, rtol=0, atol=0)
    with torch.no_grad(), mw.compute():
        model(x.bfloat16())
    assert all(p.grad is not None for p in model.parameters())
