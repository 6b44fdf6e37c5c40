"""The loss family: pure tensor functions over the flat response tokens of a micro-batch.

Shapes: ``N`` is the number of response tokens of all samples in the micro-batch, concatenated;
per-sample lists give each sample's ``R_i`` (sum R_i = N). Log-probs are float32.

- ``approx_kl``: Schulman's estimators of KL(pi || pi_base) from sampled tokens, with
  ``log_r = log pi - log pi_base``: k1 ``log_r``; k2 ``log_r^2 / 2``; k3 ``exp(-log_r) - 1 + log_r``;
  low_var_kl is k3 with ``log_r`` clamped to [-20, 20] and the result clamped to [-10, 10].
- ``ppo_clip_loss``: ``ratio = exp(log pi - log pi_old)``,
  ``L = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps_high))``; with dual clip (``eps_c > 1``),
  ``L = min(L, -eps_c A)`` where ``A < 0``.
- ``gspo_log_ratio``: GSPO's sequence ratio, ``log s_i = mean_t m_t (log pi - log pi_old)`` over each
  sample's trainable tokens, broadcast back to its tokens (the same clip is then applied to it).
- ``tis_weights``: ``w = clamp(exp(log pi_old - log pi_rollout), tis_clip_low, tis_clip)`` (no grad).
- ``value_loss``: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.
- ``Reducer``: token-mean (``--calculate-per-token-loss``: ``sum_t m_t x_t / total trainable tokens``)
  or sample-mean (default: ``sum_i mean_{t in i} m_t x_t / number of samples``), with the
  denominators of the WHOLE optimizer step over all trainer ranks, so micro-batches and ranks add up.
- ``policy_loss``: PPO/GSPO policy loss + entropy bonus + KL loss + TIS, returning the scalar and metrics.
- ``CustomLossFn``: the signature ``--custom-loss-function-path`` must have (see its docstring).
- ``CustomTisFn`` / ``policy_loss_with_tis``: ``--custom-tis-function-path`` replaces the TIS step of
  ``policy_loss`` (Miles's call: per-sample lists in, ``(pg_loss, loss_masks, metrics)`` out; the returned
  masks restrict the numerators of every reduction after it, the denominators stay the step's).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from miles.utils.imports import load_function

_LOG_RATIO_CLAMP = 20.0


def approx_kl(log_probs: torch.Tensor, base_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """[N], [N] -> [N] float32 per-token KL estimate of KL(pi || pi_base)."""
    log_ratio = log_probs.float() - base_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.pow(2) / 2.0
    if kl_type in ("k3", "low_var_kl"):
        neg = -log_ratio
        if kl_type == "low_var_kl":
            neg = neg.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kl = neg.exp() - 1.0 - neg
        return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(f"--kl-loss-type {kl_type!r} is not known; choose one of k1, k2, k3, low_var_kl.")


def ppo_clip_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_ratio = log pi - log pi_old [N]; advantages [N] -> (per-token loss [N], clipped [N] in {0,1})."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1.0 (dual-clip constant), got {eps_clip_c}.")
        loss3 = -advantages * eps_clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
    return loss, clipped


def gspo_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor, lengths: Sequence[int],
) -> torch.Tensor:
    """[N] x3, per-sample lengths -> [N]: each token carries its sample's masked mean log-ratio."""
    out = []
    for lp, olp, m in zip(log_probs.split(list(lengths)), old_log_probs.split(list(lengths)),
                          loss_mask.split(list(lengths))):
        seq = ((lp - olp) * m).sum() / m.sum().clamp_min(1.0)
        out.append(seq.expand(lp.shape[0]))
    return torch.cat(out) if out else log_probs.new_zeros(0)


def tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N], [N] -> (weights [N] detached, clipped [N] in {0,1})."""
    w = (old_log_probs.detach().float() - rollout_log_probs.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    wc = w.clamp(clip_low, clip_high)
    return wc, (wc != w).float()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] x3 -> (per-token clipped value loss [N], clipped [N] in {0,1})."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    l1 = (values - returns).pow(2)
    l2 = (clipped_values - returns).pow(2)
    return 0.5 * torch.maximum(l1, l2), (l2 > l1).float()


class Reducer:
    """Reduce a per-token tensor [N] to this micro-batch's share of the step mean.

    per_token: ``sum(x * m) / num_step_tokens``; otherwise ``sum_i sum_t(x m)_i / max(sum m_i, 1) / num_step_samples``.
    The denominators are the totals of the optimizer step over all trainer ranks, so summing the
    reduced values of every micro-batch on every rank gives the step mean.
    """

    def __init__(self, loss_mask: torch.Tensor, lengths: Sequence[int], per_token: bool,
                 num_step_tokens: float, num_step_samples: float):
        self.mask = loss_mask.float()
        self.lengths = list(lengths)
        self.per_token = per_token
        if per_token:
            self.weights = self.mask / max(num_step_tokens, 1.0)
        else:
            per_sample = [m.sum().clamp_min(1.0) for m in self.mask.split(self.lengths)]
            denom = torch.cat([d.expand(n) for d, n in zip(per_sample, self.lengths)]) if self.lengths else self.mask
            self.weights = self.mask / denom / max(num_step_samples, 1.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weights.to(x.device)).sum()

    def masked(self, mask: torch.Tensor) -> Reducer:
        """The same denominators, numerators restricted to ``mask`` [N] (rejection sampling drops tokens
        from the sums without changing the step's token or sample counts, as Miles does)."""
        out = copy.copy(self)
        out.weights = self.weights * mask.float().to(self.weights.device)
        return out


@dataclass
class LossInputs:
    """What a loss function sees for one micro-batch (all [N] on the trainer's device)."""

    log_probs: torch.Tensor                         # current policy, with grad
    loss_mask: torch.Tensor
    lengths: list[int]                              # response lengths of the samples, sum = N
    total_lengths: list[int] | None = None          # prompt + response tokens of each sample
    old_log_probs: torch.Tensor | None = None       # denominator of the ratio (old or rollout)
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    entropy: torch.Tensor | None = None             # with grad iff --entropy-coef != 0
    rewards: torch.Tensor | None = None             # [n] raw sequence rewards
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def dummy_micro_batch_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    """A zero loss over the graph of a padding micro-batch, so its backward reaches every parameter (and
    every collective of the backward runs) without changing a gradient."""
    return log_probs.sum() * 0.0 + (entropy.sum() * 0.0 if (entropy is not None and entropy.requires_grad) else 0.0)


def cat_per_sample(per_sample: dict, key: str, sample_ids: Sequence[int],
                   device: torch.device) -> torch.Tensor | None:
    """The per-sample tensors ``per_sample[key]`` of ``sample_ids`` joined into one [N] (None when absent)."""
    lst = per_sample.get(key)
    return None if lst is None else torch.cat([lst[i] for i in sample_ids]).to(device)


def micro_batch_loss(loss_fn: Callable, algo, mb, dmb, log_probs: torch.Tensor, entropy: torch.Tensor | None,
                     per_sample: dict, samples: Sequence, num_step_tokens: float, num_step_samples: float,
                     device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor], Reducer]:
    """One (non-dummy) micro-batch's loss as every backend composes it: the ``Reducer`` over the step's totals,
    the ``LossInputs`` from the step's per-sample tensors (``old`` falls back to the detached current log-probs)
    and ``loss_fn``. ``mb``/``dmb`` are the micro-batch on the host and on ``device``. Returns (loss, metrics,
    reducer)."""
    ids = mb.sample_ids
    reduce = Reducer(dmb.loss_mask, mb.lengths, algo.calculate_per_token_loss, num_step_tokens, num_step_samples)
    old = cat_per_sample(per_sample, "old", ids, device)
    inp = LossInputs(
        log_probs=log_probs, loss_mask=dmb.loss_mask, lengths=mb.lengths,
        total_lengths=mb.cu_seqlens.diff().tolist(),
        old_log_probs=old if old is not None else log_probs.detach(),
        rollout_log_probs=cat_per_sample(per_sample, "rollout", ids, device),
        ref_log_probs=cat_per_sample(per_sample, "ref", ids, device),
        advantages=cat_per_sample(per_sample, "adv", ids, device),
        returns=cat_per_sample(per_sample, "ret", ids, device), entropy=entropy,
        rewards=(torch.tensor([float(samples[i].reward) for i in ids], device=device)
                 if samples[ids[0]].reward is not None else None))
    loss, metrics = loss_fn(algo, inp, reduce)
    return loss, metrics, reduce


def accumulate_metrics(acc: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's metrics into ``acc`` as float64 on their device (no host sync per micro-batch)."""
    for k, v in metrics.items():
        v = v.detach().to(torch.float64)
        acc[k] = acc[k] + v if k in acc else v


def policy_loss(algo, inp: LossInputs, reduce: Reducer, tis: Callable | None = None,
                tis_args: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO-family policy loss (``--loss-type policy_loss``). Returns (scalar, metrics of detached scalars).
    ``tis``: a ``--custom-tis-function-path`` function run instead of the built-in TIS (``tis_args`` its args)."""
    assert inp.old_log_probs is not None and inp.advantages is not None
    mask = inp.loss_mask
    adv = torch.where(mask > 0, torch.nan_to_num(inp.advantages, 0.0, 0.0, 0.0), torch.zeros_like(inp.advantages))
    if algo.advantage_estimator == "gspo":
        log_ratio = gspo_log_ratio(inp.log_probs, inp.old_log_probs, mask, inp.lengths)
    else:
        log_ratio = inp.log_probs - inp.old_log_probs
    log_ratio = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    pg, clipped = ppo_clip_loss(log_ratio, adv, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c)
    metrics: dict[str, torch.Tensor] = {}
    if algo.use_tis and inp.rollout_log_probs is None:
        raise ValueError("--use-tis needs rollout_log_probs on every sample (the engine's log-probs).")
    if algo.use_tis and tis is not None:
        pg, reduce_after, tis_metrics = run_custom_tis(tis, tis_args, pg, inp, reduce)
        metrics.update({k: reduce(v).detach() for k, v in tis_metrics.items()})  # over the tokens before RS
        reduce = reduce_after
    elif algo.use_tis:
        w, tis_clipped = tis_weights(inp.old_log_probs, inp.rollout_log_probs, algo.tis_clip_low, algo.tis_clip)
        pg = pg * w
        metrics["tis"] = reduce(w).detach()
        metrics["tis_clipfrac"] = reduce(tis_clipped).detach()
    pg_loss = reduce(pg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = reduce(clipped).detach()
    metrics["ppo_kl"] = reduce(-log_ratio).detach()          # approx KL(old || new), k1
    if inp.entropy is not None:
        ent = reduce(inp.entropy)
        metrics["entropy"] = ent.detach()
        if algo.entropy_coef != 0:
            loss = loss - algo.entropy_coef * ent
    if algo.use_kl_loss:
        if inp.ref_log_probs is None:
            raise ValueError("--use-kl-loss needs reference log-probs.")
        kl = approx_kl(inp.log_probs, inp.ref_log_probs, algo.kl_loss_type)
        kl = torch.where(mask > 0, torch.nan_to_num(kl, 0.0, 0.0, 0.0), torch.zeros_like(kl))
        kl_loss = reduce(kl)
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + algo.kl_loss_coef * kl_loss
    if inp.rollout_log_probs is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce((inp.old_log_probs - inp.rollout_log_probs).abs()).detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def sft_loss(algo, inp: LossInputs, reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the response tokens where loss_mask is 1 (``--loss-type sft_loss``)."""
    loss = reduce(-inp.log_probs)
    metrics = {"loss": loss.detach(), "sft_loss": loss.detach()}
    if inp.entropy is not None:
        metrics["entropy"] = reduce(inp.entropy).detach()
    return loss, metrics


class CustomLossFn(Protocol):
    """Signature for ``--custom-loss-function-path module.function``::

        def my_loss(inputs: LossInputs, algo: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]]

    Return a PER-TOKEN loss of shape [N] (same as ``inputs.log_probs``, differentiable through it)
    and per-token metric tensors of shape [N]; the trainer reduces both with the configured
    token/sample mean (``--calculate-per-token-loss``) over the whole step and all ranks, so
    micro-batching and data parallelism do not change the result.
    """

    def __call__(self, inputs: LossInputs, algo) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def load_custom_loss(path: str) -> CustomLossFn:
    """Import ``module.function`` for --custom-loss-function-path, failing clearly."""
    return load_function(path, "--custom-loss-function-path")


def custom_loss(fn: CustomLossFn) -> Callable:
    def run(algo, inp: LossInputs, reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        per_token, per_token_metrics = fn(inp, algo)
        if per_token.shape != inp.log_probs.shape:
            raise ValueError(f"--custom-loss-function-path must return a per-token loss of shape "
                             f"{tuple(inp.log_probs.shape)}, got {tuple(per_token.shape)}.")
        loss = reduce(per_token)
        metrics = {k: reduce(v.float()).detach() for k, v in per_token_metrics.items()}
        metrics["loss"] = loss.detach()
        return loss, metrics
    return run


CUSTOM_TIS_FORM = ("def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs) -> "
                   "(pg_loss, loss_masks, metrics)")
_TIS_KEYWORDS = ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks")
_TIS_PASSED = (*_TIS_KEYWORDS, "total_lengths", "response_lengths", "max_seq_lens")  # what run_custom_tis passes


class CustomTisFn(Protocol):
    """Signature for ``--custom-tis-function-path module.function`` (Miles's)::

        def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)
            -> tuple[Tensor, list[Tensor], dict[str, Tensor]]

    ``args``: the flags (train and algo sections) plus the ``--custom-config-path`` keys that name no flag;
    ``pg_loss`` [N] the per-token clipped policy loss; ``train_log_probs`` / ``rollout_log_probs`` /
    ``loss_masks``: one [R_i] tensor per sample (the trainer's old log-probs, the engine's, the masks);
    ``kwargs``: ``total_lengths`` (prompt + response tokens of each sample), ``response_lengths`` (list of R_i)
    and ``max_seq_lens`` (None: rows are packed, ``thd``), as Miles passes them. Returns the weighted ``pg_loss``
    [N], the loss masks (changed by rejection sampling, else as given) and per-token metrics [N] (reduced over the
    masks given, before rejection). Called when ``--use-tis`` is on, instead of the built-in truncation.
    """

    def __call__(self, args: Any, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                 rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor],
                 **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]: ...


def check_tis_signature(fn: Callable[..., Any], path: str) -> None:
    """ValueError unless ``fn`` can be called as Miles calls a custom TIS function."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    missing = [k for k in _TIS_KEYWORDS if k not in named and not var_kw]
    required_kw = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty
                   and p.name not in _TIS_PASSED]
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params) or missing or required_kw:
        why = (f"it does not take {', '.join(missing)}" if missing else
               f"it requires {', '.join(required_kw)}, which is not passed" if required_kw else "it takes no args")
        raise ValueError(f"--custom-tis-function-path {path!r} cannot be called as {CUSTOM_TIS_FORM}: {why}.")


def load_tis_function(path: str) -> CustomTisFn:
    """Import and check ``--custom-tis-function-path module.function``."""
    fn = load_function(path, "--custom-tis-function-path")
    check_tis_signature(fn, path)
    return fn


def run_custom_tis(fn: CustomTisFn, args: Any, pg: torch.Tensor, inp: LossInputs,
                   reduce: Reducer) -> tuple[torch.Tensor, Reducer, dict[str, torch.Tensor]]:
    """(weighted pg [N], the reducer for what follows, per-token metrics [N]) of one custom TIS call."""
    lengths = list(inp.lengths)
    out = fn(args, pg_loss=pg, train_log_probs=list(inp.old_log_probs.detach().split(lengths)),
             rollout_log_probs=list(inp.rollout_log_probs.split(lengths)), loss_masks=list(inp.loss_mask.split(lengths)),
             total_lengths=inp.total_lengths, response_lengths=lengths, max_seq_lens=None)
    if not (isinstance(out, tuple | list) and len(out) == 3):
        raise ValueError(f"--custom-tis-function-path must return {CUSTOM_TIS_FORM.split('-> ')[1]}, got "
                         f"{type(out).__name__}.")
    new_pg, masks, metrics = out
    if not isinstance(new_pg, torch.Tensor) or new_pg.shape != pg.shape:
        raise ValueError(f"--custom-tis-function-path must return pg_loss of shape {tuple(pg.shape)}, got "
                         f"{getattr(new_pg, 'shape', type(new_pg).__name__)}.")
    if len(masks) != len(lengths) or any(int(m.numel()) != n for m, n in zip(masks, lengths)):
        raise ValueError(f"--custom-tis-function-path must return one loss mask per sample with lengths {lengths}.")
    mask = torch.cat([m.reshape(-1) for m in masks]) if masks else inp.loss_mask
    per_token = {k: (v.float() if v.shape == pg.shape else v.float().mean().expand_as(pg)) for k, v in metrics.items()}
    return new_pg, reduce.masked(mask), per_token


def policy_loss_with_tis(fn: CustomTisFn, args: Any) -> Callable:
    """``policy_loss`` whose TIS step is ``fn`` (called with ``args``), as the trainer's loss function."""
    def run(algo, inp: LossInputs, reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(algo, inp, reduce, tis=fn, tis_args=args)
    return run
