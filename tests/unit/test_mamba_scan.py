"""Mamba-2's chunked scan in torch (``families/mamba.ssd_scan``) against the recurrence token by token and against
transformers' torch fallback (``nemotron_h``'s ``mamba2_chunk_scan``); on a GPU against ``mamba_ssm``'s kernel.

Measured on the 2-core CPU box (fp32 inputs, max |difference| relative to max |reference|;
``pytest -s tests/unit/test_mamba_scan.py`` prints them): vs the fp64 recurrence, outputs and final states at most
1.02e-6 (64 tokens in one chunk; 1.6e-7 to 5.9e-7 otherwise), bound 2e-6; vs transformers 1.18e-7, bound 2.5e-7;
gradients of x, dt, A, B, C, D at most 2.14e-7, bound 4.5e-7.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from miles.trainer.megatron.families.mamba import ssd_reference, ssd_scan  # noqa: E402


def _inputs(b=2, length=37, h=4, p=3, g=2, n=5, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, h, p, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(b, length, h, generator=gen) - 1.0)
    A = -torch.rand(h, generator=gen) * 2 - 0.1
    B = torch.randn(b, length, g, n, generator=gen)
    C = torch.randn(b, length, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    return [t.to(device) for t in (x, dt, A, B, C, D)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("length,chunk", [(37, 8), (32, 8), (5, 16), (1, 4), (64, 64)])
def test_scan_matches_recurrence(length: int, chunk: int) -> None:
    x, dt, A, B, C, D = _inputs(length=length)
    init = torch.randn(2, 4, 3, 5)
    y, last = ssd_scan(x, dt, A, B, C, chunk_size=chunk, D=D, initial_state=init)
    ry, rlast = ssd_reference(x, dt, A, B, C, D=D, initial_state=init)
    print(f"length {length} chunk {chunk}: y {_rel(y, ry):.2e} state {_rel(last, rlast):.2e}")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert _rel(y, ry) < 2e-6 and _rel(last, rlast) < 2e-6
    # the chunk size is an implementation detail: chunk 1 (every token its own chunk) agrees too
    y1, _ = ssd_scan(x, dt, A, B, C, chunk_size=1, D=D, initial_state=init)
    print(f"  chunk 1: {_rel(y1, ry):.2e}")
    assert _rel(y1, ry) < 2e-6


def test_scan_matches_transformers_fallback() -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    x, dt_raw, A, B, C, D = _inputs(length=45)
    dt_bias = torch.randn(4) * 0.5
    ref = mamba2_chunk_scan(x, dt_raw, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True,
                            dt_limit=(0.001, float("inf")))
    dt = torch.nn.functional.softplus(dt_raw + dt_bias).clamp(0.001, float("inf"))
    y, _ = ssd_scan(x, dt, A, B, C, chunk_size=16, D=D)
    print(f"vs transformers: {_rel(y, ref):.2e}")
    assert _rel(y, ref) < 2.5e-7


def test_scan_gradients_match_recurrence() -> None:
    x, dt, A, B, C, D = _inputs(length=19)
    leaves = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, D)]
    y, _ = ssd_scan(*leaves[:5], chunk_size=8, D=leaves[5])
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    got = [t.grad.clone() for t in leaves]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, dt, A, B, C, D)]
    ry, _ = ssd_reference(*ref_leaves[:5], D=ref_leaves[5])
    (ry * torch.linspace(-1, 1, ry.numel(), dtype=torch.float64).view_as(ry)).sum().backward()
    for name, g, r in zip("x dt A B C D".split(), got, ref_leaves):
        assert torch.isfinite(g).all(), name
        print(name, f"{_rel(g, r.grad):.2e}")
        assert _rel(g, r.grad) < 4.5e-7, name


@pytest.mark.gpu
def test_scan_matches_mamba_ssm_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On a GPU: mamba_ssm's Triton scan (what ``TorchMambaMixer`` calls there) against ours and the fp64 recurrence,
    fp32. The kernel's fp32 dot products run in full fp32 (``TRITON_F32_DEFAULT=ieee``, set before it compiles, in
    a cache of its own); with Triton's default TF32 dots it was 1.7e-3 from ours (H200, 2026-12-07)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    kernel = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined",
                                 reason="mamba_ssm is not installed").mamba_chunk_scan_combined
    x, dt, A, B, C, D = _inputs(b=2, length=300, h=8, p=64, g=2, n=32, device="cuda")
    want = kernel(x, dt, A, B, C, 128, D=D)
    y, _ = ssd_scan(x, dt, A, B, C, chunk_size=128, D=D)
    ref, _ = ssd_reference(*(t.double() for t in (x, dt, A, B, C)), D=D.double())
    rel, k_ref, y_ref = _rel(y, want), _rel(want, ref), _rel(y, ref)
    print(f"ours vs mamba_ssm: {rel:.2e}; mamba_ssm vs fp64: {k_ref:.2e}; ours vs fp64: {y_ref:.2e}")
    # measured on an H100, 2026-12-07 (full fp32): 3.02e-6, 1.52e-6, 2.38e-6; bounds about twice those
    assert rel < 6e-6 and k_ref < 3e-6 and y_ref < 5e-6
