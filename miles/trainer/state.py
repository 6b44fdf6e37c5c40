"""What a trainer checkpoint holds, and how it is written and read (torch.distributed.checkpoint).

Inside one checkpoint directory (made crash-safe by ``checkpoint.save_checkpoint``)::

    actor/                DCP: {"model": sharded model state, "optim": AdamW state (unless --no-save-optim)}
    critic/               the same for the PPO critic (value head included)
    rng/rank00000.pt ...  python, numpy, torch and CUDA RNG states of each trainer rank
    trainer_state.json    format, world size, LR schedule step(s), has_optim, has_critic, extra

DCP writes each rank's shards in parallel (files ``__<rank>_0.distcp`` plus ``.metadata``) over the
trainer group only, and can reshard on load, so a checkpoint loads on a different number of
trainer ranks (the RNG files then fall back with a warning). The reference and teacher models are
not saved: they come from --ref-load / --hf-checkpoint / --opd-teacher-load again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from miles.trainer.checkpoint import rng_state, set_rng_state
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.trainer.fsdp import FSDPTrainer

logger = get_logger(__name__)
FORMAT = 1


def _dcp_write(model, optimizer, path: Path, group, with_optim: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sd = {"model": get_model_state_dict(model)}
    if with_optim:
        sd["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(sd, checkpoint_id=str(path), process_group=group)


def _dcp_read(model, optimizer, path: Path, group, with_optim: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = {"model": get_model_state_dict(model)}
    if with_optim:
        sd["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    set_model_state_dict(model, sd["model"])
    if with_optim:
        set_optimizer_state_dict(model, optimizer, sd["optim"])


def save_trainer_state(trainer: FSDPTrainer, path: Path, extra: dict) -> None:
    try:
        extra_json = json.loads(json.dumps(extra))
    except TypeError as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable ({e}); got keys {sorted(extra)}.") from e
    path.mkdir(parents=True, exist_ok=True)
    with_optim = not trainer.ckpt.no_save_optim
    _dcp_write(trainer.model, trainer.optimizer, path / "actor", trainer.group, with_optim)
    if trainer.critic is not None:
        _dcp_write(trainer.critic.model, trainer.critic.optimizer, path / "critic", trainer.group, with_optim)
    (path / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), path / "rng" / f"rank{trainer.rank:05d}.pt")
    if trainer.rank == 0:
        meta = {
            "format": FORMAT, "world_size": trainer.world, "schedule": trainer.schedule.state_dict(),
            "critic_schedule": trainer.critic.schedule.state_dict() if trainer.critic is not None else None,
            "has_optim": with_optim, "has_critic": trainer.critic is not None, "extra": extra_json,
        }
        (path / "trainer_state.json").write_text(json.dumps(meta, indent=2))
    trainer._barrier()


def load_trainer_state(trainer: FSDPTrainer, path: Path) -> dict:
    meta_path = path / "trainer_state.json"
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a trainer checkpoint (no trainer_state.json); pass a step_* directory "
                         "written by --save, or the --save root to pick the newest complete one.")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not supported (expected {FORMAT}).")
    with_optim = bool(meta["has_optim"]) and not trainer.ckpt.no_load_optim
    if not meta["has_optim"] and not trainer.ckpt.no_load_optim:
        logger.warning("%s was saved with --no-save-optim: AdamW state starts fresh.", path)
    _dcp_read(trainer.model, trainer.optimizer, path / "actor", trainer.group, with_optim)
    trainer.schedule.load_state_dict(meta["schedule"])
    if trainer.critic is not None:
        if not meta.get("has_critic"):
            raise ValueError(f"{path} has no critic but --advantage-estimator ppo needs one; resume with the "
                             "estimator the checkpoint was trained with, or start a new run.")
        _dcp_read(trainer.critic.model, trainer.critic.optimizer, path / "critic", trainer.group, with_optim)
        trainer.critic.schedule.load_state_dict(meta["critic_schedule"])
    rng_file = path / "rng" / f"rank{trainer.rank:05d}.pt"
    if rng_file.is_file() and meta.get("world_size") == trainer.world:
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s: no RNG state for trainer rank %d of %d (saved with %s ranks); RNG not restored.",
                       path, trainer.rank, trainer.world, meta.get("world_size"))
    trainer._barrier()
    logger.info("loaded checkpoint %s (schedule step %d)", path, trainer.schedule.step)
    return meta["extra"]


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of the optimizer state (fused AdamW on GPU keeps even ``step`` there)."""
    non_blocking = device.type == "cuda"
    for st in optimizer.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor):
                st[k] = v.to(device, non_blocking=non_blocking)
