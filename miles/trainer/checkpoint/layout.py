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

A save that fails on any rank (a full disk, a read-only mount, a rank that could not write its
shard) fails on every rank alike: the ranks agree on the outcome before renaming, rank 0 removes the
``.tmp`` directory, and every rank raises ``CheckpointWriteError`` (one line naming the root; "no
space left on device" when the filesystem is full), so no collective is left waiting.
"""

from __future__ import annotations

import errno
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
from torch.distributed.checkpoint.api import CheckpointException

from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_FULL_BELOW = 16 << 20  # a failed write with less than this free on the filesystem: reported as a full disk


class CheckpointWriteError(MilesError, OSError):
    """A checkpoint could not be written (full disk, read-only or missing mount, a rank's write failed)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _barrier(group: dist.ProcessGroup | None, device: torch.device | None) -> None:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    # a tiny all-reduce rather than barrier(): it honours the group's timeout on every backend
    t = torch.zeros(1, device=device or torch.device("cpu"))
    dist.all_reduce(t, group=group)


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device | None) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on at least one (an all-reduce MAX; collective)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def _errnos(exc: BaseException | None) -> set[int]:
    """errno values anywhere in ``exc``: its cause/context chain and a DCP CheckpointException's failures."""
    out: set[int] = set()
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            out.add(e.errno)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])
    return out


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe_write_failure(root: Path, step: int, exc: BaseException | None) -> str:
    """One line for a failed save: a full disk, another OS error, or a failure on another rank."""
    free = _free_bytes(root)
    where = f"checkpoint {step_dir_name(step)} under {root}"
    last = latest_checkpoint(root)
    tail = f"the partial .tmp.{step_dir_name(step)} was removed" + (
        f"; the last complete checkpoint {last.name} is intact" if last else "")
    nums = _errnos(exc)
    full = bool(nums & {errno.ENOSPC, errno.EDQUOT})
    if not nums and exc is not None:  # torch.save reports a full disk without an errno: judge by the free space
        full = free is not None and free < _FULL_BELOW
    if full:
        size = f"; the previous checkpoint takes {_human(_dir_bytes(last))}" if last else ""
        return (f"no space left on device writing {where} ({_human(free or 0)} free there{size}); {tail}. "
                "Free space, lower --keep-checkpoints, pass --no-save-optim, or choose another --save.")
    if exc is None:
        return f"another trainer rank failed to write {where} (its log says why); {tail}."
    text = " ".join(str(exc).split())[:300]
    return f"cannot write {where}: {type(exc).__name__}: {text}; {tail}. Check --save is writable on every rank."


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


def prune_checkpoints(root: str | Path, keep: int, retain_interval: int | None = None) -> None:
    """Keep the newest ``keep``; steps that are multiples of ``retain_interval`` (--save-retain-interval) stay too."""
    if keep is None or keep <= 0:
        return
    for step, path in list_checkpoints(root)[:-keep]:
        if retain_interval and step % retain_interval == 0:
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("pruned old checkpoint %s (--keep-checkpoints %d)", path, keep)


def save_checkpoint(
    root: str | Path, step: int, write_fn: Callable[[Path], None], *, keep: int | None = None,
    group: dist.ProcessGroup | None = None, device: torch.device | None = None, retain_interval: int | None = None,
) -> Path:
    """Write checkpoint ``step`` under root atomically (see module docstring); returns its final path.

    Every rank of ``group`` must call it; ``device`` is where the group's collectives run (cuda for NCCL).
    ``write_fn`` must fail alike on every rank (or not at all) when it runs collectives itself.
    Raises ``CheckpointWriteError`` on every rank when the save failed on any.
    """
    root = Path(root)
    tmp = root / f".tmp.{step_dir_name(step)}"
    final = root / step_dir_name(step)
    rank0 = _is_rank0(group)
    err: BaseException | None = None
    if rank0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)                  # leftovers of a crashed save of the same step
            tmp.mkdir()
        except OSError as e:
            err = e
    _check(err, root, step, tmp, group, device)
    try:
        write_fn(tmp)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - cleaned up, then raised
        err = e
    _check(err, root, step, tmp, group, device)
    if rank0:
        try:
            _finish(root, step, tmp, final, group)
        except OSError as e:
            err = e
    _check(err, root, step, tmp, group, device)
    if rank0:
        prune_checkpoints(root, keep or 0, retain_interval)
        logger.info("saved checkpoint %s", final)
    return final


def _check(err: BaseException | None, root: Path, step: int, tmp: Path, group: dist.ProcessGroup | None,
           device: torch.device | None) -> None:
    """Every rank learns whether any rank failed; then rank 0 removes the temporary dir and all raise."""
    if not any_rank(err is not None, group, device):
        return
    message = describe_write_failure(root, step, err)
    if _is_rank0(group):
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group, device)                          # the .tmp dir is gone before anyone reports
    raise CheckpointWriteError(message) from err


def _finish(root: Path, step: int, tmp: Path, final: Path, group: dist.ProcessGroup | None) -> None:
    """Rank 0: COMPLETE, fsync, rename into place (swapping out an existing step of the same number)."""
    world = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
    with open(tmp / COMPLETE, "w") as f:
        json.dump({"step": step, "time": time.time(), "world_size": world}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if final.exists():                              # re-saving a step (e.g. after a resume): swap it out
        old = root / f".old.{step_dir_name(step)}.{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
