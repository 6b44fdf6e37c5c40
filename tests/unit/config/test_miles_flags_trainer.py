"""Miles trainer flags reach the FSDP trainer (one gloo rank, tiny model): --num-critic-only-steps keeps the
actor frozen while the critic learns; --disable-compute-advantages-and-returns skips advantages."""

from __future__ import annotations

import pytest
import torch
from trainer_harness import build, flags, random_samples


def _samples() -> list:
    return random_samples(2, 4, seed=3)


def _trainer(model_dir, group, *extra: str):
    return build(model_dir, flags("fsdp", ["--num-rollout", "4", "--n-samples-per-prompt", "4", "--lr", "1e-2"],
                                  list(extra)), group=group)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model) -> bool:
    return any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


@pytest.mark.filterwarnings("error:FSDP2-wrapped module")  # the critic must not return a view (silent wrong grads)
def test_num_critic_only_steps_freezes_the_actor_first(tiny_model_dir, one_rank_group):
    tr = _trainer(tiny_model_dir, one_rank_group, "--advantage-estimator", "ppo", "--num-critic-only-steps", "1")
    actor, critic = _params(tr.model), _params(tr.critic.model)
    tr.train(_samples(), rollout_id=0)
    assert not _changed(actor, tr.model) and _changed(critic, tr.critic.model)
    tr.train(_samples(), rollout_id=1)
    assert _changed(actor, tr.model)


def test_disable_compute_advantages_and_returns_skips_them(tiny_model_dir, one_rank_group, monkeypatch):
    import miles.trainer.step as step

    calls = []
    real = step.compute_advantages_and_returns
    monkeypatch.setattr(step, "compute_advantages_and_returns", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = f"{__name__}.mean_logprob_loss"  # this module, as pytest imported it
    tr = _trainer(tiny_model_dir, one_rank_group, "--loss-type", "custom_loss", "--custom-loss-function-path", path)
    tr.train(_samples(), rollout_id=0)
    assert calls == [1]
    tr = _trainer(tiny_model_dir, one_rank_group, "--loss-type", "custom_loss", "--custom-loss-function-path", path,
                  "--disable-compute-advantages-and-returns")
    tr.train(_samples(), rollout_id=0)
    assert calls == [1]


def mean_logprob_loss(inp, algo):
    """A custom loss that needs no advantages: maximise the response log-probs."""
    return -inp.log_probs, {}


def test_critic_warms_up_over_its_own_iters(tiny_model_dir, one_rank_group):
    tr = _trainer(tiny_model_dir, one_rank_group, "--advantage-estimator", "ppo", "--lr-warmup-iters", "3",
                  "--critic-lr-warmup-iters", "1")
    assert (tr.schedule.warmup, tr.critic.schedule.warmup) == (3, 1)
