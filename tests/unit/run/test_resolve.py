"""Derived run values: --num-epoch -> num_rollout, steps/global batch, offload defaults; clear errors."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_args
from miles.run.resolve import RunPlan, derive_num_rollout, derive_steps, resolve_run


def _cfg(*argv: str, validate: bool = True):
    return parse_args(list(argv), validate=validate)


def test_num_epoch_derives_num_rollout():
    cfg = _cfg("--num-epoch", "3", "--rollout-batch-size", "16")
    assert derive_num_rollout(cfg, num_prompts=220) == 3 * (220 // 16)


def test_num_rollout_wins_and_is_required():
    assert derive_num_rollout(_cfg("--num-rollout", "7", "--num-epoch", "3", "--rollout-batch-size", "4"), 100) == 7
    cfg = _cfg("--rollout-batch-size", "4", "--dry-run")
    with pytest.raises(ConfigError, match="--num-rollout is required"):
        derive_num_rollout(cfg, 100)
    with pytest.raises(ConfigError, match="larger than the prompt data"):
        derive_num_rollout(_cfg("--num-epoch", "1", "--rollout-batch-size", "64"), 10)


def test_steps_and_global_batch():
    assert derive_steps(_cfg("--num-rollout", "1", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8")) == (1, 128, 128)
    assert derive_steps(_cfg("--num-rollout", "1", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
                             "--global-batch-size", "32")) == (4, 32, 128)
    assert derive_steps(_cfg("--num-rollout", "1", "--rollout-batch-size", "4", "--num-steps-per-rollout", "2")) == (2, 2, 4)
    with pytest.raises(ConfigError, match="must divide"):
        derive_steps(_cfg("--num-rollout", "1", "--rollout-batch-size", "3", "--num-steps-per-rollout", "2"))


def test_offload_defaults_and_roundtrip():
    cfg = _cfg("--num-rollout", "2", "--rollout-batch-size", "4", "--colocate")
    plan = resolve_run(cfg, num_prompts=None, output_dir="o", world_size=2)
    assert plan.offload_train and plan.offload_rollout
    plan2 = resolve_run(_cfg("--num-rollout", "2", "--rollout-batch-size", "4"), num_prompts=None, output_dir="o", world_size=4)
    assert not plan2.offload_train and not plan2.offload_rollout
    assert RunPlan.from_dict(plan.to_dict()) == plan


def test_num_epoch_without_rollout_batch_size_is_one_line():
    cfg = _cfg("--num-epoch", "1", "--debug-train-only")  # validation lets it through (train-only), resolve must not crash
    with pytest.raises(ConfigError, match="--num-epoch 1 needs --rollout-batch-size"):
        derive_num_rollout(cfg, num_prompts=8)


def test_negative_lr_is_refused_by_name():
    with pytest.raises(ConfigError, match="--lr must be >= 0, got -1.0"):
        _cfg("--num-rollout", "1", "--rollout-batch-size", "2", "--lr", "-1")
