"""Crash-safe checkpoint directories.

Layout under the root (``--save``)::

    <root>/step_00000012/            a complete checkpoint (has COMPLETE)
        COMPLETE                     JSON: step, time, world size; written last
        ...                          whatever write_fn put there (see docs/trainer.md)
    <root>/.tmp.step_00000013/       a save in progress (or a crashed one): always ignored

``save_checkpoint`` makes the temporary dir (rank 0), synchronises the group, lets every rank
call ``write_fn(tmp_dir)``, synchronises again, then rank 0 writes COMPLETE, fsyncs and renames the
directory into place (an atomic rename on one filesystem) and prunes to the newest
``--keep-checkpoints``. A crash at any point before the rename leaves the previous checkpoint as
``latest_checkpoint``. The root must be on a filesystem every trainer rank sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from miles.utils.logging import get_logger

logger = get_logger(__name__)

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _barrier(group: dist.ProcessGroup | None, device: torch.device | None) -> None:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    # a tiny all-reduce rather than barrier(): it honours the group's timeout on every backend
    t = torch.zeros(1, device=device or torch.device("cpu"))
    dist.all_reduce(t, group=group)


def _is_rank0(group: dist.ProcessGroup | None) -> bool:
    return group is None or not dist.is_initialized() or dist.get_rank(group) == 0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / COMPLETE).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The newest complete checkpoint under root, or None (half-written ones are ignored)."""
    if root is None:
        return None
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str | Path, keep: int) -> None:
    if keep is None or keep <= 0:
        return
    for _, path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("pruned old checkpoint %s (--keep-checkpoints %d)", path, keep)


def save_checkpoint(
    root: str | Path, step: int, write_fn: Callable[[Path], None], *, keep: int | None = None,
    group: dist.ProcessGroup | None = None, device: torch.device | None = None,
) -> Path:
    """Write checkpoint ``step`` under root atomically (see module docstring); returns its final path.

    Every rank of ``group`` must call it; ``device`` is where the group's collectives run (cuda for NCCL).
    """
    root = Path(root)
    tmp = root / f".tmp.{step_dir_name(step)}"
    final = root / step_dir_name(step)
    if _is_rank0(group):
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)                      # leftovers of a crashed save of the same step
        tmp.mkdir()
    _barrier(group, device)
    write_fn(tmp)
    _barrier(group, device)
    if _is_rank0(group):
        world = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
        with open(tmp / COMPLETE, "w") as f:
            json.dump({"step": step, "time": time.time(), "world_size": world}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if final.exists():                          # re-saving a step (e.g. after a resume): swap it out
            old = root / f".old.{step_dir_name(step)}.{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        prune_checkpoints(root, keep or 0)
        logger.info("saved checkpoint %s", final)
    _barrier(group, device)
    return final


def rng_state() -> dict:
    """RNG states of this process: python, numpy, torch CPU and (if present) CUDA."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
