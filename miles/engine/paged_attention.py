"""Decode attention over the paged KV cache: one query token per row, keys/values read through the block table.

``paged_decode(q, k_pages, v_pages, block_table, positions, scale)``:
q ``[B, heads, head_dim]``; pages ``[num_pages, page_size, kv_heads, head_dim]``; row b attends to its
positions ``0..positions[b]`` (its live context, not the batch's longest). Output ``[B, heads, head_dim]``.

On CUDA with Triton this is one kernel (a program per (row, kv head) that walks only that row's pages with
an online softmax, all heads of the GQA group at once), so a decode step reads each live KV token once and
its cost follows the live context lengths; the shapes are static, so it is captured in the decode step's
CUDA graph. Elsewhere (CPU, no Triton) ``reference`` gathers the pages into ``[B, kv_heads, L, head_dim]``
and calls SDPA with a length mask: the same maths.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(device: torch.device) -> bool:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (device.type == "cuda" or interpret)


def reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
              positions: torch.Tensor, scale: float, L: int) -> torch.Tensor:
    """Gather the first ``L`` positions (a multiple of the page size) of every row, then masked SDPA."""
    B, H, D = q.shape
    ps, n_kv = k_pages.shape[1], k_pages.shape[2]
    bt = block_table[:B, : L // ps].reshape(-1)
    k = k_pages.view(k_pages.shape[0], -1).index_select(0, bt).view(B, L, n_kv, D).transpose(1, 2)
    v = v_pages.view(v_pages.shape[0], -1).index_select(0, bt).view(B, L, n_kv, D).transpose(1, 2)
    valid = torch.arange(L, device=q.device)[None, :] <= positions[:, None]
    o = F.scaled_dot_product_attention(q.view(B, n_kv, H // n_kv, D), k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return o.reshape(B, H, D)


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(Q, K, V, BT, POS, OUT, scale,
                             s_qb, s_qh, s_kp, s_ks, s_kh, s_bt, s_ob, s_oh,
                             GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                             BLOCK_N: tl.constexpr, MAX_CTX: tl.constexpr, PREC: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_ctx = tl.load(POS + b) + 1
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < GROUP
        q = tl.load(Q + b * s_qb + (h * GROUP + g)[:, None] * s_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        # a loop to the cache's context with a branch, not to n_ctx: the trip count stays a plain int (the
        # interpreter needs one); iterations past the row's context only compare two scalars
        for start in range(0, MAX_CTX, BLOCK_N):
            if start < n_ctx:
                n = start + tl.arange(0, BLOCK_N)
                nmask = n < n_ctx
                page = tl.load(BT + b * s_bt + n // PS, mask=nmask, other=0)
                off = page.to(tl.int64) * s_kp + (n % PS) * s_ks + h * s_kh
                k = tl.load(K + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                s = tl.where(nmask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
        out = acc / l_i[:, None]
        tl.store(OUT + b * s_ob + (h * GROUP + g)[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty), mask=gmask[:, None])


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                 positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The Triton kernel (see the module docstring); ``available(q.device)`` must hold."""
    B, H, D = q.shape
    ps, n_kv = k_pages.shape[1], k_pages.shape[2]
    group = H // n_kv
    q = q.contiguous()
    out = torch.empty_like(q)
    gp = max(16, triton.next_power_of_2(group))
    block_n = max(64 if D <= 128 else 32, ps)
    _paged_decode_kernel[(B, n_kv)](q, k_pages, v_pages, block_table, positions, out, scale,
                                    q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
                                    block_table.stride(0), out.stride(0), out.stride(1),
                                    GROUP=group, GP=gp, D=D, PS=ps, BLOCK_N=block_n,
                                    MAX_CTX=block_table.shape[1] * ps,
                                    PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out
