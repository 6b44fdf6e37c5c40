"""The FSDP backend's checkpoint: what one ``step_*`` directory holds, how it is written, verified and read
(torch.distributed.checkpoint), and the backend's save/resume on top of ``layout``/``resume``.

    path = save(trainer, rollout_id, extra)   # <save>/step_<rollout_id>, crash-safe (layout.save_atomic), pruned
    extra = resume(trainer)                   # newest usable under --load (default --save), or None
    write(trainer, path, extra); extra = read(trainer, path)     # one directory's contents (collective)

Inside one checkpoint directory::

    actor/                DCP: {"model": sharded model state, "optim": AdamW state (unless --no-save-optim)}
    lora/rank_00000.pt .. with --lora-rank instead of actor/: the adapters and their AdamW state, each trainer rank's
                          file (the adapters are replicated; the Megatron backend's layout, ``lora.save_files``)
    critic/               the same for the PPO critic (value head included)
    rng/rank00000.pt ...  python, numpy, torch and CUDA RNG states of each trainer rank
    trainer_state.json    format, world size, LR schedule step(s), has_optim, has_critic, extra

DCP writes each rank's shards in parallel (files ``__<rank>_0.distcp`` plus ``.metadata``) over the
trainer group only, and can reshard on load, so a checkpoint loads on a different number of
trainer ranks (the RNG files then fall back with a warning). The reference and teacher models are
not saved: they come from --ref-load / --hf-checkpoint / --opd-teacher-load again.

Resuming takes the newest complete checkpoint that passes ``verify`` (readable ``trainer_state.json`` of this
format, readable DCP ``.metadata``, every shard file present and as long as the metadata says, a loadable RNG
file) and loads without error (``resume.resume_newest``); a corrupt one is skipped with one warning. Without a
``step_*`` checkpoint, a checkpoint Miles's FSDP backend wrote is read (``miles_fsdp``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.api import CheckpointException

from miles.trainer.checkpoint import miles_fsdp
from miles.trainer.checkpoint.faults import fault_point
from miles.trainer.checkpoint.layout import STEP, published, read_trainer_state, save_atomic
from miles.trainer.checkpoint.resume import resume_newest, resume_root
from miles.trainer.checkpoint.rng import rng_state, set_rng_state
from miles.trainer.checkpoint.sync import barrier, local_error, raise_if_any
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


def json_extra(extra: dict) -> dict:
    """``extra`` as it will read back (a JSON round trip); one error naming the keys when it is not JSON."""
    try:
        return json.loads(json.dumps(extra))
    except TypeError as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable ({e}); got keys {sorted(extra)}.") from e


def write(trainer: FSDPTrainer, path: Path, extra: dict) -> None:
    """Write one checkpoint's contents into ``path`` (collective). A failure on any rank raises on every
    rank (DCP gathers its own; the rank-local files are agreed on), so no rank is left in a collective."""
    extra_json = json_extra(extra)
    group, device = trainer.trainer_group, trainer.device
    raise_if_any(local_error(lambda: path.mkdir(parents=True, exist_ok=True)), group, device)
    with_optim = not trainer.ckpt.no_save_optim
    if trainer.lora is not None:                  # the base is frozen (--hf-checkpoint): the adapters only
        from miles.trainer import lora as lora_mod

        lora_mod.save_files(trainer.lora, trainer.optimizer if with_optim else None, path, trainer.rank,
                            trainer.group)
    else:
        _dcp_write(trainer.model, trainer.optimizer, path / "actor", trainer.group, with_optim)
    if trainer.critic is not None:
        _dcp_write(trainer.critic.model, trainer.critic.optimizer, path / "critic", trainer.group, with_optim)
    fault_point("shards", int(extra_json.get("rollout_id", -1)), trainer.trainer_rank)

    def local_files() -> None:
        (path / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), path / "rng" / f"rank{trainer.rank:05d}.pt")
        if trainer.rank == 0:
            meta = {
                "format": FORMAT, "world_size": trainer.world, "schedule": trainer.schedule.state_dict(),
                "critic_schedule": trainer.critic.schedule.state_dict() if trainer.critic is not None else None,
                "has_optim": with_optim, "has_critic": trainer.critic is not None, "extra": extra_json,
                "has_lora": trainer.lora is not None,
            }
            (path / "trainer_state.json").write_text(json.dumps(meta, indent=2))

    raise_if_any(local_error(local_files), group, device)


def verify_dcp(d: Path) -> str | None:
    """Why the DCP directory ``d`` cannot be loaded, or None: metadata readable, shard files long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (d / ".metadata").is_file():
        return f"{d.name}/.metadata is missing"
    try:
        md = FileSystemReader(str(d)).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any unpickling failure means "corrupt"
        return f"{d.name}/.metadata is unreadable ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in getattr(md, "storage_data", {}).values():
        rel, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(end))
    for rel, end in sorted(need.items()):
        f = d / rel
        if not f.is_file():
            return f"{d.name}/{rel} is missing"
        size = f.stat().st_size
        if size < end:
            return f"{d.name}/{rel} is truncated ({size} bytes, its metadata needs {end})"
    return None


def verify(path: Path, *, rank: int | None = None, world: int | None = None) -> str | None:
    """Why checkpoint ``path`` is unusable, or None; cheap (reads metadata and file sizes, not tensors).
    With ``rank``/``world`` also that rank's RNG file when the checkpoint was saved with ``world`` ranks."""
    meta_path = path / "trainer_state.json"
    if not meta_path.is_file():
        return "trainer_state.json is missing"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"trainer_state.json is unreadable ({type(e).__name__}: {e})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        return f"trainer_state.json has format {got!r}, expected {FORMAT}"
    missing = [k for k in ("world_size", "schedule", "has_optim", "extra") if k not in meta]
    if missing:
        return f"trainer_state.json lacks {', '.join(missing)}"
    for sub in ([] if meta.get("has_lora") else ["actor"]) + (["critic"] if meta.get("has_critic") else []):
        problem = verify_dcp(path / sub)
        if problem:
            return problem
    if meta.get("has_lora") and not (path / "lora" / "rank_00000.pt").is_file():
        return "lora/rank_00000.pt is missing"
    if rank is not None and meta["world_size"] == world:
        rng_file = path / "rng" / f"rank{rank:05d}.pt"
        if rng_file.is_file():
            try:
                torch.load(rng_file, weights_only=False)
            except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
                return f"rng/{rng_file.name} is unreadable ({type(e).__name__})"
    return None


def read(trainer: FSDPTrainer, path: Path) -> dict:
    """Restore what ``write`` put into ``path`` (collective); returns ``extra``."""
    meta = read_trainer_state(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not supported (expected {FORMAT}).")
    with_optim = bool(meta["has_optim"]) and not trainer.ckpt.no_load_optim
    if not meta["has_optim"] and not trainer.ckpt.no_load_optim:
        logger.warning("%s was saved with --no-save-optim: AdamW state starts fresh.", path)
    if bool(meta.get("has_lora")) != (trainer.lora is not None):
        raise ValueError(f"{path} " + ("holds LoRA adapters (--lora-rank), not the model: resume it with its LoRA "
                                       "flags" if meta.get("has_lora") else
                                       "holds the whole model, no LoRA adapters: resume it without --lora-rank, or "
                                       "start the LoRA run from --hf-checkpoint with a fresh --save") + ".")
    if trainer.lora is not None:               # replicated adapters: rank 0's file, whatever the number of ranks
        from miles.trainer import lora as lora_mod

        lora_mod.load_files(trainer.lora, trainer.optimizer if with_optim else None, path, 0)
    else:
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
    barrier(trainer.trainer_group, trainer.device)
    logger.info("loaded checkpoint %s (schedule step %d)", path, trainer.schedule.step)
    return meta["extra"]


def save(trainer: FSDPTrainer, rollout_id: int, extra: dict) -> Path:
    """Crash-safe ``<save>/step_<rollout_id>`` written by ``trainer.save`` (collective); prunes. Returns its path."""
    if not trainer.ckpt.save:
        raise ValueError("checkpoint() needs --save DIR.")
    extra = {**extra, "rollout_id": rollout_id}
    ck = trainer.ckpt
    return save_atomic(ck.save, STEP, rollout_id, lambda d: trainer.save(d, extra), group=trainer.trainer_group,
                       device=trainer.device, keep=ck.keep_checkpoints, retain_interval=ck.save_retain_interval)


def resume(trainer: FSDPTrainer) -> dict | None:
    """Load the newest usable complete checkpoint under --load (default --save) through ``trainer.load``; returns
    its ``extra``, or None when there is none (a fresh start: with Miles's meaning, a --load not written yet is
    one). Without a ``step_*`` checkpoint, a Miles FSDP checkpoint there is read. Collective on the trainer group."""
    ck = trainer.ckpt
    flag, root = resume_root(ck, STEP, rank=trainer.trainer_rank)
    found = [p for _, p in reversed(published(root, STEP))]
    if not found:
        miles_ckpt = miles_fsdp.find(root)
        if miles_ckpt is not None:                 # written by Miles's FSDP backend: resume from it
            return miles_fsdp.load(trainer, miles_ckpt)
        if ck.load and trainer.trainer_rank == 0:  # Miles's meaning: a fresh run may name a --load not written yet
            logger.warning("--load %s: no checkpoint there yet (no complete step_* nor Miles's %s); starting from "
                           "--hf-checkpoint.", ck.load, miles_fsdp.TRACKER)
        return None
    return resume_newest(found, flag=flag, root=root, group=trainer.trainer_group, device=trainer.device,
                         rank=trainer.trainer_rank, load=trainer.load,
                         verify=lambda p: verify(p, rank=trainer.trainer_rank, world=trainer.trainer_world))
