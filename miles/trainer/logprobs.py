"""Log-probs and entropy of response tokens under the rollout temperature, chunked over tokens.

Only the hidden states of positions that predict a response token are projected to the
vocabulary, ``chunk_size`` tokens at a time; with gradients on, each chunk runs under
activation checkpointing, so at most one chunk of ``[chunk, vocab]`` float32 logits (plus its
gradient) exists at any moment, forward or backward. Logits are divided by the temperature and
upcast to float32 before the log-softmax, matching how the engine sampled the tokens.

    log p_t = z_t[y_t] / T - logsumexp(z_t / T),   H_t = logsumexp(z_t / T) - sum_v softmax(z_t / T)_v z_tv / T
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    lm_head: nn.Module, temperature: float, with_entropy: bool, entropy_grad: bool,
    hidden: torch.Tensor, targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [C, H], targets [C] -> (log-probs [C] fp32, entropy [C] fp32, zeros if not asked)."""
    logits = lm_head(hidden).float()                              # [C, V]
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)                         # [C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


def logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H] (the states that predict ``targets``), targets [N] -> (log-probs [N], entropy [N] or None)."""
    if chunk_size <= 0:
        raise ValueError(f"--log-probs-chunk-size must be positive, got {chunk_size}.")
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, lm_head, temperature, with_entropy, entropy_grad, h, t,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(lm_head, temperature, with_entropy, entropy_grad, h, t)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Unchunked reference: logits [N, V], targets [N] -> [N] (for tests and debugging)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
