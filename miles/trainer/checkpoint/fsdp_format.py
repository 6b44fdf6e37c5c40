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

Resuming (``resume_latest``) takes the newest complete checkpoint that passes ``verify_checkpoint``
(readable ``trainer_state.json`` of this format, readable DCP ``.metadata``, every shard file present
and as long as the metadata says, a loadable RNG file) and loads without error; a corrupt one is
skipped with one warning naming it and the checkpoint used instead. Every trainer rank agrees on each
verdict, so all load the same step. When none is usable: one error naming the directory.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.api import CheckpointException

from miles.trainer.checkpoint import CheckpointWriteError, any_rank, list_checkpoints, rng_state, set_rng_state
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
    """Write one checkpoint's contents into ``path`` (collective). A failure on any rank raises on every
    rank (DCP gathers its own; the rank-local files are agreed on), so no rank is left in a collective."""
    try:
        extra_json = json.loads(json.dumps(extra))
    except TypeError as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable ({e}); got keys {sorted(extra)}.") from e
    _agreed(trainer, _try(lambda: path.mkdir(parents=True, exist_ok=True)))
    with_optim = not trainer.ckpt.no_save_optim
    _dcp_write(trainer.model, trainer.optimizer, path / "actor", trainer.group, with_optim)
    if trainer.critic is not None:
        _dcp_write(trainer.critic.model, trainer.critic.optimizer, path / "critic", trainer.group, with_optim)

    def local_files() -> None:
        (path / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), path / "rng" / f"rank{trainer.rank:05d}.pt")
        if trainer.rank == 0:
            meta = {
                "format": FORMAT, "world_size": trainer.world, "schedule": trainer.schedule.state_dict(),
                "critic_schedule": trainer.critic.schedule.state_dict() if trainer.critic is not None else None,
                "has_optim": with_optim, "has_critic": trainer.critic is not None, "extra": extra_json,
            }
            (path / "trainer_state.json").write_text(json.dumps(meta, indent=2))

    _agreed(trainer, _try(local_files))


def _try(fn) -> BaseException | None:
    try:
        fn()
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        return e
    return None


def _agreed(trainer: FSDPTrainer, err: BaseException | None) -> None:
    """Raise on every trainer rank when ``err`` is set on any (collective over the whole trainer group)."""
    if any_rank(err is not None, trainer.trainer_group, trainer.device):
        if err is not None:
            raise err
        raise CheckpointWriteError("another trainer rank failed to write its part of the checkpoint (its log says why).")


def _verify_dcp(d: Path) -> str | None:
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


def verify_checkpoint(path: Path, *, rank: int | None = None, world: int | None = None) -> str | None:
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
    for sub in ["actor"] + (["critic"] if meta.get("has_critic") else []):
        problem = _verify_dcp(path / sub)
        if problem:
            return problem
    if rank is not None and meta["world_size"] == world:
        rng_file = path / "rng" / f"rank{rank:05d}.pt"
        if rng_file.is_file():
            try:
                torch.load(rng_file, weights_only=False)
            except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
                return f"rng/{rng_file.name} is unreadable ({type(e).__name__})"
    return None


def _dcp_reason(e: CheckpointException) -> str:
    errs = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    first = errs[0] if errs else e
    return f"loading it failed: {type(first).__name__}: {' '.join(str(first).split())[:200]}"


def resume_latest(trainer: FSDPTrainer) -> dict | None:
    """Load the newest usable complete checkpoint under --load (default --save); returns its ``extra``, or
    None when there is none (a fresh start: with Miles's meaning, a --load not written yet is one). A
    checkpoint Miles's FSDP backend wrote is read too. Collective on the trainer group."""
    from miles.trainer import miles_checkpoint

    return resume_newest(trainer.ckpt, group=trainer.group, device=trainer.device, rank=trainer.rank,
                         world=trainer.world, load=lambda path: load_trainer_state(trainer, path),
                         load_miles=lambda path: miles_checkpoint.load(trainer, path))


def resume_newest(ckpt, *, group, device, rank: int, world: int, load, load_miles=None) -> dict | None:
    """The resume rule every trainer backend shares: the newest complete ``step_*`` checkpoint that verifies
    on every rank of ``group`` and loads (``load(path) -> extra``); a corrupt one is skipped with one warning;
    none usable is one error. Without any, a Miles FSDP checkpoint (``load_miles``, when given) or a fresh start."""
    from miles.trainer import miles_checkpoint

    flag, root = ("--load", ckpt.load) if ckpt.load else ("--save", ckpt.save)
    found = list_checkpoints(root) if root else []
    if not found:
        miles_ckpt = miles_checkpoint.find(root)
        if miles_ckpt is not None:  # written by Miles's FSDP backend: resume from it
            if load_miles is None:
                raise ValueError(f"{flag} {root} holds a Miles FSDP checkpoint ({miles_ckpt.name}), which this trainer "
                                 "backend cannot read: resume it with --train-backend fsdp.")
            return load_miles(miles_ckpt)
        if ckpt.load and rank == 0:  # Miles's meaning: a fresh run may name a --load not written yet
            logger.warning("--load %s: no checkpoint there yet (no complete step_* nor Miles's %s); starting from "
                           "--hf-checkpoint.", ckpt.load, miles_checkpoint.TRACKER)
        return None
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(found):
        problem = verify_checkpoint(path, rank=rank, world=world)
        if problem and rank != 0:
            logger.info("%s: %s", path, problem)
        if any_rank(problem is not None, group, device):
            skipped.append((path, problem or "unusable on another trainer rank (its log says why)"))
            continue
        try:
            extra = load(path)
        except CheckpointException as e:  # DCP gathers failures: every rank raises it alike
            skipped.append((path, _dcp_reason(e)))
            continue
        if skipped and rank == 0:
            why = "; ".join(f"{p.name}: {reason}" for p, reason in skipped)
            logger.warning("%s %s: skipped corrupt checkpoint(s) (%s); resumed from %s instead.", flag, root, why,
                           path.name)
        return extra
    why = "; ".join(f"{p.name}: {reason}" for p, reason in skipped)
    raise ValueError(f"{flag} {root}: no usable checkpoint ({why}); delete the corrupt step_* directories to start "
                     f"from --hf-checkpoint, or point {flag} at a directory with an intact checkpoint.")


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
