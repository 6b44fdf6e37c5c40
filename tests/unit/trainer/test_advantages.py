"""Advantage estimators against written-out, loop-by-loop reference computations."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles.trainer import advantages as A


def algo(**kw):
    base = dict(advantage_estimator="grpo", kl_coef=0.0, kl_loss_type="k1", gamma=1.0, lambd=1.0,
                normalize_advantages=False, grpo_std_normalization=True, rewards_normalization=True,
                use_opd=False, opd_kl_coef=1.0)
    base.update(kw)
    return SimpleNamespace(**base)


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_group_normalisation_by_group_id():
    rewards = torch.tensor([1.0, 0.0, 1.0, 3.0, 2.0, 5.0])
    gids = [0, 0, 1, 1, 1, 2]                                     # a group of 1 too
    out = A.normalize_rewards(rewards, gids, estimator="grpo")
    g0, g1 = [1.0, 0.0], [1.0, 3.0, 2.0]
    exp = [(x - 0.5) / (_std(g0) + 1e-6) for x in g0] + [(x - 2.0) / (_std(g1) + 1e-6) for x in g1] + [0.0]
    assert out.tolist() == pytest.approx(exp, rel=1e-7)            # fp32 against float64: measured 4.6e-8
    dr = A.normalize_rewards(rewards, gids, estimator="gspo", disable_std_normalization=True)
    assert dr.tolist() == pytest.approx([0.5, -0.5, -1.0, 1.0, 0.0, 0.0])
    rpp = A.normalize_rewards(rewards, gids, estimator="reinforce_plus_plus_baseline")
    assert rpp.tolist() == pytest.approx([0.5, -0.5, -1.0, 1.0, 0.0, 0.0])   # mean only
    for est in ("ppo", "reinforce_plus_plus"):
        assert A.normalize_rewards(rewards, gids, estimator=est).tolist() == rewards.tolist()
    raw = A.normalize_rewards(rewards, gids, estimator="grpo", disable_rewards_normalization=True)
    assert raw.tolist() == rewards.tolist()


def test_grpo_returns_broadcast():
    out = A.grpo_returns(torch.tensor([0.5, -1.0]), [3, 1])
    assert [t.tolist() for t in out] == [[0.5, 0.5, 0.5], [-1.0]]


def test_reinforce_plus_plus_returns_written_out():
    rewards = [1.0, -0.5]
    kl = [torch.tensor([0.1, 0.2, -0.3, 0.4]), torch.tensor([0.05, 0.0])]
    masks = [torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]   # last token masked in sample 0
    kl_coef, gamma = 0.5, 0.9
    out = A.reinforce_plus_plus_returns(torch.tensor(rewards), kl, masks, kl_coef, gamma)
    for r, k, m, got in zip(rewards, kl, masks, out):
        tr = [-kl_coef * float(x) for x in k]
        last = max(i for i, v in enumerate(m.tolist()) if v == 1)
        tr[last] += r
        exp, running = [0.0] * len(tr), 0.0
        for t in reversed(range(len(tr))):
            running = tr[t] + gamma * running
            exp[t] = running
        assert got.tolist() == pytest.approx(exp, rel=2.5e-7)      # fp32 against float64: measured 1.3e-7


def test_reinforce_plus_plus_baseline():
    kl = [torch.tensor([0.2, -0.2]), torch.tensor([1.0])]
    out = A.reinforce_plus_plus_baseline_advantages(torch.tensor([0.5, -0.5]), kl, 0.1)
    assert out[0].tolist() == pytest.approx([0.5 - 0.02, 0.5 + 0.02])
    assert out[1].tolist() == pytest.approx([-0.5 - 0.1])


def _gae_reference(v, tr, term, m, gamma, lambd):
    idx = [i for i, x in enumerate(m) if x == 1]
    vv = [v[i] for i in idx]
    rr = [tr[i] for i in idx]
    if rr:
        rr[-1] += term
    adv, last = [0.0] * len(vv), 0.0
    for t in reversed(range(len(vv))):
        nv = vv[t + 1] if t + 1 < len(vv) else 0.0
        delta = rr[t] + gamma * nv - vv[t]
        last = delta + gamma * lambd * last
        adv[t] = last
    a_full, r_full = [0.0] * len(v), [0.0] * len(v)
    for j, i in enumerate(idx):
        a_full[i] = adv[j]
        r_full[i] = adv[j] + vv[j]
    return a_full, r_full


def test_gae_uneven_lengths_and_masks():
    values = [torch.tensor([0.1, 0.5, -0.2, 0.3, 0.0]), torch.tensor([0.2, 0.4]), torch.tensor([0.7, 0.1, 0.0])]
    token_rewards = [torch.tensor([0.0, -0.1, 0.05, 0.0, 0.02]), torch.tensor([-0.01, 0.0]), torch.zeros(3)]
    masks = [torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.zeros(3)]  # last fully masked
    terminal = torch.tensor([1.0, -1.0, 2.0])
    advs, rets = A.gae_advantages_and_returns(values, token_rewards, terminal, masks, gamma=0.95, lambd=0.9)
    for i in range(3):
        ea, er = _gae_reference(values[i].tolist(), token_rewards[i].tolist(), terminal[i].item(),
                                masks[i].tolist(), 0.95, 0.9)
        # fp32 against the float64 reference: measured 1.4e-7 / 1.5e-7 relative (CPU, 2026-12-07)
        assert advs[i].tolist() == pytest.approx(ea, rel=3e-7, abs=1e-7)
        assert rets[i].tolist() == pytest.approx(er, rel=3e-7, abs=1e-7)
    assert advs[2].tolist() == [0.0, 0.0, 0.0]


def test_gae_gamma_lambda_one_is_return_minus_value():
    v = torch.tensor([0.3, 0.1, 0.4])
    advs, rets = A.gae_advantages_and_returns([v], [torch.zeros(3)], torch.tensor([1.0]), [torch.ones(3)], 1.0, 1.0)
    assert advs[0].tolist() == pytest.approx([1 - 0.3, 1 - 0.1, 1 - 0.4])
    assert rets[0].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 100.0, 3.0, 4.0])
    m = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    out = A.masked_whiten(x, m)
    vals = [1.0, 2.0, 3.0, 4.0]
    mean, std = sum(vals) / 4, _std(vals)
    # fp32 against float64: measured 4.1e-8
    assert out.tolist() == pytest.approx([(v - mean) / math.sqrt(std**2 + 1e-8) for v in x.tolist()], rel=1e-7)
    assert A.masked_whiten(x, torch.zeros(5)).tolist() == x.tolist()


def test_opd_folds_reverse_kl():
    adv = [torch.tensor([1.0, 1.0])]
    new, rkl = A.apply_opd(adv, [torch.tensor([-1.0, -2.0])], [torch.tensor([-1.5, -1.0])], coef=0.5)
    assert rkl[0].tolist() == pytest.approx([0.5, -1.0])
    assert new[0].tolist() == pytest.approx([1.0 - 0.25, 1.0 + 0.5])
    with pytest.raises(ValueError, match="teacher log-probs"):
        A.apply_opd(adv, [torch.zeros(2)], [torch.zeros(3)], 1.0)


def _inputs(**kw):
    base = dict(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_ids=[0, 0, 1, 1],
                loss_masks=[torch.ones(2), torch.ones(3), torch.tensor([1.0, 0.0]), torch.ones(1)])
    base.update(kw)
    return A.AdvantageInputs(**base)


def test_dispatch_grpo_with_kl_shaping_and_whitening():
    lp = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.5, -0.5]), torch.tensor([-1.0, -1.0]), torch.tensor([-3.0])]
    ref = [x - 0.1 for x in lp]
    adv, ret, extras = A.compute_advantages_and_returns(
        algo(kl_coef=0.1, kl_loss_type="k1"), _inputs(log_probs=lp, ref_log_probs=ref))
    a0 = 1 / (_std([1.0, 0.0]) + 1e-6) * 0.5
    # fp32 against float64: measured 3.6e-8 and 9.5e-7 relative (CPU, 2026-12-07)
    assert adv[0].tolist() == pytest.approx([a0, a0], rel=1e-7)                # grpo ignores the token KL
    assert extras["reward_kl"][0].tolist() == pytest.approx([0.1, 0.1], rel=2e-6)
    adv_w, _, _ = A.compute_advantages_and_returns(algo(normalize_advantages=True), _inputs())
    flat, mask = torch.cat(adv_w), torch.cat(_inputs().loss_masks)
    assert float((flat * mask).sum()) == pytest.approx(0.0, abs=2.5e-7)       # measured 1.2e-7


def test_dispatch_ppo_and_rpp_need_inputs():
    with pytest.raises(ValueError, match="critic values"):
        A.compute_advantages_and_returns(algo(advantage_estimator="ppo"), _inputs())
    with pytest.raises(ValueError, match="--kl-coef"):
        A.compute_advantages_and_returns(algo(kl_coef=0.1), _inputs())
    vals = [torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(1)]
    adv, ret, _ = A.compute_advantages_and_returns(algo(advantage_estimator="ppo"), _inputs(values=vals))
    assert adv[0].tolist() == [1.0, 1.0] and adv[2].tolist() == [0.0, 0.0]    # raw reward, masked token zero
    adv, ret, _ = A.compute_advantages_and_returns(algo(advantage_estimator="reinforce_plus_plus", gamma=0.5),
                                                   _inputs())
    assert adv[0].tolist() == [0.5, 1.0]
    adv, _, extras = A.compute_advantages_and_returns(
        algo(use_opd=True, opd_kl_coef=1.0, rewards_normalization=False),
        _inputs(log_probs=[torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(1)],
                teacher_log_probs=[torch.full((2,), -1.0), torch.zeros(3), torch.zeros(2), torch.zeros(1)]))
    assert adv[0].tolist() == [0.0, 0.0] and extras["opd_reverse_kl"][0].tolist() == [1.0, 1.0]
