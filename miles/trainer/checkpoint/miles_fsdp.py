"""Reading checkpoints that Miles's FSDP backend wrote, so a Miles run resumes here unchanged.

Miles (``radixark/miles@v0.1.0:miles/backends/fsdp_utils/checkpoint.py``) saves under ``--save``::

    latest_checkpointed_iteration.txt    the newest step N (written last)
    iter_000000N/model/                  DCP: {"model_state": {"model": model state dict}}
    iter_000000N/optimizer/              DCP: {"optim_state": {"optim": optimizer state dict}} (unless --no-save-optim)
    iter_000000N/lr_scheduler/           DCP of Miles's LR scheduler
    iter_000000N/rng.pt                  {"torch": CPU RNG state, "cuda": CUDA RNG states}
    iter_000000N/meta.json               rollout_id, next_rollout_id, global_step, world_size, ...
    rollout/global_dataset_state_dict_<rollout_id>.pt   the data position (with --rollout-global-dataset)

``find`` names such a checkpoint under a ``--load`` directory; ``load`` reads the model (Miles's names are the
HF model's; ours sit under ``PolicyModel.lm``) and the AdamW state (exp_avg, exp_avg_sq, step by parameter name;
the parameter groups stay this run's) into this project's trainer, sets the RNG from ``rng.pt`` (rank 0's, on
every rank, as Miles does) and returns the ``extra`` a resume needs (the next rollout id, the data position when
Miles saved one). The LR schedule resumes at the scheduler's ``last_epoch`` (optimizer steps so far; v0.1.0
never advances meta.json's ``global_step``, which is the fallback without ``lr_scheduler/``).
``tests/fixtures/miles_fsdp_ckpt/`` is such a checkpoint, written by Miles's own save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.trainer.checkpoint.layout import TRACKER
from miles.trainer.checkpoint.sync import barrier
from miles.utils.logging import get_logger

if TYPE_CHECKING:
    from miles.trainer.fsdp import FSDPTrainer

logger = get_logger(__name__)


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


def _read_scheduler(path: Path, group) -> dict[str, Any]:
    """Miles's ``FSDPLRScheduler.state_dict()`` from ``lr_scheduler/`` (DCP of plain values, one per key)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    prefix = "lr_scheduler_state.lr_scheduler."
    keys = [k[len(prefix):] for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata
            if k.startswith(prefix)]
    sd: dict[str, Any] = {"lr_scheduler_state": {"lr_scheduler": dict.fromkeys(keys)}}
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    return sd["lr_scheduler_state"]["lr_scheduler"]


def _restore_schedule(trainer: FSDPTrainer, path: Path, meta: dict[str, Any]) -> None:
    """Resume the LR schedule at Miles's optimizer step: the scheduler's ``last_epoch`` (Miles v0.1.0 never
    advances meta.json's ``global_step``, so that is 0); warn where this run's schedule differs from the saved one."""
    sched_dir = path / "lr_scheduler"
    if not (sched_dir / ".metadata").is_file():
        if "global_step" in meta:
            trainer.schedule.load_state_dict({**trainer.schedule.state_dict(), "step": int(meta["global_step"])})
        logger.warning("%s has no lr_scheduler/ (saved with --no-save-optim): the LR schedule resumes at step %d.",
                       path, trainer.schedule.step)
        return
    saved = _read_scheduler(sched_dir, trainer.group)
    step = int(saved["last_epoch"])
    trainer.schedule.load_state_dict({**trainer.schedule.state_dict(), "step": step})
    ours = trainer.schedule
    pairs = {"--lr": (saved.get("max_lr"), ours.lr), "--min-lr": (saved.get("min_lr"), ours.min_lr),
             "--lr-warmup-iters": (saved.get("lr_warmup_steps"), ours.warmup),
             "--lr-decay-iters": (saved.get("lr_decay_steps"), ours.decay_iters),
             "--lr-decay-style": (saved.get("lr_decay_style"), ours.style)}
    differ = [f"{flag} {mine} (checkpoint: {theirs})" for flag, (theirs, mine) in pairs.items()
              if theirs is not None and theirs != mine]
    if differ:
        logger.warning("%s: this run's LR schedule differs from the one Miles saved: %s; the schedule resumes at "
                       "step %d with this run's flags.", path, ", ".join(differ), step)


def _load_optimizer(trainer: FSDPTrainer, optim_dir: Path, prefix: str) -> None:
    """AdamW state by parameter name; Miles's names are the HF model's, ours carry ``prefix`` (the policy wrapper).
    The parameter groups (LR, weight decay) stay this run's: Miles keeps one group, this trainer two."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ours = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    theirs = {name[len(prefix):]: st for name, st in ours["state"].items()}
    sd = {"optim_state": {"optim": {"state": theirs}}}
    dcp.load(sd, checkpoint_id=str(optim_dir), process_group=trainer.group)
    loaded = sd["optim_state"]["optim"]["state"]
    set_optimizer_state_dict(trainer.model, trainer.optimizer,
                             {"state": {prefix + name: st for name, st in loaded.items()},
                              "param_groups": ours["param_groups"]})


def load(trainer: FSDPTrainer, path: Path) -> dict[str, Any]:
    """Load a Miles FSDP checkpoint into ``trainer`` (collective on the trainer group); returns the resume ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    lm = trainer.model.lm                    # Miles saves the HF model itself; ours wraps it (PolicyModel.lm)
    prefix = next(n for n, m in trainer.model.named_modules() if m is lm) + "."
    model_sd = {"model_state": {"model": get_model_state_dict(lm)}}
    dcp.load(model_sd, checkpoint_id=str(path / "model"), process_group=trainer.group)
    set_model_state_dict(lm, model_sd["model_state"]["model"])
    optim_dir = path / "optimizer"
    if trainer.ckpt.no_load_optim:
        pass
    elif (optim_dir / ".metadata").is_file():
        _load_optimizer(trainer, optim_dir, prefix)
    else:
        logger.warning("%s has no optimizer state (saved with --no-save-optim): AdamW state starts fresh.", path)
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    step = int(path.name.split("_")[1])
    rollout_id = int(meta.get("rollout_id", step - 1))
    _restore_schedule(trainer, path, meta)
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
    barrier(trainer.trainer_group, trainer.device)
    logger.info("loaded Miles FSDP checkpoint %s (rollout %d, LR schedule step %d)", path, rollout_id,
                trainer.schedule.step)
    return extra
