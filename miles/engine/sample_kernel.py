"""Fused sampling for rows without top-k/top-p/min-p: temperature, Gumbel-max with the counter-based noise of
``sampling.hash_uniform``, and the chosen token's log-prob, in two Triton kernels (the log-sum-exp, then the
race), each a program per (row, vocabulary chunk) so that the work spreads over the GPU whatever the batch.
No full-vocabulary sort, no ``[B, vocab]`` temporaries.

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
    def _lse_kernel(X, TEMP, M_OUT, S_OUT, s_x, V: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    NC: tl.constexpr):
        """Pass 1, a program per (row, vocab chunk): the chunk's max and sum of exp of the scaled logits."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        inv_t = 1.0 / tl.load(TEMP + row)
        base = X + row.to(tl.int64) * s_x
        neg_inf = float("-inf")
        m = tl.full((), neg_inf, tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=neg_inf) * inv_t
            m_new = tl.maximum(m, tl.max(x, 0))
            alpha = tl.where(m == neg_inf, 0.0, tl.exp(m - m_new))
            p = tl.where(x == neg_inf, 0.0, tl.exp(x - m_new))
            s = s * alpha + tl.sum(p, 0)
            m = m_new
        tl.store(M_OUT + row * NC + c, m)
        tl.store(S_OUT + row * NC + c, s)

    @triton.jit
    def _row_key(SEEDS, STEPS, row):
        """``sampling.row_keys`` of one row, in int64 as there."""
        m32 = tl.full((), 0xFFFFFFFF, tl.int64)
        seed = tl.load(SEEDS + row)
        step = tl.load(STEPS + row).to(tl.int64)
        inner = _mix32((step & m32) ^ tl.full((), 0x5BD1E995, tl.int64))
        return _mix32((seed & m32) ^ _mix32(((seed >> 32) & m32) ^ inner))

    @triton.jit
    def _race_kernel(X, TEMP, SEEDS, STEPS, GREEDY, M_IN, S_IN, B_VAL, B_IDX, B_LP, s_x, V: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr):
        """Pass 2, a program per (row, vocab chunk): the row's log-sum-exp from pass 1's partials, then the
        Gumbel-max race over the chunk (noise off for greedy rows); the chunk's winner, its id and log-prob."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        neg_inf = float("-inf")
        j = tl.arange(0, NCP)
        pm = tl.load(M_IN + row * NC + j, mask=j < NC, other=neg_inf)
        ps = tl.load(S_IN + row * NC + j, mask=j < NC, other=0.0)
        m = tl.max(pm, 0)
        lse = m + tl.log(tl.sum(tl.where(pm == neg_inf, 0.0, ps * tl.exp(pm - m)), 0))
        inv_t = 1.0 / tl.load(TEMP + row)
        key = _row_key(SEEDS, STEPS, row)
        noise_on = tl.load(GREEDY + row) == 0
        base = X + row.to(tl.int64) * s_x
        best = tl.full((), neg_inf, tl.float32)
        best_i = tl.zeros((), tl.int64)
        best_lp = tl.full((), neg_inf, tl.float32)
        m32 = tl.full((), 0xFFFFFFFF, tl.int64)
        for start in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + start + tl.arange(0, BLOCK)
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
            best_i = tl.where(better, (c * CHUNK + start) + bidx.to(tl.int64), best_i)
            best_lp = tl.where(better, blp, best_lp)
            best = tl.where(better, bmax, best)
        tl.store(B_VAL + row * NC + c, best)
        tl.store(B_IDX + row * NC + c, best_i)
        tl.store(B_LP + row * NC + c, best_lp)


CHUNK = 8192  # vocabulary tokens per program: rows x chunks programs, so a small batch still fills the GPU


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] int64 and their log-probs [B] float32. Each row's noise key is ``sampling.row_keys(seeds,
    steps)``, computed inside the race kernel (the torch expression is ~30 small launches a step).

    Two passes, each a program per (row, vocabulary chunk): the log-sum-exp partials, then the race (each
    program merges the row's partials itself); the chunks' winners are merged by one argmax. The arithmetic
    is the torch path's (``x / T - lse + gumbel``), so ties aside the tokens are the same."""
    B, V = logits.shape
    logits = logits.float().contiguous()
    dev = logits.device
    nc = -(-V // CHUNK)
    chunk = -(-V // nc)
    chunk = -(-chunk // 1024) * 1024
    nc = -(-V // chunk)
    temperature = temperature.float().contiguous()
    pm = torch.empty(B, nc, dtype=torch.float32, device=dev)
    ps = torch.empty(B, nc, dtype=torch.float32, device=dev)
    _lse_kernel[(B, nc)](logits, temperature, pm, ps, logits.stride(0), V=V, CHUNK=chunk, BLOCK=1024, NC=nc, num_warps=4)
    bv = torch.empty(B, nc, dtype=torch.float32, device=dev)
    bi = torch.empty(B, nc, dtype=torch.int64, device=dev)
    bl = torch.empty(B, nc, dtype=torch.float32, device=dev)
    if greedy.dtype != torch.int32:
        greedy = greedy.to(torch.int32)
    _race_kernel[(B, nc)](logits, temperature, seeds.contiguous(), steps.contiguous(), greedy.contiguous(), pm, ps, bv, bi, bl,
                          logits.stride(0), V=V, CHUNK=chunk, BLOCK=1024, NC=nc, NCP=triton.next_power_of_2(nc),
                          num_warps=4)
    win = bv.argmax(dim=1, keepdim=True)
    return bi.gather(1, win).squeeze(1), bl.gather(1, win).squeeze(1)


__all__ = ["available", "fused_sample"]
