"""Miles trainer flags reach the FSDP trainer (one gloo rank, tiny model): --num-critic-only-steps keeps the
actor frozen while the critic learns; --disable-compute-advantages-and-returns skips advantages."""

from __future__ import annotations

import pytest
import torch

from miles.config import parse_args
from miles.types import Sample


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD, DeviceMesh.from_group(dist.group.WORLD, device_type="cpu")
    finally:
        dist.destroy_process_group()


def _samples(n: int = 8) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        tokens = torch.randint(4, 60, (7,), generator=gen).tolist()
        out.append(Sample(group_index=i // 4, index=i, tokens=tokens, response_length=3, loss_mask=[1, 1, 1],
                          reward=float(i % 2), rollout_log_probs=[-2.0, -2.0, -2.0]))
    return out


def _trainer(model_dir, group, *extra: str):
    from miles.trainer.fsdp import FSDPTrainer

    cfg = parse_args(["--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--num-rollout", "4",
                      "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--lr", "1e-2", "--num-steps-per-rollout", "1", *extra])
    pg, mesh = group
    return FSDPTrainer(cfg.train, cfg.algo, cfg.checkpoint, mesh=mesh, group=pg, device=torch.device("cpu"),
                       rollout_temperature=1.0, num_rollout=4, global_batch_size=None, num_steps_per_rollout=1,
                       timeout=60)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model) -> bool:
    return any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


@pytest.mark.filterwarnings("error:FSDP2-wrapped module")  # the critic must not return a view (silent wrong grads)
def test_num_critic_only_steps_freezes_the_actor_first(tiny_model_dir, group):
    tr = _trainer(tiny_model_dir, group, "--advantage-estimator", "ppo", "--num-critic-only-steps", "1")
    actor, critic = _params(tr.model), _params(tr.critic.model)
    tr.train(_samples(), rollout_id=0)
    assert not _changed(actor, tr.model) and _changed(critic, tr.critic.model)
    tr.train(_samples(), rollout_id=1)
    assert _changed(actor, tr.model)


def test_disable_compute_advantages_and_returns_skips_them(tiny_model_dir, group, monkeypatch):
    import miles.trainer.step as step

    calls = []
    real = step.compute_advantages_and_returns
    monkeypatch.setattr(step, "compute_advantages_and_returns", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = f"{__name__}.mean_logprob_loss"  # this module, as pytest imported it
    tr = _trainer(tiny_model_dir, group, "--loss-type", "custom_loss", "--custom-loss-function-path", path)
    tr.train(_samples(), rollout_id=0)
    assert calls == [1]
    tr = _trainer(tiny_model_dir, group, "--loss-type", "custom_loss", "--custom-loss-function-path", path,
                  "--disable-compute-advantages-and-returns")
    tr.train(_samples(), rollout_id=0)
    assert calls == [1]


def mean_logprob_loss(inp, algo):
    """A custom loss that needs no advantages: maximise the response log-probs."""
    return -inp.log_probs, {}


def test_critic_warms_up_over_its_own_iters(tiny_model_dir, group):
    tr = _trainer(tiny_model_dir, group, "--advantage-estimator", "ppo", "--lr-warmup-iters", "3",
                  "--critic-lr-warmup-iters", "1")
    assert (tr.schedule.warmup, tr.critic.schedule.warmup) == (3, 1)
