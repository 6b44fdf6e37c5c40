"""How an error names a torch.distributed process group: ``'trainer' (2 ranks)``.

One helper below every plane, so the trainer's bounded object gathers (``miles.trainer.collectives``) and the run's
sample wire (``miles.run.wire``) word a stuck or broken collective alike. A group is named by its ``group_desc``
(``miles.spmd.groups`` gives every group of the job one: trainer, trainer_cpu, engine<i>, control), else by its
global ranks; ``None`` (torch's default group) is ``'default'``.
"""

from __future__ import annotations

from typing import Any


def group_name(group: Any) -> str:
    """``group``'s name, unquoted: its ``group_desc``; ``ranks [0, 1]`` when it has none; ``default`` for ``None``."""
    if group is None:
        return "default"
    import torch.distributed as dist

    name = getattr(group, "group_desc", None)
    if name and name != "undefined":            # torch's placeholder for a group made without a description
        return name
    try:
        return f"ranks {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):          # not a group of this process's default group
        return "unknown"


def describe_group(group: Any, size: int | None = None) -> str:
    """``group`` as an error names it: ``'trainer' (2 ranks)``. ``size`` is the group's size when the caller has it;
    otherwise it is read from torch (and left out when this rank cannot read it)."""
    if size is None:
        import torch.distributed as dist

        try:
            size = dist.get_world_size(group)
        except (RuntimeError, ValueError):
            return f"'{group_name(group)}'"
    return f"'{group_name(group)}' ({size} ranks)"
