"""Attention of single query tokens over the paged KV cache, keys/values read through the block table.

``paged_decode(q, k_pages, v_pages, block_table, positions, scale, rows=None)``:
q ``[N, heads, head_dim]``; pages ``[num_pages, page_size, kv_heads, head_dim]``; query ``i`` belongs to
block-table row ``rows[i]`` (default ``i``) and attends to that row's positions ``0..positions[i]`` (its
live context, not the batch's longest). Output ``[N, heads, head_dim]``. Decode passes one query per
running row; a mixed step also passes prompt-chunk tokens (several queries of one row, each attending up
to its own position: causal attention over the pages the chunk has just written).

On CUDA with Triton this is split-K ("flash decoding"): a program per (query, kv head, context split)
walks only its split of that row's live pages with an online softmax (all heads of the GQA group at once),
then a second kernel merges the splits' partial results by their log-sum-exp. The split count grows as
the batch shrinks, so a few long rows still spread over the whole GPU; a step reads each live KV token
once and its cost follows the live context lengths. Shapes are static, so it is captured in the decode
step's CUDA graph. Elsewhere (CPU, no Triton) ``reference`` gathers the pages into
``[N, kv_heads, L, head_dim]`` and calls SDPA with a length mask: the same maths.
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
              positions: torch.Tensor, scale: float, L: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Gather the first ``L`` positions (a multiple of the page size) of every query's row, then masked SDPA."""
    B, H, D = q.shape
    ps, n_kv = k_pages.shape[1], k_pages.shape[2]
    table = block_table[:B] if rows is None else block_table[rows]
    bt = table[:, : L // ps].reshape(-1)
    k = k_pages.view(k_pages.shape[0], -1).index_select(0, bt).view(B, L, n_kv, D).transpose(1, 2)
    v = v_pages.view(v_pages.shape[0], -1).index_select(0, bt).view(B, L, n_kv, D).transpose(1, 2)
    valid = torch.arange(L, device=q.device)[None, :] <= positions[:, None]
    o = F.scaled_dot_product_attention(q.view(B, n_kv, H // n_kv, D), k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return o.reshape(B, H, D)


if triton is not None:
    @triton.jit
    def _block(q, m_i, l_i, acc, start, n_ctx, row_bt, K, V, s_kp, s_ks, h_off, d, scale,
               PS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < n_ctx
        page = tl.load(row_bt + n // PS, mask=nmask, other=0)
        off = page.to(tl.int64) * s_kp + (n % PS) * s_ks + h_off
        k = tl.load(K + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(V + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(Q, K, V, BT, ROWS, POS, MID_O, MID_L, OUT, scale,
                      s_qb, s_qh, s_kp, s_ks, s_kh, s_bt, s_mb, s_mh, s_ob, s_oh,
                      GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                      BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
                      INTERPRET: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sid = tl.program_id(2)
        row = tl.load(ROWS + b)
        n_ctx = tl.load(POS + b) + 1
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < GROUP
        q = tl.load(Q + b * s_qb + (h * GROUP + g)[:, None] * s_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        lo = sid * CHUNK
        hi = tl.minimum(lo + CHUNK, n_ctx)
        row_bt = BT + row.to(tl.int64) * s_bt
        if INTERPRET:  # the interpreter needs a plain-int trip count: walk the whole split, skip past the context
            for start in range(0, CHUNK, BLOCK_N):
                if lo + start < hi:
                    m_i, l_i, acc = _block(q, m_i, l_i, acc, lo + start, hi, row_bt, K, V, s_kp, s_ks, h * s_kh, d,
                                           scale, PS, BLOCK_N, PREC)
        else:  # compiled: the loop runs over the live part of the split only (and is software-pipelined)
            for start in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _block(q, m_i, l_i, acc, start, hi, row_bt, K, V, s_kp, s_ks, h * s_kh, d,
                                       scale, PS, BLOCK_N, PREC)
        live = l_i > 0.0
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        if SPLITS == 1:
            tl.store(OUT + b * s_ob + (h * GROUP + g)[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("-inf"))
            hg = h * GROUP + g
            tl.store(MID_O + b * s_mb + hg[:, None] * s_mh + sid * D + d[None, :], out, mask=gmask[:, None])
            tl.store(MID_L + (b * s_mb + hg * s_mh) // D + sid, lse, mask=gmask)

    @triton.jit
    def _merge_kernel(MID_O, MID_L, OUT, s_mb, s_mh, s_ob, s_oh,
                      D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SP)
        d = tl.arange(0, D)
        smask = s < SPLITS
        lse = tl.load(MID_L + (b * s_mb + h * s_mh) // D + s, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.where(smask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
        o = tl.load(MID_O + b * s_mb + h * s_mh + s[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(OUT + b * s_ob + h * s_oh + d, out.to(OUT.dtype.element_ty))


TARGET_PROGRAMS = 4096  # split the context until (queries x kv heads x splits) reaches about this many programs
MAX_SPLITS = 32


def num_splits(n_queries: int, n_kv: int, max_ctx: int, block_n: int) -> int:
    """Context splits per (query, kv head): enough programs to fill the GPU, each split at least 2 blocks long."""
    want = min(max(1, TARGET_PROGRAMS // max(1, n_queries * n_kv)), max(1, -(-max_ctx // (2 * block_n))), MAX_SPLITS)
    return 1 << (int(want).bit_length() - 1)  # a power of two: few kernel variants to compile across batch sizes


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                 positions: torch.Tensor, scale: float, rows: torch.Tensor | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """The Triton kernels (see the module docstring); ``available(q.device)`` must hold."""
    B, H, D = q.shape
    ps, n_kv = k_pages.shape[1], k_pages.shape[2]
    group = H // n_kv
    q = q.contiguous()
    out = torch.empty_like(q)
    if rows is None:
        rows = torch.arange(B, device=q.device)
    gp = max(16, triton.next_power_of_2(group))
    block_n = max(32 if D <= 128 else 16, ps)
    max_ctx = block_table.shape[1] * ps
    S = splits or num_splits(B, n_kv, max_ctx, block_n)
    per_split = -(-max_ctx // S)
    chunk = -(-per_split // block_n) * block_n
    S = -(-max_ctx // chunk)
    if S > 1:
        mid_o = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
        mid_l = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_l = out
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    _split_kernel[(B, n_kv, S)](q, k_pages, v_pages, block_table, rows, positions, mid_o, mid_l, out, scale,
                                q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
                                block_table.stride(0), H * S * D, S * D, out.stride(0), out.stride(1),
                                GROUP=group, GP=gp, D=D, PS=ps, BLOCK_N=block_n, CHUNK=chunk, SPLITS=S,
                                PREC="ieee" if q.dtype == torch.float32 else "tf32", INTERPRET=interpret,
                                num_warps=4, num_stages=2)
    if S > 1:
        _merge_kernel[(B, H)](mid_o, mid_l, out, H * S * D, S * D, out.stride(0), out.stride(1),
                              D=D, SPLITS=S, SP=triton.next_power_of_2(S), num_warps=4)
    return out
