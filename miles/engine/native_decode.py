"""The native forward's one-token-per-row paths: the decode step (slot or paged cache, Triton paged attention on
CUDA), the mixed step that carries prompt chunks in a decode step's forward, and the CUDA graphs both replay
(capture per batch bucket, ``warm_up`` at start). A mixin of ``native_lm._NativeLM``, whose attributes (the KV
cache, the rotary tables, the graph buffers, the fused projections) these methods read."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engine import fused_ops, paged_attention
from miles.engine.native_layers import _norm, _rotate_half
from miles.engine.paged_cache import to_device
from miles.engine.runner_options import MIX_RIDERS
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.model_runner")


class _NativeDecode:
    """Decode and mixed steps of ``_NativeLM`` (see there), eager or replayed as CUDA graphs."""

    def _token_qkv(self, li: int, attn, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None,
                   sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row (decode rows, a mixed step's chunk tokens): q, k, v of ``x`` [N, H] with the q/k
        norm and RoPE at ``positions`` applied (fused kernel, or ``cos``/``sin`` gathered at ``positions``)."""
        n = x.shape[0]
        q, k, v = self._proj_qkv(li, attn, x)
        q = q.view(n, self.n_heads, self.head_dim)
        k = k.view(n, self.n_kv, self.head_dim)
        v = v.view(n, self.n_kv, self.head_dim)
        if self.fused_rope:
            qw, qe, kw, ke = ((attn.q_norm.weight, attn.q_norm.variance_epsilon, attn.k_norm.weight,
                               attn.k_norm.variance_epsilon) if self.qk_norm else (None, 0.0, None, 0.0))
            return (fused_ops.norm_rope(q, qw, qe, self.cos, self.sin, positions),
                    fused_ops.norm_rope(k, kw, ke, self.cos, self.sin, positions), v)
        if self.qk_norm:
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _decode_impl(self, tokens: torch.Tensor, positions: torch.Tensor, B: int, L: int) -> torch.Tensor:
        cos, sin = (None, None) if self.fused_rope else (self.cos[positions][:, None], self.sin[positions][:, None])
        ar = self.ar_slots[:B]
        if self.lora is not None:
            self.lora.tokens(ar)
        kv = self.kv
        if not self.kernel:
            kpos = self.ar_ctx[:L]
            valid = kpos[None, :] <= positions[:, None]
            mask = valid[:, None, None, :]
        if kv is not None:
            w_page = kv.block_table[ar, positions // kv.page_size]
            w_off = positions % kv.page_size

        def attend(li: int, attn, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._token_qkv(li, attn, x, positions, cos, sin)
            if kv is not None:
                kv.k[li][w_page, w_off] = k
                kv.v[li][w_page, w_off] = v
                if self.kernel:
                    o = paged_attention.paged_decode(q, kv.k[li], kv.v[li], kv.block_table, positions, self.scaling,
                                                     rows=ar)
                    return o.reshape(B, self.n_heads * self.head_dim)
                k_all, v_all = kv.gather(li, B, L)
            else:
                kc, vc = self.k_cache[li], self.v_cache[li]
                kc[ar, :, positions] = k
                vc[ar, :, positions] = v
                k_all, v_all = kc[:B, :, :L], vc[:B, :, :L]
            m = mask
            win = self.windows[li]
            if win is not None and win < L:
                m = (valid & (kpos[None, :] > positions[:, None] - win))[:, None, None, :]
            o = F.scaled_dot_product_attention(q.view(B, self.n_kv, self.group, self.head_dim), k_all, v_all,
                                               attn_mask=m, scale=self.scaling)
            return o.reshape(B, self.n_heads * self.head_dim)

        return self.lm_head(self._token_layers(self.embed(tokens), attend))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        """One token for rows ``0..n-1`` (slot i = row i). ``max_len``: the longest context after this step."""
        n = tokens.shape[0]
        # the paged kernel walks each row's own length: one graph per batch size is enough
        L = self.cache_ctx if self.kernel or self.deterministic else next(c for c in self.ctx_buckets if c >= max_len)
        bs = next((b for b in self.batch_buckets if b >= n), None) if self.use_graphs else None
        if bs is None and self.deterministic and n < self.max_slots:  # eager, padded to the one shape
            pad = self.max_slots - n
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_full((pad,), self.pad_pos)])
            return self._decode_impl(tokens, positions, self.max_slots, L)[:n].float()
        if bs is None:  # no graphs, or larger than every captured batch size
            return self._decode_impl(tokens, positions, n, L).float()
        entry = self.graphs.get((bs, L))
        if entry is None:
            entry = self._capture(bs, L)
        self.g_tokens[:n].copy_(tokens)
        self.g_pos[:n].copy_(positions)
        if bs > n:
            self.g_pos[n:bs].fill_(self.pad_pos)
        entry[0].replay()
        return entry[1][:n].float()

    def _mixed_impl(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out_idx: torch.Tensor,
                    L: int) -> torch.Tensor:
        """Paged cache: one query token per entry of ``tokens``, token ``i`` at position ``positions[i]`` of block-table
        row ``rows[i]``; every token's K/V is written before attention, and each attends to its row's positions up to
        its own (decode rows: their context; a prompt chunk's tokens: causal over the pages it just wrote). Returns
        the logits of the tokens ``out_idx``. Decode is the case ``rows = 0..n-1``, one token each."""
        kv = self.kv
        T = tokens.shape[0]
        if self.lora is not None:
            self.lora.tokens(rows)
        cos, sin = (None, None) if self.fused_rope else (self.cos[positions][:, None], self.sin[positions][:, None])
        w_page = kv.block_table[rows, positions // kv.page_size]
        w_off = positions % kv.page_size

        def attend(li: int, attn, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._token_qkv(li, attn, x, positions, cos, sin)
            kv.k[li][w_page, w_off] = k
            kv.v[li][w_page, w_off] = v
            if self.kernel:
                o = paged_attention.paged_decode(q, kv.k[li], kv.v[li], kv.block_table, positions, self.scaling, rows=rows)
            else:
                o = paged_attention.reference(q, kv.k[li], kv.v[li], kv.block_table, positions, self.scaling, L, rows=rows)
            return o.reshape(T, self.n_heads * self.head_dim)

        return self.lm_head(self._token_layers(self.embed(tokens), attend)[out_idx])

    @property
    def mix_step_tokens(self) -> int:
        """Prompt tokens one mixed step carries at most: ``MIX_STEP_TOKENS`` (``RunnerOptions.mix_step_tokens``) with
        CUDA graphs (graph replay up to ``mix_tokens``, eager beyond; never fewer than ``mix_tokens``), else
        ``mix_tokens``."""
        if not self.mix_tokens:
            return 0
        return max(self.mix_tokens, self.mix_step_max) if self.use_graphs and self.kernel else self.mix_tokens

    @torch.no_grad()
    def decode_mixed(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int, row: int, chunk: list[int],
                     start: int) -> torch.Tensor:
        """``decode_mixed_many`` with one prompt chunk: ``[n + 1, vocab]`` logits."""
        return self.decode_mixed_many(tokens, positions, max_len, [(row, chunk, start)])

    @torch.no_grad()
    def decode_mixed_many(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int,
                          chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """One decode token for rows ``0..n-1`` and, in the same forward, for each ``(row, chunk, start)`` of
        ``chunks`` positions ``start..start+len(chunk)-1`` of block-table row ``row`` (a prompt chunk whose first
        ``start`` positions are in its pages already; rows distinct and not below ``max_slots``). Returns
        ``[n + len(chunks), vocab]`` logits: the decode rows', then each chunk's last token's. Replayed as the
        CUDA graph of the decode bucket when the chunks hold at most ``mix_tokens`` tokens (at most ``MIX_RIDERS``
        chunks), else eager."""
        n, kv = tokens.shape[0], self.kv
        lens = [len(c) for _, c, _ in chunks]
        total = sum(lens)
        if not chunks or min(lens) < 1 or total > self.mix_step_tokens:
            raise ValueError(f"a mixed step carries 1..{self.mix_step_tokens} prompt tokens in chunks of at least "
                             f"one, got {lens}")
        for row, c, start in chunks:
            kv.grow(row, start + len(c))
        dev = self.device
        bs = None
        if total <= self.mix_tokens and len(chunks) <= MIX_RIDERS and self.use_graphs and self.kernel:
            bs = next((b for b in self.batch_buckets if b >= n), None)
        host = torch.empty(3, total, dtype=torch.long)
        at = 0
        for row, c, start in chunks:
            host[0, at:at + len(c)] = torch.tensor(c, dtype=torch.long)
            host[1, at:at + len(c)] = torch.arange(start, start + len(c))
            host[2, at:at + len(c)] = row
            at += len(c)
        ends = torch.tensor(lens).cumsum(0) - 1           # each chunk's last token among the chunk tokens
        if bs is None:  # eager: exactly the live tokens
            end = max(start + len(c) for _, c, start in chunks)
            L = self.cache_ctx if self.kernel else next(x for x in self.ctx_buckets if x >= max(max_len, end))
            host = to_device(torch.cat([host, (ends + n)[None].expand(3, -1)], 1), dev)
            toks = torch.cat([tokens, host[0, :total]])
            pos = torch.cat([positions, host[1, :total]])
            rows = torch.cat([self.ar_slots[:n], host[2, :total]])
            out = torch.cat([self.ar_slots[:n], host[0, total:]])
            return self._mixed_impl(toks, pos, rows, out, L).float()
        entry = self.mix_graphs.get(bs)
        if entry is None:
            entry = self._capture_mixed(bs)
        C = self.mix_tokens
        pad = torch.zeros(3, C - total, dtype=torch.long)
        pad[2] = kv.scratch_row
        outs = torch.zeros(1, MIX_RIDERS, dtype=torch.long)
        outs[0, :len(chunks)] = ends + bs
        host = to_device(torch.cat([torch.cat([host, pad], 1), outs.expand(3, -1)], 1), dev)
        self.m_tokens[:n].copy_(tokens)
        self.m_pos[:n].copy_(positions)
        if bs > n:
            self.m_pos[n:bs].fill_(self.pad_pos)
        self.m_rows[:bs].copy_(self.ar_slots[:bs])
        self.m_tokens[bs:bs + C].copy_(host[0, :C])
        self.m_pos[bs:bs + C].copy_(host[1, :C])
        self.m_rows[bs:bs + C].copy_(host[2, :C])
        self.m_out[:bs].copy_(self.ar_slots[:bs])
        self.m_out[bs:bs + MIX_RIDERS].copy_(host[0, C:])
        entry[0].replay()
        o = entry[1]
        return torch.cat([o[:n], o[bs:bs + len(chunks)]]).float()

    def _capture_mixed(self, bs: int):
        """The mixed step's graph for decode bucket ``bs`` plus ``mix_tokens`` prompt tokens (captured on scratch rows),
        whose logits are those of ``bs + MIX_RIDERS`` tokens (the decode rows', then up to MIX_RIDERS chunks' last)."""
        T = bs + self.mix_tokens
        self.m_pos[:T].fill_(0)
        self.m_rows[:T].fill_(self.kv.scratch_row)
        self.m_out[: bs + MIX_RIDERS].fill_(0)
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        args = (self.m_tokens[:T], self.m_pos[:T], self.m_rows[:T], self.m_out[: bs + MIX_RIDERS], self.cache_ctx)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._mixed_impl(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._mixed_impl(*args)
        self.mix_graphs[bs] = (graph, out)
        logger.debug("captured a CUDA graph for a mixed step: decode batch %d + %d prompt tokens", bs, self.mix_tokens)
        return graph, out

    @torch.no_grad()
    def warm_up(self) -> int:
        """Capture the decode graph of every batch bucket now (paged kernel path: one graph per bucket), as SGLang
        does at start, so that no request pays for a capture or a kernel compile. Returns how many were captured."""
        if not (self.use_graphs and self.kernel):
            return 0
        n = 0
        for bs in self.batch_buckets:
            if (bs, self.cache_ctx) not in self.graphs:
                self._capture(bs, self.cache_ctx)
                n += 1
            if self.mix_tokens and bs not in self.mix_graphs:
                self._capture_mixed(bs)
                n += 1
        return n

    def _capture(self, bs: int, L: int):
        # Rows beyond the running requests write their (garbage) K/V at position cache_ctx-1 of free slots,
        # and every position is written by its request before it is read, so capture never corrupts state.
        self.g_pos[:bs].fill_(self.cache_ctx - 1)
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_impl(self.g_tokens[:bs], self.g_pos[:bs], bs, L)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._decode_impl(self.g_tokens[:bs], self.g_pos[:bs], bs, L)
        self.graphs[(bs, L)] = (graph, out)
        logger.debug("captured a CUDA graph for decode batch %d, context %d", bs, L)
        return graph, out
