"""Checkpoint directories under ``--save``: naming, listing, the tracker file, the crash-safe save and pruning, for
both layouts the trainer backends write.

    STEP (FSDP backend)                              ITER (Megatron backend: Megatron-LM's layout, as Miles)
    <root>/step_00000012/   complete: has COMPLETE   <root>/iter_0000012/                  complete once renamed
        COMPLETE            JSON, written last       <root>/latest_checkpointed_iteration.txt  the newest, written last
    <root>/.tmp.step_00000013/  in progress/killed   <root>/.tmp.iter_0000013/             in progress or killed

``save_atomic(root, layout, step, write_fn, ...)``: rank 0 makes ``.tmp.<name>``; every rank of the group calls
``write_fn(tmp)``; the ranks agree that all succeeded; rank 0 writes COMPLETE (STEP), fsyncs and renames the
directory into place (atomic on one filesystem; an existing one of the same step is swapped out), writes the tracker
atomically (ITER), then prunes (``cadence.to_prune``). A kill at any moment leaves the previous checkpoint the
newest complete one (``faults.py`` names the moments; ``tests/multiprocess/kill_mid_save.py`` kills at each).

A save that fails on any rank (a full disk, a read-only mount, a rank that could not write its part) fails on
every rank alike: rank 0 removes the ``.tmp`` directory, then every rank raises ``CheckpointWriteError`` with one
line naming the checkpoint and the root ("no space left on device" when the filesystem is full), so the disk is
not left full and no collective is left waiting. The root must be on a filesystem every trainer rank sees.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from miles.trainer.checkpoint.cadence import to_prune
from miles.trainer.checkpoint.faults import fault_point
from miles.trainer.checkpoint.sync import CheckpointWriteError, any_rank, barrier, is_rank0, local_error
from miles.utils.logging import get_logger

logger = get_logger(__name__)

COMPLETE = "COMPLETE"
TRACKER = "latest_checkpointed_iteration.txt"
_FULL_BELOW = 16 << 20  # a failed write with less than this free on the filesystem: reported as a full disk


@dataclass(frozen=True)
class Layout:
    """How one backend names its checkpoint directories and marks them complete."""

    prefix: str         # "step" or "iter"
    digits: int         # zero-padded width of the step
    marker: bool        # a COMPLETE file inside (written last)
    tracker: bool       # latest_checkpointed_iteration.txt beside them (written last)

    def name(self, step: int) -> str:
        return f"{self.prefix}_{step:0{self.digits}d}"

    def step_of(self, name: str) -> int | None:
        m = re.fullmatch(rf"{self.prefix}_(\d{{{self.digits},}})", name)
        return int(m.group(1)) if m else None


STEP = Layout("step", 8, marker=True, tracker=False)
ITER = Layout("iter", 7, marker=False, tracker=True)


def published(root: str | Path | None, layout: Layout) -> list[tuple[int, Path]]:
    """(step, dir) of the checkpoints under ``root`` that a save finished (renamed into place; with COMPLETE for
    STEP), oldest first. ``.tmp.*`` directories are never listed."""
    if root is None or not Path(root).is_dir():
        return []
    out = []
    for child in Path(root).iterdir():
        step = layout.step_of(child.name)
        if step is not None and child.is_dir() and (not layout.marker or (child / COMPLETE).is_file()):
            out.append((step, child))
    return sorted(out)


def list_checkpoints(root: str | Path | None) -> list[tuple[int, Path]]:
    """Complete ``step_*`` checkpoints under root, oldest first."""
    return published(root, STEP)


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The newest complete ``step_*`` checkpoint under root, or None (half-written ones are ignored)."""
    found = published(root, STEP)
    return found[-1][1] if found else None


def read_tracker(root: str | Path) -> int | str | None:
    """The tracker's iteration, ``"release"``, or None without a tracker; a garbled one is one error."""
    f = Path(root) / TRACKER
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise ValueError(f"{root}/{TRACKER} holds {text[:40]!r}, not an iteration number nor 'release'; restore it "
                         "(the newest complete iter_* directory) or point the flag elsewhere.")
    return int(text)


# ----------------------------------------------------------------------------- the crash-safe save
def save_atomic(root: str | Path, layout: Layout, step: int, write_fn: Callable[[Path], None], *,
                group: dist.ProcessGroup | None = None, device: torch.device | None = None, keep: int | None = None,
                retain_interval: int | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` crash-safely (see the module docstring); returns its final path.

    Every rank of ``group`` must call it; ``device`` is where the group's collectives run (cuda for NCCL).
    ``write_fn`` must fail alike on every rank (or not at all) when it runs collectives itself
    (``sync.raise_if_any``). Raises ``CheckpointWriteError`` on every rank when the save failed on any.
    """
    root = Path(root)
    name = layout.name(step)
    tmp, final = root / f".tmp.{name}", root / name
    rank = dist.get_rank(group) if (group is not None and dist.is_initialized()) else 0
    rank0 = is_rank0(group)

    def start() -> None:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)                          # leftovers of a killed save of the same step
        tmp.mkdir()

    err = local_error(start) if rank0 else None
    _check(err, root, layout, step, tmp, group, device)
    err = local_error(lambda: write_fn(tmp))
    _check(err, root, layout, step, tmp, group, device)
    if rank0:
        fault_point("rename", step, rank)
        err = local_error(lambda: _publish(root, layout, step, tmp, final, group, rank))
    _check(err, root, layout, step, tmp, group, device)
    if rank0:
        fault_point("prune", step, rank)
        prune(root, layout, step, keep, retain_interval)
        logger.info("saved checkpoint %s", final)
    return final


def save_checkpoint(root: str | Path, step: int, write_fn: Callable[[Path], None], *, keep: int | None = None,
                    group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                    retain_interval: int | None = None) -> Path:
    """``save_atomic`` in the ``step_*`` layout."""
    return save_atomic(root, STEP, step, write_fn, group=group, device=device, keep=keep,
                       retain_interval=retain_interval)


def _check(err: BaseException | None, root: Path, layout: Layout, step: int, tmp: Path,
           group: dist.ProcessGroup | None, device: torch.device | None) -> None:
    """Every rank learns whether any rank failed; then rank 0 removes the temporary dir and all raise one line."""
    if not any_rank(err is not None, group, device):
        return
    if is_rank0(group):
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(group, device)                               # the .tmp dir is gone before anyone reports
    raise CheckpointWriteError(describe_write_failure(root, layout, step, err)) from err


def _publish(root: Path, layout: Layout, step: int, tmp: Path, final: Path, group: dist.ProcessGroup | None,
             rank: int) -> None:
    """Rank 0: COMPLETE (STEP), fsync, rename into place (swapping out an existing one of the same step), then the
    tracker (ITER), each made durable before the next."""
    if layout.marker:
        world = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
        _write_durably(tmp / COMPLETE, json.dumps({"step": step, "time": time.time(), "world_size": world}))
    _fsync_dir(tmp)
    old = None
    if final.exists():                                   # re-saving a step (after a resume): swap it out
        old = root / f".old.{final.name}.{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fault_point("tracker", step, rank)
    if layout.tracker:
        tracker_tmp = root / f".{TRACKER}.tmp"
        _write_durably(tracker_tmp, str(step))
        os.replace(tracker_tmp, root / TRACKER)
        _fsync_dir(root)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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


def prune(root: Path, layout: Layout, newest: int, keep: int | None, retain_interval: int | None) -> None:
    """Delete what ``cadence.to_prune`` says among the published checkpoints up to ``newest`` (the one just saved;
    newer ones, left by an earlier attempt of this run, are replaced when their step is saved again)."""
    found = dict(p for p in published(root, layout) if p[0] <= newest)
    for step in to_prune(list(found), keep, retain_interval):
        shutil.rmtree(found[step], ignore_errors=True)
        logger.info("pruned old checkpoint %s (--keep-checkpoints %d%s)", found[step], keep,
                    f", --save-retain-interval {retain_interval}" if retain_interval else "")


# ----------------------------------------------------------------------------- one line for a failed save
def errnos(exc: BaseException | None) -> set[int]:
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


def _last_complete(root: Path, layout: Layout) -> Path | None:
    if layout.tracker:
        try:
            tracked = read_tracker(root)
        except (OSError, ValueError):
            tracked = None
        return root / layout.name(tracked) if isinstance(tracked, int) else None
    found = published(root, layout)
    return found[-1][1] if found else None


def describe_write_failure(root: Path, layout: Layout, step: int, exc: BaseException | None) -> str:
    """One line for a failed save: a full disk, another OS error, or a failure on another rank."""
    name = layout.name(step)
    free = _free_bytes(root)
    where = f"checkpoint {name} under {root}"
    last = _last_complete(root, layout)
    tail = f"the partial .tmp.{name} was removed" + (
        f"; the last complete checkpoint {last.name} is intact" if last is not None else "")
    if layout.tracker and last is not None:
        tail += f" ({TRACKER} still names it)"
    nums = errnos(exc)
    full = bool(nums & {errno.ENOSPC, errno.EDQUOT})
    if not nums and exc is not None:  # torch.save reports a full disk without an errno: judge by the free space
        full = free is not None and free < _FULL_BELOW
    if full:
        size = f"; the previous checkpoint takes {_human(_dir_bytes(last))}" if last is not None and last.is_dir() else ""
        return (f"no space left on device writing {where} ({_human(free or 0)} free there{size}); {tail}. "
                "Free space, lower --keep-checkpoints, pass --no-save-optim, or choose another --save.")
    if exc is None:
        return f"another trainer rank failed to write {where} (its log says why); {tail}."
    text = " ".join(str(exc).split())[:300]
    return f"cannot write {where}: {type(exc).__name__}: {text}; {tail}. Check --save is writable on every rank."


def read_trainer_state(path: Path) -> dict:
    """``trainer_state.json`` of a ``step_*`` checkpoint (both backends write one); one error naming the fix when
    ``path`` is not such a checkpoint."""
    meta_path = Path(path) / "trainer_state.json"
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a trainer checkpoint (no trainer_state.json); pass a step_* directory "
                         "written by --save, or the --save root to pick the newest complete one.")
    return json.loads(meta_path.read_text())
