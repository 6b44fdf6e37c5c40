"""Log-probs and entropy of the response tokens straight from hidden states and the output embedding, with
a hand-written backward (``logprobs.logprobs_and_entropy`` takes this path on a GPU, without a vocabulary
shard).

Autograd over ``logits.float() / T -> logsumexp -> gather (-> softmax -> sum p z)`` keeps several fp32
``[N, V]`` tensors per chunk and, under activation checkpointing, runs all of it twice; for a Qwen3 vocabulary
(151,936) and 16k response tokens each of those tensors is 10.0 GB (9.3 GiB). Here a chunk is one autograd function:

    forward:  logits = h W^T (compute dtype); per row, from the logits read once or twice (fp32 in registers):
              lse = logsumexp(z), log p_y = z_y - lse, mu = sum_v softmax(z)_v z_v, H = lse - mu  (z = logits / T)
    backward: dz = g_lp (onehot_y - p) - g_H p (z - mu),  d logits = dz / T  (in the logits' dtype);
              dh = d logits W,  dW = d logits^T h

Only the logits in their compute dtype (bf16 on GPU) are kept for the backward, and only when one chunk
covers every row (``--log-probs-chunk-size -1``, Miles's default): half of the one fp32 chunk the checkpointed
path holds at a time. With smaller chunks the backward recomputes each chunk's logits (one matmul), as the
checkpointed path does, so memory stays bounded by one chunk. On CUDA the two row-wise functions are
compiled (``torch.compile``, dynamic shapes), which fuses the casts, exponentials and reductions into a
few passes over the logits; elsewhere they run eagerly (same math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_compiled: dict[str, object] = {}


def _row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
               with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [C, V] -> (log p of targets, lse, mu = sum p z), fp32 [C] each (mu zeros without entropy)."""
    z = logits.float() / temperature
    m = z.amax(dim=-1, keepdim=True)
    e = (z - m).exp()
    s = e.sum(dim=-1)
    lse = m.squeeze(-1) + s.log()
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    mu = (e * z).sum(dim=-1) / s if with_entropy else torch.zeros_like(lse)
    return logp, lse, mu


def _row_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, mu: torch.Tensor,
              g_logp: torch.Tensor, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """d loss / d logits [C, V] in the logits' dtype (module docstring)."""
    z = logits.float() / temperature
    p = (z - lse.unsqueeze(-1)).exp()
    coef = g_logp.unsqueeze(-1)
    if g_ent is not None:
        coef = coef + g_ent.unsqueeze(-1) * (z - mu.unsqueeze(-1))
    cols = torch.arange(logits.shape[-1], device=logits.device)
    onehot = torch.where(cols == targets.unsqueeze(-1), g_logp.unsqueeze(-1), 0.0)
    return ((onehot - p * coef) / temperature).to(logits.dtype)


def _fn(name: str, device: torch.device):
    fn = _row_stats if name == "stats" else _row_grad
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                with_entropy: bool, entropy_grad: bool, keep_logits: bool):
        logits = F.linear(hidden, weight.to(hidden.dtype))                       # [C, V]
        logp, lse, mu = _fn("stats", hidden.device)(logits, targets, temperature, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, mu, logits if keep_logits else None)
        ctx.temperature = temperature
        ent = lse - mu if with_entropy else torch.zeros_like(logp)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, targets, lse, mu, logits = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        w = weight.to(hidden.dtype)
        if logits is None:
            logits = F.linear(hidden, w)
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        grad = _fn("grad", hidden.device)(logits, targets, lse, mu, g_logp.float(),
                                          None if g_ent is None else g_ent.float(), ctx.temperature)
        del logits
        gh = grad @ w if ctx.needs_input_grad[0] else None
        gw = (grad.t() @ hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None


def head_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                              temperature: float = 1.0, chunk_size: int = -1, with_entropy: bool = False,
                              entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H], weight [V, H] (the output embedding), targets [N] -> (log-probs [N] fp32, entropy [N] fp32
    or None); ``chunk_size`` rows at a time (-1: all at once). Same values and gradients as
    ``logprobs.logprobs_and_entropy`` without a vocabulary shard."""
    n = hidden.shape[0]
    if chunk_size == -1:
        chunk_size = max(1, n)
    if n == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    keep = chunk_size >= n
    lps, ents = [], []
    for start in range(0, n, chunk_size):
        lp, ent = _HeadLogProbs.apply(hidden[start:start + chunk_size], weight, targets[start:start + chunk_size],
                                      float(temperature), with_entropy, entropy_grad, keep)
        lps.append(lp)
        ents.append(ent)
    lp = lps[0] if len(lps) == 1 else torch.cat(lps)
    if not with_entropy:
        return lp, None
    return lp, ents[0] if len(ents) == 1 else torch.cat(ents)
