"""Resuming, the rule both trainer backends share: the newest usable checkpoint, an older one when it is corrupt.

    extra = resume_newest(candidates, flag="--load", root=root, verify=verify, load=load,
                          group=group, device=device, rank=rank)

``candidates`` are checkpoint directories, best first (the backend lists them: complete ``step_*`` newest first;
Megatron-LM's tracker's ``iter_*`` then older ones). For each: ``verify(path)`` (cheap: metadata, file sizes; a
reason or None) runs on every rank and the ranks agree on the verdict; then ``load(path)`` (collective; returns the
resume ``extra``). A corrupt one (a verify reason on any rank, or DCP's ``CheckpointException`` from the load) is
skipped and the next tried; resuming from an older one logs one warning naming the skipped ones and the one used.
None usable: one ``ValueError`` naming the flag, the directory and each reason.

``resume_root`` picks the directory: ``--save`` when it holds checkpoints (the run's own, after a relaunch), else
``--load``; so a run never overwrites or prunes checkpoints it did not resume from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from miles.trainer.checkpoint.layout import Layout, published
from miles.trainer.checkpoint.sync import any_rank
from miles.utils.logging import get_logger

logger = get_logger(__name__)


class _Dirs(Protocol):
    save: str | None
    load: str | None


def load_failure(e: CheckpointException) -> str:
    """Why a DCP load failed, in a few words (its first failure)."""
    errs = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    first = errs[0] if errs else e
    return f"loading it failed: {type(first).__name__}: {' '.join(str(first).split())[:200]}"


def resume_newest(candidates: list[Path], *, flag: str, root: str | Path, verify: Callable[[Path], str | None],
                  load: Callable[[Path], Any], group: dist.ProcessGroup | None, device: torch.device | None,
                  rank: int, fix: str | None = None, warn: bool = True) -> Any:
    """``load(path)`` of the first candidate that verifies on every rank and loads; see the module docstring.
    ``fix``: the advice of the error when none is usable; ``warn=False``: no warning for skipped ones (a check
    that only looks, such as the dry run's)."""
    skipped: list[tuple[Path, str]] = []
    for path in candidates:
        problem = verify(path)
        if problem and rank != 0:
            logger.info("%s: %s", path, problem)
        if any_rank(problem is not None, group, device):
            skipped.append((path, problem or "unusable on another trainer rank (its log says why)"))
            continue
        try:
            extra = load(path)
        except CheckpointException as e:         # DCP gathers failures: every rank raises it alike
            skipped.append((path, load_failure(e)))
            continue
        if skipped and rank == 0 and warn:
            logger.warning("%s %s: skipped corrupt checkpoint(s) (%s); resumed from %s instead.", flag, root,
                           _reasons(skipped), path.name)
        return extra
    raise ValueError(f"{flag} {root}: no usable checkpoint ({_reasons(skipped)}); "
                     + (fix or f"delete the corrupt ones to start from --hf-checkpoint, or point {flag} at a "
                                "directory with an intact checkpoint."))


def _reasons(skipped: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{p.name}: {reason}" for p, reason in skipped)


def same_dir(load: str | Path, save: str | Path) -> bool:
    """``--load`` reads ``--save``'s checkpoints: the same directory, or one checkpoint directory inside it."""
    a, b = Path(load).resolve(), Path(save).resolve()
    return a == b or a.parent == b


def resume_root(ckpt: _Dirs, layout: Layout, *, rank: int) -> tuple[str, str | None]:
    """(flag, directory) a run resumes from. ``--save`` when it already holds checkpoints of ``layout``: that is
    the run's own history (a relaunch after a crash, ``sbatch --requeue``, ``torchrun --max-restarts``), and a run
    never overwrites or prunes checkpoints it did not resume from. Otherwise ``--load`` (default ``--save``): a
    ``--load`` naming another directory is where a fresh run starts, as torchtitan's initial load path."""
    if ckpt.save and ckpt.load and not same_dir(ckpt.load, ckpt.save):
        found = published(ckpt.save, layout)
        if found:
            if rank == 0:
                names = ", ".join(p.name for _, p in found[-3:])
                logger.warning("--save %s already holds checkpoints (%s): resuming from them rather than from --load "
                               "%s (a relaunch continues its own run); choose an empty --save to start from --load.",
                               ckpt.save, names, ckpt.load)
            return "--save", ckpt.save
    return ("--load", ckpt.load) if ckpt.load else ("--save", ckpt.save)
