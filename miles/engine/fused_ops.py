"""Fused small kernels for the decode step on CUDA (Triton): Qwen3's per-head q/k RMSNorm and rotary embedding,
the residual add with the next RMSNorm, and SwiGLU's ``silu(gate) * up``.

``norm_rope(x, weight, eps, cos, sin, positions)``: x ``[N, heads, head_dim]`` (a view of the projection's
output), optionally RMS-normalised over ``head_dim`` with ``weight`` (HF's Qwen3 q_norm / k_norm), then
rotated by the rotary tables at each token's position (``x * cos + rotate_half(x) * sin``, HF's formula).
One kernel instead of the ~8 element-wise launches of the torch expression; statistics and the rotation in
fp32, one rounding to the activation dtype at the end. ``available(device)`` says whether it runs there.

``add_rms_norm(h, delta, weight, eps)``: ``h + delta`` rounded to the activation dtype (the residual stream, as
the torch expression keeps it), then its RMSNorm (``_norm``'s maths: fp32 statistics, the weight applied before
the one rounding); returns both. One kernel instead of the add and the norm.

``silu_mul(gate_up)``: ``[N, 2I]`` (the fused gate/up projection's output) -> ``silu(gate) * up`` ``[N, I]``, each
op rounded to the activation dtype as torch's two kernels round it.
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


    @triton.jit
    def _add_rms_norm_kernel(H, D, W, H_OUT, X_OUT, eps, s_h, s_d, s_ho, s_xo, N: tl.constexpr, NP: tl.constexpr):
        t = tl.program_id(0)
        c = tl.arange(0, NP)
        m = c < N
        h = tl.load(H + t.to(tl.int64) * s_h + c, mask=m, other=0.0)
        d = tl.load(D + t.to(tl.int64) * s_d + c, mask=m, other=0.0)
        s = (h.to(tl.float32) + d.to(tl.float32)).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + t.to(tl.int64) * s_ho + c, s, mask=m)
        x = s.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
        tl.store(X_OUT + t.to(tl.int64) * s_xo + c, (x * r * w).to(X_OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(X, OUT, s_x, s_o, inter, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        g = tl.load(X + t.to(tl.int64) * s_x + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(X + t.to(tl.int64) * s_x + inter + c, mask=m, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + t.to(tl.int64) * s_o + c, (a * u).to(OUT.dtype.element_ty), mask=m)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta) * weight)`` for ``[N, hidden]`` rows (see the module docstring)."""
    N, C = h.shape
    h_out = torch.empty_like(h)
    x_out = torch.empty_like(h)
    _add_rms_norm_kernel[(N,)](h, delta, weight, h_out, x_out, float(eps), h.stride(0), delta.stride(0), h_out.stride(0),
                               x_out.stride(0), N=C, NP=triton.next_power_of_2(C), num_warps=4 if C <= 4096 else 8)
    return h_out, x_out


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = h + delta
    return s, (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(h.dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[N, 2I]``."""
    N, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(N, inter, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(N, -(-inter // block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]


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


__all__ = ["add_rms_norm", "add_rms_norm_reference", "available", "norm_rope", "reference", "silu_mul",
           "silu_mul_reference"]
