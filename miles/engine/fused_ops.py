"""Fused small kernels for the decode step on CUDA (Triton): Qwen3's per-head q/k RMSNorm and rotary embedding.

``norm_rope(x, weight, eps, cos, sin, positions)``: x ``[N, heads, head_dim]`` (a view of the projection's
output), optionally RMS-normalised over ``head_dim`` with ``weight`` (HF's Qwen3 q_norm / k_norm), then
rotated by the rotary tables at each token's position (``x * cos + rotate_half(x) * sin``, HF's formula).
One kernel instead of the ~8 element-wise launches of the torch expression; statistics and the rotation in
fp32, one rounding to the activation dtype at the end. ``available(device)`` says whether it runs there.
"""

from __future__ import annotations

import torch

from miles.engine.paged_attention import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _norm_rope_kernel(X, W, COS, SIN, POS, OUT, eps, s_xn, s_xh, s_cos, s_on, s_oh, NH: tl.constexpr,
                          NHP: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        t = tl.program_id(0)
        h = tl.arange(0, NHP)
        d = tl.arange(0, HALF)
        hmask = (h < NH)[:, None]
        base = X + t.to(tl.int64) * s_xn + h[:, None] * s_xh + d[None, :]
        x1 = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=hmask, other=0.0).to(tl.float32)
        if NORM:
            ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
            r = 1.0 / tl.sqrt(ms + eps)
            x1 = x1 * r[:, None] * tl.load(W + d)[None, :].to(tl.float32)
            x2 = x2 * r[:, None] * tl.load(W + HALF + d)[None, :].to(tl.float32)
        p = tl.load(POS + t).to(tl.int64)
        c1 = tl.load(COS + p * s_cos + d)[None, :].to(tl.float32)
        c2 = tl.load(COS + p * s_cos + HALF + d)[None, :].to(tl.float32)
        s1 = tl.load(SIN + p * s_cos + d)[None, :].to(tl.float32)
        s2 = tl.load(SIN + p * s_cos + HALF + d)[None, :].to(tl.float32)
        out = OUT + t.to(tl.int64) * s_on + h[:, None] * s_oh + d[None, :]
        tl.store(out, (x1 * c1 - x2 * s1).to(OUT.dtype.element_ty), mask=hmask)
        tl.store(out + HALF, (x2 * c2 + x1 * s2).to(OUT.dtype.element_ty), mask=hmask)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """See the module docstring; ``cos``/``sin`` are ``[context, head_dim]`` tables, contiguous."""
    N, NH, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(N, NH, D, dtype=x.dtype, device=x.device)
    w = weight if weight is not None else cos  # unused when NORM is off
    _norm_rope_kernel[(N,)](x, w, cos, sin, positions, out, float(eps), x.stride(0), x.stride(1), cos.stride(0),
                            out.stride(0), out.stride(1), NH=NH, NHP=triton.next_power_of_2(NH), HALF=D // 2,
                            NORM=weight is not None, num_warps=4)
    return out


def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """The same maths in torch (fp32, one rounding at the end), for tests."""
    xf = x.float()
    if weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * c + rot * s).to(x.dtype)


__all__ = ["available", "norm_rope", "reference"]
