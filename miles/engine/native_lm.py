"""``_NativeLM``: the engine's own forward for the Llama / Qwen2 / Qwen3 / Mistral family (see ``model_runner``):
construction (rotary tables, batch / context buckets, the paged pool or the slot cache), the fused q/k/v and
gate/up projections, KV-cache plumbing (allocate, free, move, share prefixes) and the prefill paths (a padded
batch, a paged prompt chunk). The decode and mixed steps and their CUDA graphs are ``native_decode``'s."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engine import fused_ops, paged_attention
from miles.engine.native_decode import _NativeDecode
from miles.engine.native_layers import _PLAIN_RMSNORMS, _SILU, _fuse_linears, _norm, _rotate_half
from miles.engine.paged_cache import PagedKV
from miles.engine.runner_options import MIX_RIDERS, MIX_STEP_TOKENS, MIX_TOKENS, graph_batch_sizes


class _NativeLM(_NativeDecode):
    """Own attention + static slot KV cache for decoder-only Llama-family models."""

    def __init__(self, model, max_slots: int, max_ctx: int, device: torch.device, dtype: torch.dtype, cuda_graph: bool,
                 graph_bs: list[int] | None = None, num_pages: int | None = None, page_size: int = 16,
                 deterministic: bool = False, mix_step_tokens: int | None = None):
        inner = model.model
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        a0 = self.layers[0].self_attn
        self.head_dim = int(a0.head_dim)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.group = self.n_heads // self.n_kv
        self.qk_norm = hasattr(a0, "q_norm") and hasattr(a0, "k_norm")
        # Qwen2/Qwen3 set a per-layer ``sliding_window`` on the attention module; Mistral reads the config's
        self.windows = [layer.self_attn.sliding_window if hasattr(layer.self_attn, "sliding_window")
                        else getattr(cfg, "sliding_window", None) for layer in self.layers]
        self.scaling = float(a0.scaling)
        self.max_slots, self.max_ctx, self.device, self.dtype = max_slots, max_ctx, device, dtype
        # the cache's context is padded to a multiple of 64 so attention kernels see aligned lengths
        self.cache_ctx = cache_ctx = -(-max_ctx // 64) * 64
        pos = torch.arange(cache_ctx, device=device)[None]
        probe = torch.zeros(1, 1, self.head_dim, dtype=dtype, device=device)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(probe, pos)
        if cos.shape[-1] != self.head_dim:
            raise NotImplementedError(f"partial rotary embeddings ({cos.shape[-1]} of {self.head_dim} dims)")
        self.cos, self.sin = cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()
        self.ar_slots = torch.arange(max_slots, device=device)
        self.ar_ctx = torch.arange(cache_ctx, device=device)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.use_graphs = cuda_graph and device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self.g_tokens = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.g_pos = torch.full((max_slots,), cache_ctx - 1, dtype=torch.long, device=device)
        self.batch_buckets = graph_bs if graph_bs is not None else graph_batch_sizes(max_slots)
        # batch-invariant mode: every decode step has one shape, all ``max_slots`` rows (the running ones first, the
        # rest padding) over the whole cache context, so a row's result cannot depend on how many others run (a
        # GEMM's kernel, its split of the reduction, the paged kernel's split count all follow the shape); one graph
        self.deterministic = deterministic
        if deterministic:
            self.batch_buckets = [b for b in self.batch_buckets if b == max_slots]
        # the context an eager decode step attends over: the live length rounded up to a power of two, from 16 (a whole
        # page of the paged cache at least; from 256 with CUDA graphs: one graph per bucket). Starting at 256 on CPU, a
        # quickstart rollout (contexts of ~6 tokens) spent a fifth of the scheduler's CPU on masked positions
        low = 256 if self.use_graphs else max(16, page_size if num_pages is not None else 1)
        self.ctx_buckets = sorted({min(cache_ctx, 1 << k) for k in range(low.bit_length() - 1, 24)} | {cache_ctx})
        # paged mode (num_pages given): a page pool + block tables instead of the slot cache
        self.kv: PagedKV | None = None
        if num_pages is not None:
            self.kv = PagedKV(len(self.layers), self.n_kv, self.head_dim, num_pages, page_size, max_slots, cache_ctx,
                              dtype, device, ride_rows=MIX_RIDERS)
        # the Triton paged-decode kernel (CUDA): attention reads only each row's live pages; no sliding windows
        # (its tl.arange over the head dimension needs a power of two: other models take the torch path)
        pow2_head = self.head_dim > 0 and self.head_dim & (self.head_dim - 1) == 0
        self.kernel = (self.kv is not None and paged_attention.available(device) and pow2_head
                       and all(w is None for w in self.windows))
        # graph rows beyond the running requests: the slot cache writes them at the last position of free slots;
        # paged, their block tables are all the scratch page, and position 0 keeps the kernel's walk to one token
        self.pad_pos = 0 if self.kv is not None else cache_ctx - 1
        # decode on CUDA: q/k norm + RoPE as one Triton kernel per tensor (plain RMSNorms only)
        cuda_kernels = fused_ops.available(device) and device.type == "cuda"
        self.fused_rope = cuda_kernels and pow2_head and (not self.qk_norm or all(
            type(m).__name__ in _PLAIN_RMSNORMS for layer in self.layers for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)))
        # one GEMM for q/k/v and one for gate/up per layer (their parameters become views of the fused buffers), and
        # on CUDA the residual add with the next RMSNorm and SwiGLU's silu * up as single kernels
        self.lora = None   # miles.engine.lora.LoraServing when adapters are served (then the linears stay unfused)
        self.fuse()
        self.fused_norms = (cuda_kernels and all(
            type(m).__name__ in _PLAIN_RMSNORMS and m.weight.dtype == dtype
            for layer in self.layers for m in (layer.input_layernorm, layer.post_attention_layernorm))
            and type(self.norm).__name__ in _PLAIN_RMSNORMS and self.norm.weight.dtype == dtype)
        self.fused_silu = cuda_kernels
        # mixed steps (paged cache, no sliding windows): a prompt chunk of up to mix_tokens tokens rides in the decode
        # step's forward (its tokens are extra query rows of the chunk row); graphs per batch bucket with the chunk
        # padded to mix_tokens (padding tokens on the scratch row)
        self.mix_tokens = min(MIX_TOKENS, cache_ctx) if self.kv is not None and all(w is None for w in self.windows) else 0
        if deterministic:  # a prompt chunk in a decode step's forward changes the step's shape: prefills run alone
            self.mix_tokens = 0
        self.mix_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mix_step_max = MIX_STEP_TOKENS if mix_step_tokens is None else mix_step_tokens
        if self.mix_tokens:
            T = max_slots + self.mix_tokens
            self.m_tokens = torch.zeros(T, dtype=torch.long, device=device)
            self.m_pos = torch.zeros(T, dtype=torch.long, device=device)
            self.m_rows = torch.full((T,), self.kv.scratch_row, dtype=torch.long, device=device)
            self.m_out = torch.zeros(max_slots + MIX_RIDERS, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ fused projections
    def fuse(self) -> None:
        """Per layer: the q/k/v projections as one weight (``self.qkv[li]``: (weight, bias) or None) and, for a SwiGLU
        MLP (SiLU, gate/up/down without bias), gate/up as one (``self.gate_up[li]`` or None)."""
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
        self.gate_up: list[torch.Tensor | None] = []
        if self.lora is not None:     # the adapters' hooks sit on the separate linears
            self.unfuse()
            return
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_fuse_linears([a.q_proj, a.k_proj, a.v_proj]))
            gu = None
            parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if (all(isinstance(m, torch.nn.Linear) and m.bias is None for m in parts)
                    and type(getattr(mlp, "act_fn", None)).__name__ in _SILU):
                fused = _fuse_linears(parts[:2])
                gu = fused[0] if fused is not None else None
            self.gate_up.append(gu)
        if self.device.type == "cuda":
            # the unfused weights' blocks go back to the device: the KV pool was sized from free memory before this
            torch.cuda.empty_cache()

    def unfuse(self) -> None:
        """Drop the references to the fused buffers (before the parameters' memory is released)."""
        self.qkv = [None] * len(self.layers)
        self.gate_up = [None] * len(self.layers)

    def _proj_qkv(self, li: int, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` [..., H] flat over heads (views of one GEMM's output when fused)."""
        fused = self.qkv[li]
        if fused is None:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        out = F.linear(x, fused[0], fused[1])
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        return out[..., :nq], out[..., nq:nq + nk], out[..., nq + nk:]

    def _mlp(self, li: int, layer, x: torch.Tensor) -> torch.Tensor:
        w = self.gate_up[li]
        if w is None:
            return layer.mlp(x)
        gu = F.linear(x, w)
        if self.fused_silu and gu.dim() == 2:
            act = fused_ops.silu_mul(gu)
        else:
            inter = w.shape[0] // 2
            act = F.silu(gu[..., :inter]) * gu[..., inter:]
        return layer.mlp.down_proj(act)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding ``delta``, and its RMSNorm by ``norm`` (one kernel on CUDA)."""
        if self.fused_norms and h.dim() == 2:
            return fused_ops.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        h = h + delta
        return h, _norm(norm, h)

    def _token_layers(self, h: torch.Tensor, attend) -> torch.Tensor:
        """Every decoder layer over one-token-per-row hidden states ``h`` [N, H]; ``attend(li, attn, x)`` returns
        the attention output [N, heads * head_dim]. Returns the final norm's output [N, H]."""
        x = _norm(self.layers[0].input_layernorm, h)
        last = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, x = self._add_norm(h, attn.o_proj(attend(li, attn, x)), layer.post_attention_layernorm)
            h, x = self._add_norm(h, self._mlp(li, layer, x),
                                  self.norm if li == last else self.layers[li + 1].input_layernorm)
        return x

    # ------------------------------------------------------------------ cache
    def cache_bytes(self) -> int:
        if self.kv is not None:
            return self.kv.bytes()
        el = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.max_slots * self.n_kv * self.cache_ctx * self.head_dim * el

    def allocate_cache(self) -> None:
        if self.kv is not None:
            self.kv.allocate()
            self.k_cache, self.v_cache = self.kv.k, self.kv.v
            return
        shape = (self.max_slots, self.n_kv, self.cache_ctx, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def reset_cache(self) -> None:
        """The allocated cache kept, every slot and page free (what :meth:`allocate_cache` leaves, without zeroing)."""
        if self.kv is not None:
            self.kv.reset()

    def free_cache(self) -> None:
        self.k_cache, self.v_cache = [], []
        if self.kv is not None:
            self.kv.free()
        self.drop_graphs()

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.mix_graphs.clear()
        self.graph_pool = None

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.kv is not None:
            return self.kv.move(src, dst)
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[dst, :, :length].copy_(kc[src, :, :length])
            vc[dst, :, :length].copy_(vc[src, :, :length])

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` starts with slot ``src``'s first ``length`` tokens of KV (the n samples of one prompt)."""
        if self.kv is not None:
            return self.kv.share(src, dst, length)
        self.move_slot(src, dst, length)  # the slot cache copies (a move leaves the source's KV in place)

    def share_prefix_many(self, src: int, dsts: list[int], length: int) -> None:
        """``share_prefix`` to every slot of ``dsts``: on the slot cache one copy per layer and K/V for all of them
        (a group of n samples was 2 x layers x (n - 1) small copies)."""
        if self.kv is not None or len(dsts) < 2:
            for dst in dsts:
                self.share_prefix(src, dst, length)
            return
        idx = torch.tensor(dsts, dtype=torch.long, device=self.device)
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[idx, :, :length] = kc[src, :, :length]
            vc[idx, :, :length] = vc[src, :, :length]

    def release_slot(self, slot: int) -> None:
        if self.kv is not None:
            self.kv.release(slot)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, slot_start: int, seqs: list[list[int]], full_for: list[bool]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        n = len(seqs)
        lens = [len(s) for s in seqs]
        T = max(lens)
        tok = torch.zeros(n, T, dtype=torch.long)
        for i, s in enumerate(seqs):
            tok[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        tok = tok.to(self.device, non_blocking=True)
        if self.lora is not None:
            self.lora.tokens(torch.arange(slot_start, slot_start + n, device=self.device).repeat_interleave(T))
        lens_t = torch.tensor(lens, device=self.device)
        uniform = all(x == T for x in lens)
        h = self.embed(tok)
        cos, sin = self.cos[:T][None, None], self.sin[:T][None, None]
        q_pos = self.ar_ctx[:T]
        base_mask = None
        kv = self.kv
        if kv is not None:
            for i, n_tok in enumerate(lens):
                kv.grow(slot_start + i, n_tok)
            p_row, p_tok, p_page, p_off = kv.prefill_index(slot_start, lens)
        if not uniform:
            base_mask = (q_pos[None, :] <= q_pos[:, None])[None, None] & (q_pos[None, None, None, :] < lens_t[:, None, None, None])
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _norm(layer.input_layernorm, h)
            q, k, v = self._proj_qkv(li, attn, x)
            q = q.reshape(n, T, self.n_heads, self.head_dim)
            k = k.reshape(n, T, self.n_kv, self.head_dim)
            v = v.reshape(n, T, self.n_kv, self.head_dim)
            if self.qk_norm:
                q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if kv is not None:
                kv.k[li][p_page, p_off] = k[p_row, :, p_tok]
                kv.v[li][p_page, p_off] = v[p_row, :, p_tok]
            else:
                self.k_cache[li][slot_start: slot_start + n, :, :T] = k
                self.v_cache[li][slot_start: slot_start + n, :, :T] = v
            win = self.windows[li]
            windowed = win is not None and win < T
            if base_mask is None and not windowed and self.device.type == "cuda":
                # causal rows of one length: flash attention reads the grouped K/V heads itself (no copies)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                                   enable_gqa=self.group > 1)
            else:
                if self.group > 1:
                    k = k.repeat_interleave(self.group, dim=1)
                    v = v.repeat_interleave(self.group, dim=1)
                if windowed:
                    causal = q_pos[None, :] <= q_pos[:, None]
                    wmask = (causal & (q_pos[None, :] > q_pos[:, None] - win))[None, None]
                    mask = wmask if base_mask is None else (base_mask & wmask)
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
                elif base_mask is None:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=base_mask, scale=self.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(n, T, self.n_heads * self.head_dim))
            h = h + self._mlp(li, layer, _norm(layer.post_attention_layernorm, h))
        h = _norm(self.norm, h)
        last = h[torch.arange(n, device=self.device), lens_t - 1]
        logits = self.lm_head(last).float()
        full = [self.lm_head(h[i, : lens[i]]).float() if want else None for i, want in enumerate(full_for)]
        return logits, full

    @torch.no_grad()
    def prefill_chunk(self, row: int, tokens: list[int], start: int, want_full: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Paged cache: positions ``start..start+len(tokens)-1`` of block-table row ``row``, whose first ``start``
        positions are already in its pages (earlier chunks). Returns the last position's logits and, with
        ``want_full``, every position's. The same maths as ``prefill`` (causal attention over the row's pages)."""
        kv = self.kv
        t, end = len(tokens), start + len(tokens)
        kv.grow(row, end)
        tok = torch.tensor([tokens], dtype=torch.long).to(self.device, non_blocking=True)
        if self.lora is not None:
            self.lora.tokens(torch.full((t,), row, dtype=torch.long, device=self.device))
        pos = self.ar_ctx[start:end]
        cos, sin = self.cos[start:end][None, None], self.sin[start:end][None, None]
        table = kv.block_table[row]
        w_page, w_off = table[pos // kv.page_size], pos % kv.page_size
        Lk = kv.pages_for(end) * kv.page_size
        kpos = self.ar_ctx[:Lk]
        causal = kpos[None, :] <= pos[:, None]
        h = self.embed(tok)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _norm(layer.input_layernorm, h)
            q, k, v = self._proj_qkv(li, attn, x)
            q = q.reshape(1, t, self.n_heads, self.head_dim)
            k = k.reshape(1, t, self.n_kv, self.head_dim)
            v = v.reshape(1, t, self.n_kv, self.head_dim)
            if self.qk_norm:
                q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv.k[li][w_page, w_off] = k[0].transpose(0, 1)
            kv.v[li][w_page, w_off] = v[0].transpose(0, 1)
            k_all, v_all = kv.gather_row(li, row, Lk)
            if self.group > 1:
                k_all = k_all.repeat_interleave(self.group, dim=1)
                v_all = v_all.repeat_interleave(self.group, dim=1)
            win = self.windows[li]
            mask = causal if win is None else causal & (kpos[None, :] > pos[:, None] - win)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[None, None], scale=self.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(1, t, self.n_heads * self.head_dim))
            h = h + self._mlp(li, layer, _norm(layer.post_attention_layernorm, h))
        h = _norm(self.norm, h)
        last = self.lm_head(h[0, -1]).float()
        return last, (self.lm_head(h[0]).float() if want_full else None)
