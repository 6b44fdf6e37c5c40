"""Fused sampling for rows without top-k/top-p/min-p: temperature, Gumbel-max with the counter-based noise of
``sampling.hash_uniform``, and the chosen token's log-prob, in one Triton kernel (two passes over each row's
logits: the log-sum-exp, then the race). No full-vocabulary sort, no ``[B, vocab]`` temporaries.

The noise is bit-identical to ``hash_uniform`` (the same 32-bit hash, computed in int64 as there), so a
seeded request draws the same tokens as on the torch path up to floating-point ties. Greedy rows (top_k 1)
take the argmax (noise off) and report its log-prob under their temperature, as ``sample`` does.
"""

from __future__ import annotations

import torch

from miles.engine.paged_attention import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _mix32(x):
        m32 = tl.full((), 0xFFFFFFFF, tl.int64)
        x = x ^ (x >> 16)
        x = (x * tl.full((), 0x7FEB352D, tl.int64)) & m32
        x = x ^ (x >> 15)
        x = (x * tl.full((), 0x846CA68B, tl.int64)) & m32
        return x ^ (x >> 16)

    @triton.jit
    def _sample_kernel(X, TEMP, KEY, GREEDY, TOK, LP, s_x, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        inv_t = 1.0 / tl.load(TEMP + row)
        key = tl.load(KEY + row)
        noise_on = tl.load(GREEDY + row) == 0
        base = X + row.to(tl.int64) * s_x
        neg_inf = float("-inf")
        m = tl.full((), neg_inf, tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=neg_inf) * inv_t
            m_new = tl.maximum(m, tl.max(x, 0))
            alpha = tl.where(m == neg_inf, 0.0, tl.exp(m - m_new))
            p = tl.where(x == neg_inf, 0.0, tl.exp(x - m_new))
            s = s * alpha + tl.sum(p, 0)
            m = m_new
        lse = m + tl.log(s)
        best = tl.full((), neg_inf, tl.float32)
        best_i = tl.zeros((), tl.int64)
        best_lp = tl.full((), neg_inf, tl.float32)
        m32 = tl.full((), 0xFFFFFFFF, tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            lp = tl.load(base + offs, mask=valid, other=neg_inf) * inv_t - lse
            ids = offs.to(tl.int64)
            bits = _mix32(key ^ ((ids * tl.full((), 0x9E3779B1, tl.int64)) & m32))
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            g = -tl.log(-tl.log(u))
            val = tl.where(valid, lp + tl.where(noise_on, g, 0.0), neg_inf)
            bmax = tl.max(val, 0)
            bidx = tl.argmax(val, 0)
            blp = tl.sum(tl.where(tl.arange(0, BLOCK) == bidx, lp, 0.0), 0)
            better = bmax > best
            best_i = tl.where(better, start + bidx.to(tl.int64), best_i)
            best_lp = tl.where(better, blp, best_lp)
            best = tl.where(better, bmax, best)
        tl.store(TOK + row, best_i)
        tl.store(LP + row, best_lp)


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] int64 and their log-probs [B] float32; ``keys`` from ``sampling.row_keys``."""
    B, V = logits.shape
    logits = logits.float().contiguous()
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_kernel[(B,)](logits, temperature.float().contiguous(), keys.contiguous(), greedy.to(torch.int32).contiguous(),
                         tok, lp, logits.stride(0), V=V, BLOCK=2048, num_warps=8)
    return tok, lp


__all__ = ["available", "fused_sample"]
