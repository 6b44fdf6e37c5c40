"""Agreement between trainer ranks while a checkpoint is written or read: every rank learns whether any rank
failed, so all of them take the same branch and none is left waiting in a collective.

    err = local_error(lambda: write_my_file())   # None, or what this rank raised
    raise_if_any(err, group, device)             # collective: raises on every rank when any rank failed

The collectives are tiny all-reduces on ``device`` (cuda for NCCL, cpu for gloo); they honour the group's timeout
on every backend, which ``barrier()`` does not. With no group, or a group of one rank, nothing is sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from miles.utils.errors import MilesError


class CheckpointWriteError(MilesError, OSError):
    """A checkpoint could not be written (full disk, read-only or missing mount, a rank's write failed)."""


def _alone(group: dist.ProcessGroup | None) -> bool:
    return group is None or not dist.is_initialized() or dist.get_world_size(group) == 1


def barrier(group: dist.ProcessGroup | None, device: torch.device | None) -> None:
    """Every rank of ``group`` has arrived (collective)."""
    if _alone(group):
        return
    dist.all_reduce(torch.zeros(1, device=device or torch.device("cpu")), group=group)


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device | None) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on at least one (an all-reduce MAX; collective)."""
    if _alone(group):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def is_rank0(group: dist.ProcessGroup | None) -> bool:
    return _alone(group) or dist.get_rank(group) == 0


def local_error(fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn`` on this rank; what it raised (DCP's ``CheckpointException`` is a ``BaseException``), or None."""
    try:
        fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - handed to raise_if_any, which raises it
        return e
    return None


def raise_if_any(err: BaseException | None, group: dist.ProcessGroup | None, device: torch.device | None) -> None:
    """Collective: when any rank of ``group`` has an error, every rank raises (its own error, or a
    ``CheckpointWriteError`` saying another rank failed)."""
    if any_rank(err is not None, group, device):
        if err is not None:
            raise err
        raise CheckpointWriteError("another trainer rank failed to write its part of the checkpoint (its log says why).")
