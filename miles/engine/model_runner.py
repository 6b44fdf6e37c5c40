"""Forward passes and the KV cache.

``ModelRunner`` loads any HF causal LM from a local directory with transformers and serves two calls:
``prefill`` (new requests, padded into one batch) and ``decode`` (one token for every running request);
with the paged cache also ``decode_mixed`` (a decode step whose forward also carries a prompt chunk).
Running requests occupy KV slots ``0..n-1`` (the scheduler keeps them compact), so a decode step works
on the static-shaped views ``cache[:bucket]``.

Two implementations sit behind it:

* ``_NativeLM`` for the Llama / Qwen2 / Qwen3 / Mistral family: our own attention over a slot-based
  static KV cache ``[slots, kv_heads, max_context, head_dim]`` per layer, reusing the HF modules for
  the projections, norms (incl. Qwen3's q/k norm), MLP and rotary tables (so rope_theta and rope scaling
  come from the HF config). The decode step has static shapes per (batch bucket, context bucket) and is
  captured as a CUDA graph on GPU (``cuda_graph=True``).
* ``_GenericLM`` for every other architecture: the HF forward with one ``DynamicCache`` per slot,
  one request at a time. Slow but general: "any HF causal LM" loads.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from miles.engine import fused_ops, paged_attention
from miles.engine.paged_cache import PagedKV, to_device
from miles.engine.routed_experts import RoutedExpertsRecorder
from miles.engine.weights import checkpoint_parts, checkpoint_renames, drop_mtp, mtp_layer_names
from miles.utils.logging import get_logger

logger = get_logger("miles.engine.model_runner")

NATIVE_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class RunnerOptions:
    device: str = "cpu"
    dtype: str = "auto"
    max_running_requests: int = 64
    max_context_len: int | None = None
    cuda_graph: bool = True
    native: bool = True            # False forces the generic HF path (for tests and odd models)
    max_total_tokens: int | None = None      # KV tokens in all (sglang --max-total-tokens): caps the slots
    cuda_graph_bs: list[int] | None = None   # decode batch sizes captured as graphs (sglang --cuda-graph-bs)
    cuda_graph_max_bs: int | None = None     # largest such batch (sglang --cuda-graph-max-bs)
    kv_cache: str = "auto"                   # "paged" | "slots" | "auto" (paged on GPU, slots on CPU)
    page_size: int = 16                      # tokens per KV page (paged cache; sglang --page-size)
    deterministic: bool = False              # batch-invariant forwards (sglang --enable-deterministic-inference)
    clamp_shared_expert: bool = True         # off: --no-activation-func-clamp-shared-expert (unclamp_shared_experts)
    mix_step_tokens: int | None = None       # prompt tokens a mixed step carries with CUDA graphs (None: MIX_STEP_TOKENS)
    enable_lora: bool = False                # serve LoRA adapters (sglang --enable-lora; miles.engine.lora)
    max_lora_rank: int | None = None         # sglang --max-lora-rank: larger adapters are refused at load
    max_loaded_loras: int | None = None      # sglang --max-loaded-loras
    lora_target_modules: list[str] | None = None   # sglang --lora-target-modules: the linears adapters may target
    experts_shared_outer_loras: bool = False       # sglang --experts-shared-outer-loras (miles.engine.lora_experts)


def graph_batch_sizes(max_slots: int, sizes: list[int] | None = None, max_bs: int | None = None) -> list[int]:
    """Decode batch sizes captured as CUDA graphs; a larger batch runs without one (as in SGLang).

    Default: 1, 2, 4, .., 32, then steps of 32, up to the slot count (or ``max_bs``)."""
    cap = min(max_slots, max_bs) if max_bs is not None else max_slots
    if sizes is None:
        sizes, b = [], 1
        while b < cap:
            sizes.append(b)
            b = b * 2 if b < 32 else b + 32
        sizes.append(cap)
    return sorted({b for b in sizes if 1 <= b <= cap})


# prompt tokens a mixed prefill + decode step carries in its CUDA graphs (paged cache): their chunk size
MIX_TOKENS = 256
# prompts a mixed step carries at most (each in its own block-table row), and the prompt tokens it carries at most
# with CUDA graphs (a step carrying more than MIX_TOKENS runs eagerly: its prompt tokens' compute outweighs the
# launches a graph saves); without graphs a mixed step carries MIX_TOKENS
MIX_RIDERS = 8
MIX_STEP_TOKENS = 1024

PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # divisors of the 64-token alignment of the decode context buckets


def resolve_kv_cache(name: str, device: torch.device) -> str:
    if name == "auto":
        return "paged" if device.type == "cuda" else "slots"
    if name not in ("paged", "slots"):
        raise ValueError(f"--kv-cache {name!r} is not one of auto, paged, slots")
    return name


def resolve_dtype(name: str, device: torch.device, config) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = getattr(torch, ckpt, None)
        return ckpt if ckpt in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype {name!r} is not one of auto, float32, bfloat16, float16")
    return table[name]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm as one fused ``F.rms_norm`` (statistics in fp32 inside the kernel, the weight applied before
    the single rounding to the activation dtype) where the module allows; otherwise the module itself."""
    eps = getattr(module, "variance_epsilon", None)
    w = getattr(module, "weight", None)
    if eps is None or w is None or type(module).__name__ not in _PLAIN_RMSNORMS:
        return module(x)
    if x.dtype == torch.float32 or w.dtype != x.dtype:
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight=w, eps=eps)


_PLAIN_RMSNORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
_SILU = {"SiLU", "SiLUActivation"}


def _fuse_linears(mods: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One ``[sum(out), in]`` buffer holding the weights (and biases) of ``mods``, whose parameters become views
    of it: an in-place weight update (``load_tensors``) writes the fused buffer, and one GEMM replaces several.
    None (nothing changed) when the layers cannot share one (bias on some only, other dtypes or devices)."""
    ws = [m.weight for m in mods]
    bs = [getattr(m, "bias", None) for m in mods]
    has_bias = [b is not None for b in bs]
    if any(has_bias) and not all(has_bias):
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    with torch.no_grad():
        w_all = torch.cat([w.data for w in ws])
        b_all = torch.cat([b.data for b in bs]) if all(has_bias) else None
        o = 0
        for w, b in zip(ws, bs):
            n = w.shape[0]
            w.data = w_all[o:o + n]
            if b_all is not None:
                b.data = b_all[o:o + n]
            o += n
    return w_all, b_all


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 40


class _NativeLM:
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
            if self.group > 1:
                k = k.repeat_interleave(self.group, dim=1)
                v = v.repeat_interleave(self.group, dim=1)
            win = self.windows[li]
            if win is not None and win < T:
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

    # ------------------------------------------------------------------ decode

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


_CONFIG_CACHE = ("deepseek_v4",)


class _GenericLM:
    """Any HF causal LM: its own forward, one DynamicCache per slot, one request at a time."""

    def __init__(self, model, max_slots: int, max_ctx: int, device: torch.device):
        self.model, self.max_slots, self.max_ctx, self.device = model, max_slots, max_ctx, device
        self.caches: list = [None] * max_slots
        # MoE routing of every token each slot's forwards ran (SGLang's return_routed_experts), recorded only for the
        # slots whose request asked (``record_routes``): the other forwards run without the router hooks
        self.recorder = RoutedExpertsRecorder(model, getattr(model.config, "text_config", None) or model.config)
        self.routes: list[list[torch.Tensor] | None] = [None] * max_slots
        self.record: list[bool] = [False] * max_slots
        self.use_graphs = False
        self.lora = None   # miles.engine.lora.LoraServing when adapters are served
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (input and output)
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _run(self, ids: torch.Tensor, cache, slot: int | None = None, append: bool = False, **model_kw: torch.Tensor):
        """One HF forward of ``ids`` on ``cache`` (``model_kw``: further model inputs, e.g. a VLM's positions and
        pixels); records the run's expert routing for ``slot`` when it records (appended to the slot's when
        ``append``)."""
        rec = slot is not None and self.record[slot] and self.recorder.enabled
        if self.lora is not None:
            self.lora.tokens(None if slot is None else torch.full((ids.numel(),), slot, dtype=torch.long,
                                                                  device=self.device))
        if rec:
            self.recorder.begin()
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache}, **model_kw)
        if rec:
            rows = self.recorder.end(ids.shape[-1])
            self.routes[slot] = (self.routes[slot] or []) + [rows] if append else [rows]
        return out.logits, out[self.cache_kw] if self.cache_kw in out else out.past_key_values

    def record_routes(self, slot: int, on: bool) -> None:
        """Whether ``slot``'s forwards record their MoE routing from now on; off drops the rows it holds."""
        self.record[slot] = on
        if not on:
            self.routes[slot] = None

    def routed_experts(self, slot: int) -> torch.Tensor | None:
        """``[tokens run, layers, top-k]`` int32 of the request in ``slot`` (None for a dense model or a slot that
        does not record)."""
        parts = self.routes[slot]
        return None if not parts else torch.cat(parts)

    def cache_bytes(self) -> int:
        return 0

    def allocate_cache(self) -> None:
        self.caches = [None] * self.max_slots

    def free_cache(self) -> None:
        self.caches = [None] * self.max_slots

    reset_cache = allocate_cache

    def drop_graphs(self) -> None:
        pass

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None
        self.routes[dst], self.routes[src] = self.routes[src], None
        self.record[dst], self.record[src] = self.record[src], False

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        import copy

        self.caches[dst] = copy.deepcopy(self.caches[src])
        parts = self.routes[src]   # the prompt's rows, for a ``dst`` that records (set before the share)
        self.routes[dst] = [torch.cat(parts)[:length]] if parts and self.record[dst] else None

    def release_slot(self, slot: int) -> None:
        self.caches[slot] = None
        self.routes[slot] = None
        self.record[slot] = False

    KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

    def _new_cache(self, cache_cls):
        """An empty cache for one sequence. A model whose config.json names layers other than (windowed) attention
        gets the cache built from its config, as transformers' ``generate`` builds it: DeepSeek sparse attention's
        "indexed_attention" (DeepSeek-V3.2, GLM-5: the indexer's keys), the recurrent "linear_attention" / "conv"
        / "hybrid" layers (Nemotron-H's Mamba-2, Qwen3-Next / Qwen3.5's gated DeltaNet: a conv and a recurrent state
        per layer, which a cache of lazily added key/value layers cannot hold) and the stateless "moe" / "mlp" layers;
        so does DeepSeek-V4 (sliding window plus compressor state per layer type). Each request has its own cache and
        runs alone (batch 1), so a recurrent state never mixes requests."""
        config = getattr(self.model, "config", None)
        text = config.get_text_config(decoder=True) if config is not None else None
        layer_types = set(getattr(text, "layer_types", None) or ())
        own = bool(layer_types - self.KV_LAYER_TYPES) or getattr(text, "model_type", None) in _CONFIG_CACHE or \
            getattr(config, "model_type", None) in _CONFIG_CACHE
        return cache_cls(config=config) if own else cache_cls()

    @torch.no_grad()
    def prefill(self, slot_start: int, seqs: list[list[int]], full_for: list[bool]):
        from transformers import DynamicCache

        def forward(row: int, slot: int, ids: torch.Tensor) -> torch.Tensor:
            logits, self.caches[slot] = self._run(ids, self._new_cache(DynamicCache), slot)
            return logits

        return self._prefill_rows(slot_start, seqs, full_for, forward)

    def _prefill_rows(self, slot_start: int, seqs: list[list[int]], full_for: list[bool],
                      forward: Callable[[int, int, torch.Tensor], torch.Tensor]):
        """Each sequence prefilled on its own (batch 1): ``forward(row, slot, ids)`` runs ``ids`` [1, T] into
        ``slot``'s new cache and returns the logits; the last position's logits of every row (stacked) and all of
        them for the rows ``full_for`` asks (else None)."""
        last, full = [], []
        for i, s in enumerate(seqs):
            ids = torch.tensor([s], dtype=torch.long, device=self.device)
            logits = forward(i, slot_start + i, ids)
            last.append(logits[0, -1].float())
            full.append(logits[0].float() if full_for[i] else None)
        return torch.stack(last), full

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        rows = []
        for i in range(tokens.shape[0]):
            logits, self.caches[i] = self._run(tokens[i: i + 1][None], self.caches[i], i, append=True,
                                               **self._decode_inputs(i, positions))
            rows.append(logits[0, -1].float())
        return torch.stack(rows)

    def _decode_inputs(self, slot: int, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Further model inputs of ``slot``'s decode step (none; a VLM's M-RoPE positions)."""
        return {}


class ParamIndex(dict):
    """The live tensors by HF name (``state_dict`` names; iteration and ``len`` cover those only). transformers 5
    fuses MoE experts into 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I];
    Nemotron-H's non-gated ``mixer.experts.up_proj``) while checkpoints, SGLang and the trainers' exports name them
    per expert (``mlp.experts.<e>.gate_proj.weight`` ...): lookups by those names return views into the fused
    storage (made on lookup, so none outlives a release of the weights), and updates and reads by either name
    reach the same weights. ``renames`` (``weights.checkpoint_renames``): the checkpoint's names of tensors that
    transformers renames on load (Nemotron-H's ``backbone.*``), looked up as the names they load into. ``parts``
    (``weights.checkpoint_parts``): the checkpoint's other names that transformers converts on load, each a view of
    part of a live tensor (transformers' conversion reverted, as the trainers export it: DeepSeek-V4's native names)."""

    def __init__(self, params: dict[str, torch.Tensor], renames: dict[str, str] | None = None,
                 parts: dict[str, tuple[str, Any]] | None = None):
        super().__init__(params)
        self.aliases: dict[str, tuple[str, int, int | None]] = {}     # name -> (fused name, expert, half)
        for name, p in params.items():
            if p.dim() == 3 and name.endswith(".experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    self.aliases[f"{name[:-13]}.{e}.gate_proj.weight"] = (name, e, 0)
                    self.aliases[f"{name[:-13]}.{e}.up_proj.weight"] = (name, e, 1)
            elif p.dim() == 3 and name.endswith((".experts.down_proj", ".experts.up_proj")):
                base, proj = name.rsplit(".", 1)
                for e in range(p.shape[0]):
                    self.aliases[f"{base}.{e}.{proj}.weight"] = (name, e, None)
        self.renames: dict[str, str] = {}                              # checkpoint name -> parameter name
        for ext, name in (renames or {}).items():
            if dict.__contains__(self, ext) or ext in self.aliases:     # a live name already: never shadowed
                continue
            if dict.__contains__(self, name):
                self.renames[ext] = name
            elif name in self.aliases:
                self.aliases[ext] = self.aliases[name]
        self.parts: dict[str, tuple[str, Any]] = {}                     # checkpoint name -> (live name, Part)
        for ext, (name, part) in (parts or {}).items():
            if not (dict.__contains__(self, ext) or ext in self.aliases or ext in self.renames) \
                    and dict.__contains__(self, name):
                self.parts[ext] = (name, part)

    def _view(self, name: str) -> torch.Tensor:
        if name in self.parts:
            live, part = self.parts[name]
            return part.of(dict.__getitem__(self, live).detach())
        fused, e, half = self.aliases[name]
        t = dict.__getitem__(self, fused).detach()[e]
        return t if half is None else t.chunk(2, dim=0)[half]

    def get(self, name, default=None):
        if dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        if name in self.renames:
            return dict.__getitem__(self, self.renames[name])
        return self._view(name) if name in self.aliases or name in self.parts else default

    def __missing__(self, name):
        return dict.__getitem__(self, self.renames[name]) if name in self.renames else self._view(name)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self.aliases or name in self.renames or name in self.parts


def has_causal_lm(config) -> bool:
    """Whether transformers has a causal-LM class for ``config``'s model type (a registered alias counts); False for
    a multimodal type it builds only as an image-text-to-text model (Kimi-K2.5's ``kimi_k25``), which the engine
    loads as that and serves on text (no image input: ``miles.engine.vlm`` is Qwen3-VL's)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    mt = getattr(config, "model_type", None)
    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or mt not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def unclamp_shared_experts(model: torch.nn.Module) -> int:
    """``--no-activation-func-clamp-shared-expert``: transformers' shared experts whose SwiGLU clamps at ``limit``
    (DeepSeek-V4's ``DeepseekV4MLP``) computed unclamped, the routed experts' clamp kept; as the trainer computes them
    with Miles's flag (``miles.trainer.megatron.fork_flags``). ValueError, one line, when the model has none."""
    found = [m for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] == "shared_experts" and isinstance(getattr(m, "limit", None), (int, float))]
    if not found:
        raise ValueError(f"--no-activation-func-clamp-shared-expert: {type(model).__name__} has no shared experts with "
                         "a clamped SwiGLU (DeepSeek-V4's swiglu_limit); drop the flag")
    for m in found:
        m.limit = float("inf")             # clamp(max=inf) and clamp(-inf, inf) leave every value as it is
    return len(found)


class ModelRunner:
    """The model, its KV cache, weight access, and memory release/resume."""

    def __init__(self, model_path: str | Path, opts: RunnerOptions):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = str(model_path)
        from miles.utils.model_dir import check_model_dir

        check_model_dir(self.model_path, "--hf-checkpoint")  # ModelDirError (a ValueError): one line naming the file
        self.device = torch.device(opts.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {opts.device}: CUDA is not available in this process; use --device cpu")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        config = AutoConfig.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(opts.dtype, self.device, config)
        from miles.engine import vlm

        self.is_vlm = vlm.is_vlm(config)   # Qwen3-VL: images on /generate, the generic HF path (miles.engine.vlm)
        if self.is_vlm or not has_causal_lm(config):   # a multimodal model type without a causal LM (Kimi-K2.5):
            from transformers import AutoModelForImageTextToText as auto_cls  # its own model, served on text
        else:
            auto_cls = AutoModelForCausalLM
        self.model = auto_cls.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        if not opts.clamp_shared_expert:
            logger.info("--no-activation-func-clamp-shared-expert: %d shared experts served unclamped",
                        unclamp_shared_experts(self.model))
        self.config = self.model.config
        text_cfg = getattr(self.config, "text_config", None) if self.is_vlm else None
        self.is_mtp_name = mtp_layer_names(text_cfg or self.config)   # the checkpoint's MTP layers: not served, skipped
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        limit = int(getattr(text_cfg or self.config, "max_position_embeddings", 0) or 4096)
        max_ctx = opts.max_context_len
        if max_ctx is None:
            max_ctx = min(limit, 4096)
        if max_ctx < 2:
            raise ValueError(f"--max-context-len {max_ctx} is too small; give at least prompt + response length")
        if max_ctx > limit:
            logger.warning("--max-context-len %d exceeds the model's max_position_embeddings %d", max_ctx, limit)
        self.max_ctx = max_ctx
        self.max_slots = int(opts.max_running_requests)
        if self.max_slots < 1:
            raise ValueError(f"--max-running-requests {self.max_slots} must be at least 1")
        self.paged = resolve_kv_cache(opts.kv_cache, self.device) == "paged"
        if opts.page_size not in PAGE_SIZES:
            raise ValueError(f"--page-size {opts.page_size} is not one of {', '.join(map(str, PAGE_SIZES))}")
        self.page_size = opts.page_size
        if opts.max_total_tokens is not None:
            if opts.max_total_tokens < max_ctx:
                raise ValueError(f"--max-total-tokens {opts.max_total_tokens} is less than one request's context "
                                 f"({max_ctx} tokens, --max-context-len): raise it or lower --max-context-len")
            if not self.paged:  # the paged cache admits by free pages instead
                self.max_slots = min(self.max_slots, opts.max_total_tokens // max_ctx)
        self.graph_batch_sizes = graph_batch_sizes(self.max_slots, opts.cuda_graph_bs, opts.cuda_graph_max_bs)
        self.deterministic = opts.deterministic
        if self.deterministic:  # one decode shape, all the slots (see _NativeLM); captured when a bucket allows it
            self.graph_batch_sizes = [b for b in self.graph_batch_sizes if b == self.max_slots]
            if opts.cuda_graph and self.device.type == "cuda" and not self.graph_batch_sizes:
                logger.warning("--enable-deterministic-inference decodes every step at all %d slots, which "
                               "--cuda-graph-bs/--cuda-graph-max-bs do not capture: decode runs without a CUDA graph; "
                               "capture %d to have one", self.max_slots, self.max_slots)
        native = opts.native and getattr(self.config, "model_type", "") in NATIVE_MODEL_TYPES and not self.is_vlm
        self.impl: _NativeLM | _GenericLM
        if native:
            try:
                pages = self._pool_pages(opts, max_ctx) if self.paged else None
                # served adapters run through Python hooks per forward: no CUDA graphs then
                self.impl = _NativeLM(self.model, self.max_slots, max_ctx, self.device, self.dtype,
                                      opts.cuda_graph and not opts.enable_lora,
                                      self.graph_batch_sizes, pages, self.page_size, opts.deterministic,
                                      mix_step_tokens=opts.mix_step_tokens)
            except (AttributeError, NotImplementedError) as e:
                logger.warning("native forward unavailable for %s (%s); using the generic HF path", self.config.model_type, e)
                native = False
        if not native:
            generic = vlm.VLMGenericLM if self.is_vlm else _GenericLM
            self.impl = generic(self.model, self.max_slots, max_ctx, self.device)
            self.paged = False
        self.native = native
        self.kv: PagedKV | None = getattr(self.impl, "kv", None)
        need, avail = self.impl.cache_bytes(), _available_bytes(self.device)
        # a pool sized from free memory fits by construction (_pool_pages); an explicit --max-total-tokens may not
        if need > 0.9 * avail and self.kv is not None and opts.max_total_tokens is not None:
            raise ValueError(f"the KV page pool needs {need / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB is free; "
                             f"lower --max-total-tokens")
        if need > 0.9 * avail:
            raise ValueError(f"the KV cache needs {need / 2**30:.1f} GiB ({self.max_slots} slots x {max_ctx} tokens) but only "
                             f"{avail / 2**30:.1f} GiB is free; lower --max-running-requests or --max-context-len")
        self._renames = checkpoint_renames(self.model_path, self.model)   # e.g. Nemotron-H's backbone.* names
        self.lora = None
        if opts.enable_lora:   # sglang --enable-lora: adapters named by /generate's lora_path (miles.engine.lora)
            from miles.engine.lora import LoraServing

            self.lora = LoraServing(self.model, self.max_slots + MIX_RIDERS + 2, self.device,
                                    max_rank=opts.max_lora_rank, max_loaded=opts.max_loaded_loras,
                                    target_modules=opts.lora_target_modules,
                                    experts_shared_outer=opts.experts_shared_outer_loras, renames=self._renames)
            self.impl.lora = self.lora
            if native:
                self.impl.unfuse()
        self.impl.allocate_cache()
        self.eos_token_ids = self._eos_ids()
        self._parts = checkpoint_parts(self.model_path, self.model)       # e.g. DeepSeek-V4's native names
        self._params = ParamIndex(self.model.state_dict(keep_vars=True), self._renames, self._parts)
        self._weights_backup: dict[int, torch.Tensor] | None = None
        self.weights_epoch = 0   # bumped by every weight load: cached prompt KV/logits from before are stale
        self.weights_released = False
        self.kv_released = False
        layout = (f"paged KV cache of {self.kv.pool.num_pages - 1} pages x {self.page_size} tokens" if self.kv is not None
                  else f"slot KV cache of {self.max_slots} x {max_ctx} tokens")
        logger.info("loaded %s (%s, %s) on %s: %s forward, %d running requests at most, %s, %.1f MiB%s",
                    self.model_path, self.config.model_type, self.dtype, self.device, "native" if native else "generic HF",
                    self.max_slots, layout, need / 2**20, ", CUDA graphs" if getattr(self.impl, "use_graphs", False) else "")

    def _pool_pages(self, opts: RunnerOptions, max_ctx: int) -> int:
        """Pages in the pool (+1 scratch page): --max-total-tokens, else as much as the slot cache, capped by memory."""
        ps = self.page_size
        cfg = self.config
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        el = torch.tensor([], dtype=self.dtype).element_size()
        page_bytes = 2 * int(cfg.num_hidden_layers) * ps * n_kv * head_dim * el
        one_request = -(-max_ctx // ps)
        if opts.max_total_tokens is not None:
            return -(-opts.max_total_tokens // ps) + 1
        pages = self.max_slots * one_request + 1
        avail = _available_bytes(self.device)
        fraction = getattr(opts, "mem_fraction_static", None)
        if fraction is not None and self.device.type == "cuda":  # sglang's meaning: weights + KV pool of total memory
            total = torch.cuda.mem_get_info(self.device)[1]
            cap = int(fraction * total) - (total - avail)
        else:
            cap = int(0.85 * avail)
        if pages * page_bytes > cap:
            fit = max(cap // page_bytes, 0)
            if fit < one_request + 1:
                raise ValueError(f"the KV page pool would get {fit} pages of {ps} tokens but one request's context needs "
                                 f"{one_request} (--max-context-len {max_ctx}); free memory or lower --max-context-len")
            logger.info("KV page pool capped by free memory: %d pages (%d tokens)", fit, (fit - 1) * ps)
            pages = fit
        return pages

    # ------------------------------------------------------------------ paged KV bookkeeping (no-ops for slots)
    def free_pages(self) -> int | None:
        return self.kv.pool.num_free if self.kv is not None else None

    def pages_for(self, ntok: int) -> int:
        return -(-ntok // self.page_size)

    def grow_pages(self, slots: list[int]) -> None:
        """One more page for each slot whose next token starts a page (the caller checked free_pages)."""
        if self.kv is not None:
            self.kv.grow_one_page(slots)

    def release_slot(self, slot: int) -> None:
        self.impl.release_slot(slot)

    @property
    def chunk_row(self) -> int | None:
        """The block-table row of a prompt prefilled in chunks (paged native cache), else None (no chunking)."""
        return self.kv.chunk_row if self.kv is not None else None

    def prefill_chunk(self, row: int, tokens: list[int], start: int, want_full: bool):
        return self.impl.prefill_chunk(row, tokens, start, want_full)

    @property
    def mix_tokens(self) -> int:
        """Prompt tokens a mixed prefill + decode step can carry (paged native cache without sliding windows), else 0."""
        return getattr(self.impl, "mix_tokens", 0) if self.native else 0

    def decode_mixed(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int, row: int, chunk: list[int],
                     start: int) -> torch.Tensor:
        return self.impl.decode_mixed(tokens, positions, max_len, row, chunk, start)

    def decode_mixed_many(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int,
                          chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        return self.impl.decode_mixed_many(tokens, positions, max_len, chunks)

    @property
    def mix_step_tokens(self) -> int:
        """Prompt tokens one mixed step carries at most, over all its prompts (0: no mixed steps)."""
        return self.impl.mix_step_tokens if self.mix_tokens else 0

    @property
    def ride_rows(self) -> list[int]:
        """The block-table rows of the prompts prefilled inside decode steps (paged native cache; else none)."""
        return list(self.kv.ride_rows) if self.kv is not None and self.mix_tokens else []

    def pages_held(self, row: int) -> int:
        return len(self.kv.tables[row]) if self.kv is not None else 0

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.impl.share_prefix(src, dst, length)

    def share_prefix_many(self, src: int, dsts: list[int], length: int) -> None:
        """``share_prefix(src, dst, length)`` for every ``dst`` (batched where the cache can)."""
        many = getattr(self.impl, "share_prefix_many", None)
        if many is not None:
            return many(src, dsts, length)
        for dst in dsts:
            self.impl.share_prefix(src, dst, length)

    @property
    def can_share_running_prefix(self) -> bool:
        """Whether a running request's first ``length`` tokens of KV can seed a new request (native caches: the
        slot cache copies them, the paged cache shares the full pages); the generic HF path cannot crop its cache."""
        return self.native

    def kv_tokens(self) -> int:
        """KV tokens the cache holds in all (sglang's max_total_num_tokens)."""
        if self.kv is not None:
            return (self.kv.pool.num_pages - 1) * self.page_size
        return self.max_slots * self.max_ctx

    def kv_stats(self) -> dict[str, int]:
        if self.kv is None:
            return {}
        pool = self.kv.pool
        return {"kv_pages_total": pool.num_pages - 1, "kv_pages_in_use": pool.num_used, "kv_pages_peak": self.kv.peak_used,
                "kv_page_size": self.page_size}

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, list | tuple):
                ids.update(int(x) for x in e)
        return ids

    # ------------------------------------------------------------------ forward
    def prefill(self, slot_start: int, seqs: list[list[int]], full_for: list[bool], mm: list | None = None):
        """``mm``: per sequence its images (``miles.engine.vlm.ImageBatch``) or None; only a VLM takes them.
        Batch-invariant mode: each sequence is prefilled on its own (its forward's shapes are its own length's)."""
        if self.deterministic and len(seqs) > 1:
            outs = [self.prefill(slot_start + i, [s], [f], None if mm is None else [mm[i]])
                    for i, (s, f) in enumerate(zip(seqs, full_for))]
            return torch.cat([last for last, _ in outs]), [full[0] for _, full in outs]
        if mm is not None and any(b is not None for b in mm):
            return self.impl.prefill(slot_start, seqs, full_for, mm)
        return self.impl.prefill(slot_start, seqs, full_for)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.impl.decode(tokens, positions, max_len)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.impl.move_slot(src, dst, length)
        if self.lora is not None:
            self.lora.move_row(src, dst)

    def set_lora(self, row: int, index: int) -> None:
        """KV row ``row`` now holds a request of adapter ``index`` (0: the base model); no-op without adapters."""
        if self.lora is not None:
            self.lora.set_row(row, index)

    @property
    def has_routed_experts(self) -> bool:
        """MoE routing is recorded (a MoE model, which runs on the generic HF path)."""
        rec = getattr(self.impl, "recorder", None)
        return rec is not None and rec.enabled

    def record_routes(self, slot: int, on: bool) -> None:
        """Record ``slot``'s MoE routing from its next forward on (its request asked for routed experts), or stop and
        drop its rows; a slot released or freshly admitted does not record until told. A no-op where nothing is."""
        if self.has_routed_experts:
            self.impl.record_routes(slot, on)

    def routed_experts(self, slot: int) -> torch.Tensor | None:
        return self.impl.routed_experts(slot) if self.has_routed_experts else None

    @torch.no_grad()
    def pick_cpu_threads(self, rows: int = 64, reps: int = 5) -> int:
        """On CPU with more than one intra-op thread: time a one-token forward of ``rows`` rows (a decode step's
        matmuls; no KV cache is touched) on the calling thread's intra-op threads and on one, and keep the faster
        for every forward from now on. A tiny model decodes faster on one thread (its ops take microseconds, less
        than an OpenMP fork / join), a larger one on all of them. Each side: the best of ``reps`` forwards after a
        warm one. Returns the count kept (the count as it was on GPU, on one thread, or when the forward fails)."""
        n = torch.get_num_threads()
        if self.device.type != "cpu" or n == 1 or not self.ready:
            return n
        ids = torch.zeros(min(rows, self.max_slots), 1, dtype=torch.long)

        def best(threads: int) -> float:
            torch.set_num_threads(threads)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                self.model(input_ids=ids, use_cache=False)
                times.append(time.perf_counter() - t0)
            return min(times[1:])

        try:
            t_n, t_1 = best(n), best(1)
        except Exception:  # noqa: BLE001 - a model whose forward needs more than ids keeps the process's threads
            torch.set_num_threads(n)
            logger.debug("CPU thread check skipped: the one-token forward failed", exc_info=True)
            return n
        keep = 1 if t_1 < t_n else n
        torch.set_num_threads(keep)
        logger.info("CPU forwards on %d thread(s): a %d-row one-token forward took %.2f ms on %d, %.2f ms on 1",
                    keep, ids.shape[0], t_n * 1e3, n, t_1 * 1e3)
        return keep

    def warm_up(self) -> None:
        """Capture the decode CUDA graphs ahead of the first requests (a no-op where there are none to capture)."""
        warm = getattr(self.impl, "warm_up", None)
        if warm is not None and self.ready:
            t0 = time.perf_counter()
            n = warm()
            if n:
                logger.info("captured %d decode CUDA graphs in %.1f s", n, time.perf_counter() - t0)

    # ------------------------------------------------------------------ weights
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """HF parameter names (as in the safetensors files, tied aliases included) -> live tensors."""
        return self._params

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor], *, strict_names: bool = True) -> int:
        """Copy ``tensors`` into the live weights in place (CUDA graphs stay valid). Validates everything first."""
        params = self._params
        tensors = drop_mtp(tensors, self.is_mtp_name)      # the checkpoint's MTP layers: not served, skipped
        if self.weights_released:
            raise ValueError("weights are released (release_memory_occupation); resume them before updating")
        for name, t in tensors.items():
            p = params.get(name)
            if p is None:
                if strict_names:
                    raise ValueError(f"unknown parameter name '{name}'; the engine uses HF names such as "
                                     f"'{next(iter(params))}'")
                continue
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"parameter '{name}' has shape {tuple(p.shape)}, the update has {tuple(t.shape)}")
        n = 0
        self.weights_epoch += 1
        for name, t in tensors.items():
            p = params.get(name)
            if p is not None:
                p.data.copy_(t.to(device=p.device, dtype=p.dtype, non_blocking=True))
                n += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n

    def snapshot(self, names=None) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the named weights (all when None), for rollback."""
        names = list(self._params) if names is None else list(names)
        return {n: self._params[n].detach().to("cpu", copy=True) for n in names if n in self._params}

    # ------------------------------------------------------------------ memory
    def clear_cache(self) -> None:
        # Native: nothing to drop. The only KV shared across requests is a running request's prompt (the scheduler's
        # holders), and a flush needs nothing running; every read is masked to positions its own request wrote.
        # Zeroing the whole cache (512 MiB for 128 slots x 2,048 tokens of the quickstart model) cost more than the
        # rest of a weight sync together.
        if not self.native:
            self.impl.free_cache()

    def release(self, tags: set[str]) -> None:
        # CPU: host memory is not a device's to give back to a colocated trainer; the weights and the KV cache stay
        # (freeing the cache and zeroing it again at resume cost 0.55 s a step at 128 slots x 2,048 positions)
        if "kv_cache" in tags and not self.kv_released:
            if self.device.type != "cpu":
                self.impl.free_cache()
            self.kv_released = True
        if "cuda_graph" in tags or "weights" in tags:
            self.impl.drop_graphs()
        if "weights" in tags and not self.weights_released:
            if self.native:  # the fused q/k/v and gate/up buffers hold the weights' memory too
                self.impl.unfuse()
            backup: dict[int, torch.Tensor] = {}
            for p in {id(p): p for p in self.model.parameters()}.values():
                # GPU: a pinned host copy, then the device memory is freed; CPU: the tensor itself is kept
                host = p.data.to("cpu", copy=True).pin_memory() if self.device.type == "cuda" else p.data
                backup[id(p)] = host
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._weights_backup = backup
            self.weights_released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: set[str]) -> None:
        if "weights" in tags and self.weights_released:
            backup = self._weights_backup or {}
            for p in {id(p): p for p in self.model.parameters()}.values():
                p.data = backup[id(p)].to(self.device, non_blocking=True)
            self._weights_backup = None
            self.weights_released = False
            if self.native:
                self.impl.fuse()
            self._params = ParamIndex(self.model.state_dict(keep_vars=True), self._renames, self._parts)
        if "kv_cache" in tags and self.kv_released:
            if self.device.type != "cpu":
                self.impl.allocate_cache()
            else:                                      # the cache's contents stay; its bookkeeping starts afresh
                self.impl.reset_cache()
            self.kv_released = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def ready(self) -> bool:
        return not (self.weights_released or self.kv_released)
