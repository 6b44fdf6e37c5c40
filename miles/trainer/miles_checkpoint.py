"""Reading checkpoints that Miles's FSDP backend wrote, so a Miles run resumes here unchanged.

Miles (``radixark/miles@v0.1.0:miles/backends/fsdp_utils/checkpoint.py``) saves under ``--save``::

    latest_checkpointed_iteration.txt    the newest step N (written last)
    iter_000000N/model/                  DCP: {"model_state": {"model": model state dict}}
    iter_000000N/optimizer/              DCP: {"optim_state": {"optim": optimizer state dict}} (unless --no-save-optim)
    iter_000000N/lr_scheduler/           DCP of Miles's LR scheduler
    iter_000000N/rng.pt                  {"torch": CPU RNG state, "cuda": CUDA RNG states}
    iter_000000N/meta.json               rollout_id, next_rollout_id, global_step, world_size, ...
    rollout/global_dataset_state_dict_<rollout_id>.pt   the data position (with --rollout-global-dataset)

``find`` names such a checkpoint under a ``--load`` directory; ``load`` reads the model (and the AdamW
state, which both projects keep as torch's state dict keyed by parameter name) into this project's
trainer and returns the ``extra`` a resume needs (the next rollout id, the data position when Miles
saved one). The LR schedule resumes at Miles's ``global_step`` (optimizer steps so far).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.trainer.fsdp import FSDPTrainer

logger = get_logger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"


def find(root: str | Path | None) -> Path | None:
    """The ``iter_*`` directory a Miles FSDP ``--save`` root points at through its tracker file, or None."""
    if root is None:
        return None
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load {root}: {TRACKER} holds {text[:40]!r}, not a step number; restore the file "
                         "(the newest iter_* step) or point --load elsewhere.")
    path = Path(root) / f"iter_{int(text):07d}"
    if not (path / "model").is_dir():
        kind = "a Megatron checkpoint (use --train-backend megatron)" if path.is_dir() else "missing"
        raise ValueError(f"--load {root}: {TRACKER} names {path.name}, which is {kind}; this trainer reads Miles's "
                         "FSDP checkpoints (iter_*/model).")
    return path


def load(trainer: FSDPTrainer, path: Path) -> dict[str, Any]:
    """Load a Miles FSDP checkpoint into ``trainer`` (collective on the trainer group); returns the resume ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_sd = {"model_state": {"model": get_model_state_dict(trainer.model)}}
    dcp.load(model_sd, checkpoint_id=str(path / "model"), process_group=trainer.group)
    set_model_state_dict(trainer.model, model_sd["model_state"]["model"])
    optim_dir = path / "optimizer"
    if trainer.ckpt.no_load_optim:
        pass
    elif (optim_dir / ".metadata").is_file():
        optim_sd = {"optim_state": {"optim": get_optimizer_state_dict(trainer.model, trainer.optimizer)}}
        dcp.load(optim_sd, checkpoint_id=str(optim_dir), process_group=trainer.group)
        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_sd["optim_state"]["optim"])
    else:
        logger.warning("%s has no optimizer state (saved with --no-save-optim): AdamW state starts fresh.", path)
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    step = int(path.name.split("_")[1])
    rollout_id = int(meta.get("rollout_id", step - 1))
    if "global_step" in meta:
        trainer.schedule.load_state_dict({**trainer.schedule.state_dict(), "step": int(meta["global_step"])})
    rng = path / "rng.pt"
    if rng.is_file() and meta.get("world_size") in (None, trainer.world):
        state = torch.load(rng, map_location="cpu", weights_only=False)
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
    extra: dict[str, Any] = {"rollout_id": rollout_id, "next_rollout_id": int(meta.get("next_rollout_id", step)),
                             "miles_checkpoint": str(path)}
    data_state = path.parent / "rollout" / f"global_dataset_state_dict_{rollout_id}.pt"
    if data_state.is_file():
        extra["miles_data_state"] = {k: v for k, v in torch.load(data_state, weights_only=False).items()
                                     if k in ("sample_offset", "epoch_id")}
    trainer._barrier()
    logger.info("loaded Miles FSDP checkpoint %s (rollout %d, optimizer step %s)", path, rollout_id,
                meta.get("global_step", "unknown"))
    return extra
