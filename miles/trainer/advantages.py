"""Advantage and return estimators: pure tensor functions plus one dispatcher.

Every per-sample tensor is 1-D over that sample's response tokens (length ``R_i``); a batch is a
list of them. Rewards arrive raw (one float per sample, straight from the reward function); the
group normalisation Miles does in its rollout manager happens here, in ``normalize_rewards``,
because the caller keeps whole groups on one trainer rank.

Estimators (``--advantage-estimator``), with ``r`` the (normalised) sequence reward, ``kl_t`` the
per-token KL to the reference (``--kl-loss-type`` estimator of log pi_old - log pi_ref) and ``m_t``
the loss mask:

- ``grpo`` / ``gspo``: ``A_t = R_t = r`` for every token (GSPO differs only in the loss).
- ``reinforce_plus_plus``: token rewards ``-kl_coef * kl_t`` plus ``r`` at the last trainable token,
  ``A_t = R_t = sum_{k>=t} gamma^(k-t) r_k``.
- ``reinforce_plus_plus_baseline``: ``A_t = R_t = r - kl_coef * kl_t`` (``r`` has its group mean removed).
- ``ppo``: GAE over the trainable tokens only (masked tokens are not MDP steps), token rewards
  ``-kl_coef * kl_t`` plus ``r`` at the last trainable token, bootstrap 0 after the end;
  ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lambda A_{t+1}``, ``R_t = A_t + V_t``;
  masked positions get ``A = R = 0``.

Then, in this order: OPD (``A_t -= opd_kl_coef * (log pi_old - log pi_teacher)``) and
``--normalize-advantages`` (masked whitening over the trainer group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.trainer.losses import approx_kl

GROUP_BASELINE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
STD_NORMALIZED_ESTIMATORS = ("grpo", "gspo")


def normalize_rewards(
    rewards: torch.Tensor,
    group_ids: Sequence[int],
    *,
    estimator: str,
    disable_std_normalization: bool = False,
    disable_rewards_normalization: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-wise reward normalisation as Miles does it.

    rewards: [n] float; group_ids: n ints (samples of one prompt share an id).
    grpo/gspo: ``(r - mean_g) / (std_g + eps)`` (std unbiased; a group of one has std 0);
    reinforce_plus_plus_baseline: ``r - mean_g``; ppo/reinforce_plus_plus: unchanged.
    ``disable_std_normalization`` drops the division (Dr.GRPO); ``disable_rewards_normalization``
    returns the raw rewards. Returns [n] float32.
    """
    rewards = rewards.to(torch.float32)
    if disable_rewards_normalization or estimator not in GROUP_BASELINE_ESTIMATORS:
        return rewards.clone()
    out = torch.empty_like(rewards)
    ids = torch.as_tensor(list(group_ids), dtype=torch.long)
    for g in torch.unique(ids).tolist():
        idx = (ids == g).nonzero(as_tuple=True)[0]
        r = rewards[idx]                                   # [n_g]
        centered = r - r.mean()
        if estimator in STD_NORMALIZED_ESTIMATORS and not disable_std_normalization:
            std = r.std(unbiased=True) if r.numel() > 1 else r.new_zeros(())
            centered = centered / (std + eps)
        out[idx] = centered
    return out


def grpo_returns(rewards: torch.Tensor, response_lengths: Sequence[int]) -> list[torch.Tensor]:
    """rewards: [n] -> list of [R_i] filled with r_i (advantages == returns)."""
    return [torch.full((n,), float(r), dtype=torch.float32) for r, n in zip(rewards.tolist(), response_lengths)]


def _last_trainable_index(mask: torch.Tensor) -> int:
    nz = mask.nonzero(as_tuple=True)[0]
    return int(nz[-1]) if nz.numel() else mask.numel() - 1


def _discounted_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """x: [B, T] -> y with y[:, t] = sum_{k>=t} discount^(k-t) x[:, k] (a loop over T, vectorised over B)."""
    y = torch.empty_like(x)
    running = torch.zeros(x.shape[0], dtype=x.dtype)
    for t in range(x.shape[1] - 1, -1, -1):
        running = x[:, t] + discount * running
        y[:, t] = running
    return y


def _pad(seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    """list of [L_i] -> [B, max L] float32, zero padded on the right."""
    out = torch.zeros(len(seqs), max((s.numel() for s in seqs), default=0), dtype=torch.float32)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s.to(torch.float32)
    return out


def reinforce_plus_plus_returns(
    rewards: torch.Tensor, kl: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], kl_coef: float, gamma: float,
) -> list[torch.Tensor]:
    """REINFORCE++ discounted returns. rewards [n]; kl[i], loss_masks[i]: [R_i] -> list of [R_i].

    Token rewards are ``-kl_coef * kl_t`` plus the sequence reward at the last trainable token;
    the return sums them discounted by gamma over all later tokens (right padding adds zeros).
    """
    if not kl:
        return []
    token_rewards = -kl_coef * _pad(kl)                               # [B, T]
    for i, (r, m) in enumerate(zip(rewards.tolist(), loss_masks)):
        token_rewards[i, _last_trainable_index(m)] += r
    returns = _discounted_cumsum(token_rewards, gamma)                # [B, T]
    return [returns[i, : k.numel()].clone() for i, k in enumerate(kl)]


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, kl: Sequence[torch.Tensor], kl_coef: float,
) -> list[torch.Tensor]:
    """rewards [n] (group mean already removed); kl[i]: [R_i] -> ``r_i - kl_coef * kl_i`` per token."""
    return [float(r) - kl_coef * k.to(torch.float32) for r, k in zip(rewards.tolist(), kl)]


def gae_advantages_and_returns(
    values: Sequence[torch.Tensor],
    token_rewards: Sequence[torch.Tensor],
    terminal_rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over each sample's trainable tokens (loss_mask == 1).

    values[i], token_rewards[i], loss_masks[i]: [R_i]; terminal_rewards: [n] (added to the last
    trainable token). Returns (advantages, returns), each a list of [R_i], zero where masked.
    """
    idxs = [m.nonzero(as_tuple=True)[0] for m in loss_masks]         # trainable positions per sample
    vals = _pad([v.to(torch.float32)[i] for v, i in zip(values, idxs)])           # [B, K]
    rews = _pad([r.to(torch.float32)[i] for r, i in zip(token_rewards, idxs)])    # [B, K]
    lengths = torch.tensor([i.numel() for i in idxs], dtype=torch.long)
    for b, (term, k) in enumerate(zip(terminal_rewards.tolist(), lengths.tolist())):
        if k:
            rews[b, k - 1] += term
    # V_{t+1}, zero after each sample's last trainable token (padding is zero already)
    next_vals = torch.cat([vals[:, 1:], vals.new_zeros(vals.shape[0], 1)], dim=1)
    deltas = rews + gamma * next_vals - vals                          # [B, K]; zero on padding
    adv = _discounted_cumsum(deltas, gamma * lambd)                   # [B, K]
    ret = adv + vals
    advs, rets = [], []
    for b, (v, i) in enumerate(zip(values, idxs)):
        a_full = torch.zeros(v.numel(), dtype=torch.float32)
        r_full = torch.zeros(v.numel(), dtype=torch.float32)
        a_full[i] = adv[b, : i.numel()]
        r_full[i] = ret[b, : i.numel()]
        advs.append(a_full)
        rets.append(r_full)
    return advs, rets


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None, eps: float = 1e-8,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Whiten x [N] with the mean and (unbiased) variance of the entries where mask [N] is 1,
    the statistics summed over ``group`` when given (every rank must call, also with no tokens;
    ``device`` is where the group's collectives run)."""
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    stats = torch.stack([(xd * m).sum(), (xd * xd * m).sum(), m.sum()])
    if group is not None and dist.get_world_size(group) > 1:
        stats = stats.to(device or torch.device("cpu"))
        dist.all_reduce(stats, group=group)
    s, ss, n = stats.cpu().tolist()
    if n == 0:
        return x.clone()
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    if n > 1:
        var = var * n / (n - 1)
    return ((xd - mean) / (var + eps) ** 0.5).to(x.dtype)


def apply_opd(
    advantages: Sequence[torch.Tensor],
    student_log_probs: Sequence[torch.Tensor],
    teacher_log_probs: Sequence[torch.Tensor],
    coef: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On-policy distillation: ``A_t - coef * (log pi_student - log pi_teacher)``; all [R_i].
    Returns (new advantages, per-token reverse KL)."""
    new_adv, rkl = [], []
    for i, (a, s, t) in enumerate(zip(advantages, student_log_probs, teacher_log_probs)):
        if s.shape != t.shape or a.shape != s.shape:
            raise ValueError(f"OPD: sample {i} has teacher log-probs of shape {tuple(t.shape)} but the response has "
                             f"{tuple(s.shape)} tokens; teacher log-probs must cover exactly the response tokens.")
        k = s.to(torch.float32) - t.to(torch.float32)
        new_adv.append(a - coef * k)
        rkl.append(k)
    return new_adv, rkl


@dataclass
class AdvantageInputs:
    """Per-sample inputs, all on CPU; lists of [R_i] tensors except ``rewards`` [n]."""

    rewards: torch.Tensor
    group_ids: list[int]
    loss_masks: list[torch.Tensor]
    log_probs: list[torch.Tensor] | None = None          # policy the samples came from (old or rollout)
    ref_log_probs: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    teacher_log_probs: list[torch.Tensor] | None = None
    opd_reverse_kl: list[torch.Tensor] | None = None     # top-k OPD: the per-token estimate, used as is


def compute_advantages_and_returns(
    algo, inp: AdvantageInputs, group: dist.ProcessGroup | None = None, device: torch.device | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Dispatch on ``algo.advantage_estimator`` (an AlgoConfig). Returns (advantages, returns,
    per-token extras such as the reward-shaping KL and the OPD reverse KL, for metrics)."""
    lengths = [m.numel() for m in inp.loss_masks]
    rewards = normalize_rewards(
        inp.rewards, inp.group_ids, estimator=algo.advantage_estimator,
        disable_std_normalization=not algo.grpo_std_normalization,
        disable_rewards_normalization=not algo.rewards_normalization)
    if algo.kl_coef != 0:
        if inp.log_probs is None or inp.ref_log_probs is None:
            raise ValueError("--kl-coef needs log-probs of the policy and of the reference model.")
        kl = [approx_kl(lp, rlp, algo.kl_loss_type) for lp, rlp in zip(inp.log_probs, inp.ref_log_probs)]
    else:
        kl = [torch.zeros(n, dtype=torch.float32) for n in lengths]
    extras: dict[str, list[torch.Tensor]] = {"reward_kl": kl}

    est = algo.advantage_estimator
    if est in ("grpo", "gspo"):
        returns = grpo_returns(rewards, lengths)
        advantages = [r.clone() for r in returns]
    elif est == "reinforce_plus_plus":
        returns = reinforce_plus_plus_returns(rewards, kl, inp.loss_masks, algo.kl_coef, algo.gamma)
        advantages = [r.clone() for r in returns]
    elif est == "reinforce_plus_plus_baseline":
        advantages = reinforce_plus_plus_baseline_advantages(rewards, kl, algo.kl_coef)
        returns = [a.clone() for a in advantages]
    elif est == "ppo":
        if inp.values is None:
            raise ValueError("--advantage-estimator ppo needs critic values.")
        token_rewards = [-algo.kl_coef * k for k in kl]
        advantages, returns = gae_advantages_and_returns(
            inp.values, token_rewards, rewards, inp.loss_masks, algo.gamma, algo.lambd)
    else:
        raise ValueError(f"--advantage-estimator {est!r} is not supported; choose one of grpo, gspo, "
                         "reinforce_plus_plus, reinforce_plus_plus_baseline, ppo.")

    if algo.use_opd and inp.opd_reverse_kl is not None:  # --opd-log-prob-top-k: A_t -= coef * rkl_t
        if any(a.shape != k.shape for a, k in zip(advantages, inp.opd_reverse_kl)):
            raise ValueError("OPD: a sample's top-k reverse KL does not cover exactly its response tokens.")
        extras["opd_reverse_kl"] = [k.to(torch.float32) for k in inp.opd_reverse_kl]
        advantages = [a - algo.opd_kl_coef * k for a, k in zip(advantages, extras["opd_reverse_kl"])]
    elif algo.use_opd:
        if inp.teacher_log_probs is None or inp.log_probs is None:
            raise ValueError("--use-opd needs teacher log-probs and the policy's log-probs for every sample.")
        advantages, extras["opd_reverse_kl"] = apply_opd(advantages, inp.log_probs, inp.teacher_log_probs,
                                                         algo.opd_kl_coef)

    if algo.normalize_advantages:
        flat = torch.cat(advantages) if advantages else torch.zeros(0)
        mask = torch.cat(inp.loss_masks) if inp.loss_masks else torch.zeros(0)
        flat = masked_whiten(flat, mask, group, device=device)
        advantages = list(torch.split(flat, lengths)) if lengths else []
    return advantages, returns, extras
