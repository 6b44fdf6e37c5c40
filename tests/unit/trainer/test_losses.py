"""Losses against written-out per-token computations (floats, no tensor tricks)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles.trainer import losses as L


def test_kl_estimators():
    lp, base = torch.tensor([-1.0, -2.0, -0.1, -30.0]), torch.tensor([-1.5, -1.0, -0.1, -1.0])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        got = L.approx_kl(lp, base, kind).tolist()
        for g, a, b in zip(got, lp.tolist(), base.tolist()):
            r = a - b
            if kind == "k1":
                exp = r
            elif kind == "k2":
                exp = r * r / 2
            elif kind == "k3":
                exp = math.exp(-r) - 1 + r
            else:
                rc = max(min(-r, 20.0), -20.0)
                exp = max(min(math.exp(rc) - 1 - rc, 10.0), -10.0)
            assert g == pytest.approx(exp, rel=2.5e-7), kind      # fp32 against float64: measured 1.2e-7
    assert L.approx_kl(lp, base, "low_var_kl").max() <= 10.0
    with pytest.raises(ValueError, match="--kl-loss-type"):
        L.approx_kl(lp, base, "k9")


def _ppo_ref(logr, adv, eps, eps_hi, c):
    ratio = math.exp(logr)
    l1, l2 = -adv * ratio, -adv * min(max(ratio, 1 - eps), 1 + eps_hi)
    loss = max(l1, l2)
    if c is not None and adv < 0:
        loss = min(loss, -c * adv)
    return loss, float(l2 > l1)


@pytest.mark.parametrize("eps_hi,c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_ppo_clip_both_sides_and_dual_clip(eps_hi, c):
    logr = torch.tensor([0.0, 0.5, -0.5, 0.5, -0.5, 1.6, 0.1, 0.25])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0, 0.0, 0.5])
    loss, clipped = L.ppo_clip_loss(logr, adv, 0.2, eps_hi, c)
    for i in range(len(logr)):
        el, ec = _ppo_ref(logr[i].item(), adv[i].item(), 0.2, eps_hi if eps_hi is not None else 0.2, c)
        assert loss[i].item() == pytest.approx(el, rel=1e-7), i        # fp32 against float64: measured 4.0e-8
        assert clipped[i].item() == ec
    assert clipped[1] == 1 and clipped[4] == 1 and clipped[2] == 0 and clipped[3] == 0
    if c is not None:
        assert loss[5].item() == pytest.approx(3.0 * 2.0)        # dual clip caps the negative-advantage loss
    with pytest.raises(ValueError, match="--eps-clip-c"):
        L.ppo_clip_loss(logr, adv, 0.2, None, 0.5)


def test_gspo_sequence_ratio():
    lp = torch.tensor([-1.0, -2.0, -3.0, -0.5, -0.7], requires_grad=True)
    old = torch.tensor([-1.2, -2.0, -2.0, -0.4, -0.7])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    out = L.gspo_log_ratio(lp, old, mask, [3, 2])
    s0 = ((-1.0 + 1.2) + 0.0) / 2                                   # masked token excluded
    s1 = ((-0.5 + 0.4) + 0.0) / 2
    assert out.tolist() == pytest.approx([s0] * 3 + [s1] * 2, rel=1e-6)
    out.sum().backward()                                            # d/dlp: each token of a sample gets len/K
    assert lp.grad.tolist() == pytest.approx([1.5, 1.5, 0.0, 1.0, 1.0])


def test_tis_weights():
    old, roll = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -3.0, 2.0])
    w, clipped = L.tis_weights(old, roll, 0.1, 2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, max(math.exp(-3.0), 0.1)])
    assert clipped.tolist() == [0.0, 1.0, 1.0]


def test_value_loss_clipped():
    v, old, ret = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 0.0, 0.4]), torch.tensor([2.0, -1.0, 0.0])
    loss, clipped = L.value_loss(v, old, ret, 0.2)
    for i in range(3):
        vc = old[i].item() + max(min(v[i].item() - old[i].item(), 0.2), -0.2)
        l1, l2 = (v[i].item() - ret[i].item()) ** 2, (vc - ret[i].item()) ** 2
        assert loss[i].item() == pytest.approx(0.5 * max(l1, l2))
        assert clipped[i].item() == float(l2 > l1)


def test_reducers_token_and_sample_mean():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    tok = L.Reducer(mask, [3, 2], per_token=True, num_step_tokens=8, num_step_samples=4)
    assert tok(x).item() == pytest.approx((1 + 3 + 10 + 20) / 8)
    smp = L.Reducer(mask, [3, 2], per_token=False, num_step_tokens=8, num_step_samples=4)
    assert smp(x).item() == pytest.approx(((1 + 3) / 2 + (10 + 20) / 2) / 4)
    # a fully masked sample contributes nothing and does not divide by zero
    z = L.Reducer(torch.zeros(2), [2], per_token=False, num_step_tokens=0, num_step_samples=1)
    assert z(torch.ones(2)).item() == 0.0


def _algo(**kw):
    base = dict(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, use_tis=False,
                tis_clip=2.0, tis_clip_low=0.0, entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                kl_loss_type="k1")
    base.update(kw)
    return SimpleNamespace(**base)


def test_policy_loss_written_out():
    lp = torch.tensor([-1.0, -2.0, -0.3, -0.9], requires_grad=True)
    old = torch.tensor([-1.1, -1.5, -0.3, -1.0])
    roll = torch.tensor([-1.0, -1.6, -0.2, -1.3])
    ref = torch.tensor([-1.2, -2.0, -0.5, -0.8])
    adv = torch.tensor([0.5, 0.5, -1.0, -1.0])
    ent = torch.tensor([2.0, 1.0, 3.0, 0.5], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    a = _algo(use_tis=True, tis_clip=1.5, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k2")
    red = L.Reducer(mask, [2, 2], per_token=False, num_step_tokens=3, num_step_samples=2)
    loss, m = L.policy_loss(a, L.LossInputs(log_probs=lp, loss_mask=mask, lengths=[2, 2], old_log_probs=old,
                                            rollout_log_probs=roll, ref_log_probs=ref, advantages=adv, entropy=ent), red)
    pg, kl, en = [], [], []
    for i in range(4):
        lr = lp[i].item() - old[i].item()
        pl, _ = _ppo_ref(lr, adv[i].item(), 0.2, 0.2, None)
        w = min(max(math.exp(old[i].item() - roll[i].item()), 0.0), 1.5)
        pg.append(pl * w * mask[i].item())
        kl.append((lp[i].item() - ref[i].item()) ** 2 / 2 * mask[i].item())
        en.append(ent[i].item() * mask[i].item())

    def smean(v):
        return ((v[0] + v[1]) / 2 + (v[2] + v[3]) / 1) / 2

    exp = smean(pg) - 0.01 * smean(en) + 0.2 * smean(kl)
    # fp32 against float64: measured 1.2e-7 / 5.5e-8 / 4.0e-8 relative (CPU, 2026-12-07)
    assert loss.item() == pytest.approx(exp, rel=2.5e-7)
    assert m["pg_loss"].item() == pytest.approx(smean(pg), rel=1.2e-7)
    assert m["kl_loss"].item() == pytest.approx(smean(kl), rel=1e-7)
    loss.backward()
    assert lp.grad[3].item() == 0.0 and ent.grad[0].item() == pytest.approx(-0.01 / 2 / 2)


def test_gspo_policy_loss_uses_sequence_ratio():
    lp = torch.tensor([-1.0, -1.0, -2.0])
    old = torch.tensor([-1.5, -0.5, -2.0])
    adv = torch.ones(3)
    red = L.Reducer(torch.ones(3), [2, 1], per_token=True, num_step_tokens=3, num_step_samples=2)
    _, m = L.policy_loss(_algo(advantage_estimator="gspo"),
                         L.LossInputs(log_probs=lp, loss_mask=torch.ones(3), lengths=[2, 1], old_log_probs=old,
                                      advantages=adv), red)
    assert m["pg_loss"].item() == pytest.approx(-1.0)                # sequence ratio exp(0) = 1 for both samples
    assert m["pg_clipfrac"].item() == 0.0


def test_sft_and_custom_loss(tmp_path, monkeypatch):
    lp = torch.tensor([-1.0, -3.0, -2.0])
    red = L.Reducer(torch.tensor([1.0, 0.0, 1.0]), [3], per_token=True, num_step_tokens=2, num_step_samples=1)
    loss, _ = L.sft_loss(None, L.LossInputs(log_probs=lp, loss_mask=red.mask, lengths=[3]), red)
    assert loss.item() == pytest.approx(1.5)
    (tmp_path / "my_losses.py").write_text(
        "def sq(inputs, algo):\n    return inputs.log_probs ** 2, {'neg': -inputs.log_probs}\n"
        "def bad(inputs, algo):\n    return inputs.log_probs.sum(), {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = L.custom_loss(L.load_custom_loss("my_losses.sq"))
    loss, m = fn(None, L.LossInputs(log_probs=lp, loss_mask=red.mask, lengths=[3]), red)
    assert loss.item() == pytest.approx((1 + 4) / 2) and m["neg"].item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="per-token loss"):
        L.custom_loss(L.load_custom_loss("my_losses.bad"))(None, L.LossInputs(log_probs=lp, loss_mask=red.mask,
                                                                               lengths=[3]), red)
    for bad in ("nodots", "no_such_module_xyz.fn", "my_losses.missing"):
        with pytest.raises(ValueError, match="--custom-loss-function-path"):
            L.load_custom_loss(bad)


def test_a_loss_plugin_that_raises_while_importing_is_one_line(tmp_path, monkeypatch):
    from miles.config.base import ConfigError

    (tmp_path / "broken_losses.py").write_text("import math\nraise RuntimeError('no GPU config found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        L.load_tis_function("broken_losses.tis")
    msg = str(e.value)
    assert "\n" not in msg and "--custom-tis-function-path" in msg and "no GPU config found" in msg
    assert "broken_losses.py:2" in msg
