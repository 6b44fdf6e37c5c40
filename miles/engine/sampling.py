"""Batched sampling: temperature, top-k, top-p, min-p, logit bias, min_new_tokens, per-request seeds.

Every row draws its randomness from a counter-based hash of ``(seed, step, token id)`` (a Gumbel-max
race), so a request's samples depend only on its own ``sampling_seed`` and position: they are
reproducible and independent of which other requests share the batch. Rows without a seed get a random
one when they are admitted.

Log-probabilities follow SGLang's default: ``log_softmax(logits / temperature)`` over the whole
vocabulary (top-k/top-p/min-p truncation is *not* renormalised into them), after logit bias and the
min_new_tokens stop-token mask. Greedy rows (temperature 0 or top_k 1) use temperature 1, i.e. the raw
distribution. With ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (SGLang's switch) the raw distribution is used for
every row. This is the quantity a trainer computes as "the log-prob under the rollout temperature".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from miles.engine import sample_kernel
from miles.engine.protocol import TOP_K_ALL

_M32 = 0xFFFFFFFF
RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit key for this step (int64 holding [0, 2^32)): the per-row half of ``hash_uniform``."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    return _mix32(lo ^ _mix32(hi ^ _mix32((steps & _M32) ^ 0x5BD1E995)))


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise, a pure function of (seed, step, token id): shape [B, vocab] for an int,
    or the shape of ``vocab`` when it is a [B, K] tensor of token ids (the same values at those ids)."""
    key = row_keys(seeds, steps)
    if isinstance(vocab, int):
        ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    else:
        ids = vocab.to(torch.int64)
    bits = _mix32(key[:, None] ^ ((ids * 0x9E3779B1) & _M32))
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


_TOPK_FAST_MAX = 1024     # top-k (and the top-p/min-p prefilter) race among at most this many best tokens
USE_FUSED_KERNEL = True   # the Triton sampler for rows without top-k/top-p/min-p (CUDA, Triton installed)


@dataclass
class RowParams:
    """What the sampler needs to know about one running request."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    logit_bias: dict[int, float] | None = None


class SamplingBatch:
    """Per-row sampling parameters as device tensors, rebuilt only when the batch composition changes."""

    def __init__(self, rows: list[RowParams], vocab: int, device: torch.device):
        self.n = len(rows)
        self.vocab = vocab
        self.device = device
        # two host-to-device copies (the float and the integer columns), not one per field: a batch is rebuilt
        # whenever a request joins or leaves, which with varied lengths is most decode steps
        greedy = [r.top_k == 1 for r in rows]
        floats = torch.tensor([[r.temperature, r.top_p, r.min_p] for r in rows], dtype=torch.float64).reshape(-1, 3)
        ints = torch.tensor([[min(r.top_k, vocab), r.seed & ((1 << 63) - 1), g] for r, g in zip(rows, greedy)],
                            dtype=torch.int64).reshape(-1, 3)
        if device.type == "cuda":  # pinned + non_blocking: queued behind the running forward, not waiting for it
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(device=device, non_blocking=True).to(torch.float32).T
        ints = ints.to(device, non_blocking=True).T
        self.temperature, self.top_p, self.min_p = floats[0].contiguous(), floats[1].contiguous(), floats[2].contiguous()
        self.top_k, self.seeds = ints[0].contiguous(), ints[1].contiguous()
        self.greedy = ints[2].bool()
        self.greedy_i32 = ints[2].to(torch.int32)  # the fused kernel's flag, made once per batch composition
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        self.need_top_k = any(1 < r.top_k < min(TOP_K_ALL, vocab) for r in rows)
        self.need_top_p = any(r.top_p < 1.0 for r in rows)
        self.need_min_p = any(r.min_p > 0.0 for r in rows)
        self.max_top_k = max(min(r.top_k, vocab) for r in rows)
        self.all_temp_one = all(r.temperature == 1.0 for r in rows)
        self.logit_bias = None
        if any(r.logit_bias for r in rows):
            bias = torch.zeros(self.n, vocab, dtype=torch.float32, device=device)
            for i, r in enumerate(rows):
                for tid, v in (r.logit_bias or {}).items():
                    bias[i, tid] = v
            self.logit_bias = bias


@dataclass
class SampleOutput:
    tokens: torch.Tensor                  # [B] int64
    logprobs: torch.Tensor | None         # [B] float32, of the chosen tokens
    top_values: torch.Tensor | None       # [B, k]
    top_indices: torch.Tensor | None      # [B, k]
    logprob_dist: torch.Tensor | None     # [B, V] when token_ids_logprob asks for arbitrary ids


def sample(
    logits: torch.Tensor,
    sb: SamplingBatch,
    steps: torch.Tensor,
    *,
    suppress: torch.Tensor | None = None,
    want_logprobs: bool = False,
    top_n: int = 0,
    want_dist: bool = False,
    fused: bool = True,
) -> SampleOutput:
    """Choose one token per row of ``logits`` [B, V] (float32). ``steps`` [B]: tokens generated so far.

    ``suppress`` [B, V] bool masks tokens that may not be chosen (stop tokens before min_new_tokens). ``fused``:
    the Triton sampler may take a batch whose rows all allow it. It computes the same tokens as the torch path but
    its log-probs may differ in the last bits, so the batch-invariant mode passes False: which path a row takes
    must not depend on the other rows.
    """
    logits = logits.float()
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    if sb.logit_bias is not None:
        logits = logits + sb.logit_bias
    truncate = sb.need_top_k or sb.need_top_p or sb.need_min_p
    plain = not (truncate or top_n or want_dist or sb.all_greedy or RETURN_ORIGINAL_LOGPROB)
    if plain and fused and USE_FUSED_KERNEL and sample_kernel.available(logits.device):
        tokens, lp = sample_kernel.fused_sample(logits, sb.temperature, sb.seeds, steps, sb.greedy_i32)
        return SampleOutput(tokens=tokens, logprobs=lp if want_logprobs else None, top_values=None, top_indices=None,
                            logprob_dist=None)
    logp = None
    if sb.all_greedy:
        tokens = torch.argmax(logits, dim=-1)
        scaled = logits
    else:
        scaled = logits if sb.all_temp_one else logits / sb.temperature[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        top = _truncated_top(logp, sb) if truncate else None
        if top is not None:
            # every row's support lies within its K best tokens: race among them (the same noise per token id
            # as the full path, so the same tokens), no full-vocabulary sort
            vals, idx = top
            g = -torch.log(-torch.log(hash_uniform(sb.seeds, steps, idx)))
            tokens = idx.gather(1, torch.argmax(vals + g, dim=-1, keepdim=True)).squeeze(1)
            filtered = None
        elif truncate:
            sorted_lp, idx = logp.sort(dim=-1, descending=True)
            sorted_lp = sorted_lp.masked_fill(_removed(sorted_lp, sb, torch.arange(sb.vocab, device=logits.device)),
                                              float("-inf"))
            filtered = torch.empty_like(logp).scatter_(1, idx, sorted_lp)
        else:
            filtered = logp
        if filtered is not None:
            u = hash_uniform(sb.seeds, steps, sb.vocab)
            gumbel = -torch.log(-torch.log(u))
            tokens = torch.argmax(filtered + gumbel, dim=-1)
        if sb.any_greedy:
            tokens = torch.where(sb.greedy, torch.argmax(logits, dim=-1), tokens)
    out = SampleOutput(tokens=tokens, logprobs=None, top_values=None, top_indices=None, logprob_dist=None)
    if want_logprobs or top_n or want_dist:
        if RETURN_ORIGINAL_LOGPROB:
            dist = torch.log_softmax(logits, dim=-1)
        else:
            dist = logp if logp is not None else torch.log_softmax(scaled, dim=-1)
        out.logprobs = dist.gather(1, tokens[:, None]).squeeze(1)
        if top_n:
            out.top_values, out.top_indices = dist.topk(min(top_n, sb.vocab), dim=-1)
        if want_dist:
            out.logprob_dist = dist
    return out


def _removed(sorted_lp: torch.Tensor, sb: SamplingBatch, ranks: torch.Tensor) -> torch.Tensor:
    """Which of each row's tokens, sorted by log-prob (descending), top-k / top-p / min-p cut off."""
    remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
    if sb.need_top_k:
        remove |= ranks[None, :] >= sb.top_k[:, None]
    if sb.need_top_p or sb.need_min_p:
        probs = sorted_lp.exp()
        if sb.need_top_p:
            remove |= (probs.cumsum(dim=-1) - probs) > sb.top_p[:, None]
        if sb.need_min_p:
            remove |= probs < probs[:, :1] * sb.min_p[:, None]
    return remove


def _truncated_top(logp: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's K best log-probs (masked by its top-k/top-p/min-p) and their ids, when every row's support
    provably lies within them: its top_k <= K, or its top-p mass is reached inside them, or its min-p
    threshold excludes the K-th token. None otherwise (the caller sorts the whole vocabulary)."""
    K = min(_TOPK_FAST_MAX, sb.vocab)
    if K < 1 or (not (sb.need_top_p or sb.need_min_p) and sb.max_top_k > K):
        return None
    k = sb.max_top_k if not (sb.need_top_p or sb.need_min_p) else K
    vals, idx = logp.topk(k, dim=-1)
    if (sb.need_top_p or sb.need_min_p) and k < sb.vocab:
        probs = vals.exp()
        inside = sb.top_k <= k
        if sb.need_top_p:
            inside |= (sb.top_p < 1.0) & (probs.sum(dim=-1) > sb.top_p)
        if sb.need_min_p:
            inside |= (sb.min_p > 0.0) & (probs[:, -1] < probs[:, 0] * sb.min_p)
        if not bool(inside.all()):
            return None
    return vals.masked_fill(_removed(vals, sb, torch.arange(k, device=logp.device)), float("-inf")), idx
