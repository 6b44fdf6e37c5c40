"""Which GPU an engine is told to use, as its leader process sees the devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles.config import ConfigError
from miles.run.fleet import _visible_base_gpu


def _spec(num_gpus=1, base=3):
    return SimpleNamespace(engine_id=1, num_gpus=num_gpus, base_gpu_id=base)


def _world(device="cuda", local_world_size=4):
    return SimpleNamespace(device=torch.device(device), local_world_size=local_world_size)


def test_cpu_and_all_gpus_visible_keep_the_plans_gpu(monkeypatch):
    assert _visible_base_gpu(_spec(), _world("cpu")) == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _visible_base_gpu(_spec(), _world()) == 3


def test_one_gpu_per_task_uses_that_gpu_and_refuses_bigger_engines(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _visible_base_gpu(_spec(), _world()) == 0
    with pytest.raises(ConfigError, match="--gpus-per-task"):
        _visible_base_gpu(_spec(num_gpus=2), _world())
