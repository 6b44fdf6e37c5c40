"""Log-probs and entropy of response tokens under the rollout temperature, chunked over tokens.

Only the hidden states of positions that predict a response token are projected to the
vocabulary, ``chunk_size`` tokens at a time; with gradients on, each chunk runs under
activation checkpointing, so at most one chunk of ``[chunk, vocab]`` float32 logits (plus its
gradient) exists at any moment, forward or backward. Logits are divided by the temperature and
upcast to float32 before the log-softmax, matching how the engine sampled the tokens. A model with final logit
softcapping (Gemma 2/3/4's ``final_logit_softcapping`` c) has its logits capped first, ``c * tanh(z / c)``, as its
HF forward caps them (elementwise: a vocabulary shard caps its own columns).

    log p_t = z_t[y_t] / T - logsumexp(z_t / T),   H_t = logsumexp(z_t / T) - sum_v softmax(z_t / T)_v z_tv / T

Vocabulary-parallel (``vocab_shard``, tensor parallelism): ``lm_head`` returns this rank's columns
``[start, start + V/tp)`` only; padding columns (``>= vocab_size``) are excluded; the max, the sum of
exponentials, the target logit and ``sum_v p_v z_v`` are all-reduced over the shard's group, with an
identity backward (every rank of the group computes the same loss and owns the gradient of its columns).
No rank ever holds the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class VocabShard:
    """This rank's vocabulary columns ``[start, start + width)`` of a vocabulary split over ``group``;
    the real vocabulary is ``[0, vocab_size)`` (columns beyond it are padding)."""

    group: dist.ProcessGroup
    start: int
    vocab_size: int


class _SumIdentityBackward(torch.autograd.Function):
    """All-reduce (sum) over a group in the forward, identity in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sharded_lse_and_target(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard):
    """logits [C, V/tp] (this rank's columns) -> (masked logits, lse [C], target logit [C]), all-reduced."""
    width = logits.shape[-1]
    valid = shard.vocab_size - shard.start
    if valid < width:                         # padding columns never take probability mass
        pad = torch.arange(width, device=logits.device) >= valid
        logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    m = logits.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.group)
    sum_exp = _SumIdentityBackward.apply((logits - m.unsqueeze(-1)).exp().sum(-1), shard.group)
    lse = m + sum_exp.log()
    local = targets - shard.start
    mine = (local >= 0) & (local < width)
    z = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    z = _SumIdentityBackward.apply(torch.where(mine, z, torch.zeros_like(z)), shard.group)
    return logits, lse, z


def _chunk_logprobs(
    lm_head: nn.Module, temperature: float, with_entropy: bool, entropy_grad: bool,
    hidden: torch.Tensor, targets: torch.Tensor, shard: VocabShard | None = None, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [C, H], targets [C] -> (log-probs [C] fp32, entropy [C] fp32, zeros if not asked)."""
    logits = lm_head(hidden).float()                              # [C, V] (or [C, V/tp] with a shard)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    if shard is not None:
        logits, lse, z = _sharded_lse_and_target(logits, targets, shard)
        logp = z - lse
        if not with_entropy:
            return logp, torch.zeros_like(logp)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = (logits - lse.unsqueeze(-1)).exp()
            entropy = lse - _SumIdentityBackward.apply((probs * logits).sum(-1), shard.group)
        return logp, entropy
    lse = torch.logsumexp(logits, dim=-1)                         # [C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


class _LinearHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))


def logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    vocab_shard: VocabShard | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H] (the states that predict ``targets``), targets [N] -> (log-probs [N], entropy [N] or None).
    ``lm_head``: a module or function hidden -> logits, or the output weight [V, H] itself. With ``vocab_shard``,
    it gives this rank's vocabulary columns (module docstring). On a GPU without a shard, a bias-free linear head
    (or a weight) takes ``fused_logprobs`` (same values, no fp32 [N, V] autograd graph) unless ``softcap`` (the
    final logit softcapping c > 0; 0: none) is set."""
    if chunk_size == -1:  # Miles's default: no chunking, the whole micro-batch at once
        chunk_size = max(1, hidden.shape[0])
    if chunk_size <= 0:
        raise ValueError(f"--log-probs-chunk-size must be positive or -1 (no chunking), got {chunk_size}.")
    weight = lm_head if isinstance(lm_head, torch.Tensor) else getattr(lm_head, "weight", None)
    plain_head = isinstance(lm_head, torch.Tensor) or (isinstance(lm_head, nn.Linear) and lm_head.bias is None)
    if plain_head and vocab_shard is None and hidden.is_cuda and not softcap:   # fused_logprobs.py: no fp32 [N, V] autograd graph
        from miles.trainer.fused_logprobs import head_logprobs_and_entropy

        return head_logprobs_and_entropy(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size,
                                         with_entropy=with_entropy, entropy_grad=entropy_grad)
    if isinstance(lm_head, torch.Tensor):                        # a weight [V, H] given as the head
        lm_head = _LinearHead(lm_head)
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, lm_head, temperature, with_entropy, entropy_grad, h, t,
                                 vocab_shard, softcap, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(lm_head, temperature, with_entropy, entropy_grad, h, t, vocab_shard, softcap)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Unchunked reference: logits [N, V], targets [N] -> [N] (for tests and debugging)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
