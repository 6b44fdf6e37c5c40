"""How an error names a torch.distributed process group (``'trainer' (2 ranks)``), and the one line a bounded wait on
a group raises when its collective does not complete (``wait_timeout_message``).

One helper below every plane, so every bounded wait on a collective (the trainer's object gathers
``miles.trainer.collectives``, its weight gathers ``miles.trainer.weights`` / ``miles.trainer.megatron.export`` /
``.moe``, the pipeline's exchanges ``miles.trainer.megatron.pipeline``, the run's sample wire ``miles.run.wire`` and
control channel ``miles.run.control``) words a stuck or broken collective alike: what timed out, over which group,
after how long, and what to check. A group is named by its ``group_desc``
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


# what a bounded wait tells the user to check when its collective did not complete (a caller that knows better, such as
# a pipeline stage and its neighbours, names its own and ends it with LOG_HINT)
LOG_HINT = "the first error is in the log of the rank that stopped"
CHECK_RANKS = f"that every rank of the group is alive and reached this call ({LOG_HINT})"


def wait_timeout_message(what: str, group: Any, timeout: float, *, size: int | None = None,
                         error: BaseException | None = None, check: str = CHECK_RANKS) -> str:
    """The one line a bounded wait on ``group`` raises when its collective did not complete within ``timeout``
    seconds: ``"{what} over group 'trainer' (2 ranks) timed out after 600s; check {check}."``. ``error``: the
    backend's own error, when the wait raised instead of returning (gloo raises on its timeout): then "failed or
    timed out after 600s (its first line)". ``size`` as ``describe_group`` takes it."""
    how, backend = "timed out", ""
    if error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        how, backend = "failed or timed out", f" ({first})"
    return f"{what} over group {describe_group(group, size)} {how} after {timeout:g}s{backend}; check {check}."
