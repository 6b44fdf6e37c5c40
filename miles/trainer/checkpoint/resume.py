"""Resuming, the rule both trainer backends share: the newest usable checkpoint, an older one when it is corrupt.

    extra = resume_newest(candidates, flag="--load", root=root, verify=verify, load=load,
                          group=group, device=device, rank=rank)

``candidates`` are checkpoint directories, best first (the backend lists them: complete ``step_*`` newest first;
Megatron-LM's tracker's ``iter_*`` then older ones). For each: ``verify(path)`` (cheap: metadata, file sizes; a
reason or None) runs on every rank and the ranks agree on the verdict; then ``load(path)`` (collective; returns the
resume ``extra``). A corrupt one (a verify reason on any rank, or DCP's ``CheckpointException`` from the load) is
skipped and the next tried; resuming from an older one logs one warning naming the skipped ones and the one used.
None usable: one ``ValueError`` naming the flag, the directory and each reason.

``guard_save_dir`` keeps a run from overwriting (or pruning) the checkpoints another run left in ``--save``.
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


def guard_save_dir(ckpt: _Dirs, layout: Layout) -> None:
    """Refuse, in one line, a run whose saves would overwrite or prune checkpoints it did not resume from: with an
    explicit ``--load`` elsewhere (or a weights-only start), the ``--save`` directory must hold no checkpoint of
    ``layout``. With ``--load`` unset (or naming ``--save``) the run resumed from ``--save`` itself, so what is
    there is this run's own history."""
    if not ckpt.save or not ckpt.load or same_dir(ckpt.load, ckpt.save):
        return
    found = published(ckpt.save, layout)
    if found:
        names = ", ".join(p.name for _, p in found[-3:])
        raise ValueError(f"--save {ckpt.save} already holds checkpoints of another run ({names}), which this run "
                         f"(starting from --load {ckpt.load}) would overwrite or prune: pass --load {ckpt.save} (or "
                         "drop --load) to continue that run, or choose an empty --save directory.")
