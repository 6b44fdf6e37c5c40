"""``build_trainer``: the one place a trainer backend is chosen (``--train-backend``), for the run and the tests.

    trainer = build_trainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=groups.trainer_group,
                            device=device, rollout_temperature=cfg.rollout.rollout_temperature,
                            num_rollout=..., global_batch_size=..., num_steps_per_rollout=..., timeout=...)

Both backends implement the shared RL step (``miles.trainer.step.RLTrainer``); see docs/trainer.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miles.config.base import ConfigError

BACKENDS = ("fsdp", "megatron")


def build_trainer(train, algo, ckpt, megatron=None, *, group: dist.ProcessGroup, device: torch.device | str,
                  rollout_temperature: float, num_rollout: int | None, global_batch_size: int | None,
                  num_steps_per_rollout: int, timeout: float, mesh: Any = None,
                  custom_config: dict | None = None) -> Any:
    """The trainer of ``train.train_backend`` over the trainer ``group`` on this rank's ``device``. ``megatron``:
    the Megatron section (its flags; None takes the defaults); ``mesh``: the FSDP backend's DeviceMesh over
    ``group`` (built from the group when None). Raises ``ConfigError`` naming the valid backends for any other."""
    backend = train.train_backend
    common = dict(group=group, device=torch.device(device), rollout_temperature=rollout_temperature,
                  num_rollout=num_rollout, global_batch_size=global_batch_size,
                  num_steps_per_rollout=num_steps_per_rollout, timeout=timeout, custom_config=custom_config)
    if backend == "fsdp":
        from miles.trainer.fsdp import FSDPTrainer

        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, torch.device(device).type, mesh_dim_names=("dp",))
        return FSDPTrainer(train, algo, ckpt, mesh=mesh, **common)
    if backend == "megatron":
        from miles.trainer.megatron import require_megatron_core

        require_megatron_core()
        from miles.trainer.megatron.trainer import MegatronTrainer

        return MegatronTrainer(train, algo, ckpt, megatron, **common)
    raise ConfigError(f"--train-backend {backend!r} is not a trainer backend; valid: {', '.join(BACKENDS)}.")


def build_run_trainer(cfg: Any, ctx: Any, plan: Any) -> Any:
    """The trainer of one run (``miles.run.build``): the flags of ``cfg``, the trainer group and mesh of ``ctx``,
    the sizes of the resolved ``plan``."""
    return build_trainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=ctx.groups.trainer_group,
                         mesh=ctx.groups.trainer_mesh, device=ctx.world.device,
                         rollout_temperature=cfg.rollout.rollout_temperature, num_rollout=plan.num_rollout,
                         # --use-dynamic-global-batch-size: the step's batch is what arrives (no expected count)
                         global_batch_size=None if cfg.data.use_dynamic_global_batch_size else plan.global_batch_size,
                         num_steps_per_rollout=plan.num_steps_per_rollout,
                         timeout=cfg.cluster.distributed_timeout_minutes * 60, custom_config=cfg.custom_config)
