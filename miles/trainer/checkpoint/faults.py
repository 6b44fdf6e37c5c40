"""The save path's fault-injection points: a test kills a real trainer rank with SIGKILL at a named moment of a
checkpoint save. Inert unless the environment variable ``MILES_CKPT_KILL_AT`` is set (one dictionary look-up).

    MILES_CKPT_KILL_AT=<point>:<step>:<trainer rank>      e.g. shards:2:1

Points, in the order a save reaches them (``layout.save_atomic`` and the backends' writers call ``fault_point``):

    shards    inside the write: the tensor shards are on disk, the rest of the checkpoint is not (any rank)
    rename    every rank has written its part; the directory is still ``.tmp.<name>`` (rank 0 renames)
    tracker   renamed into place; ``latest_checkpointed_iteration.txt`` not updated yet (Megatron-LM's layout;
              the ``step_*`` layout has no tracker: the same moment as ``prune``)
    prune     the checkpoint is complete and published; older ones not pruned yet

``tests/multiprocess/kill_mid_save.py`` kills at each of them on both backends.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "MILES_CKPT_KILL_AT"
POINTS = ("shards", "rename", "tracker", "prune")


def fault_point(point: str, step: int, rank: int) -> None:
    """SIGKILL this process when ``MILES_CKPT_KILL_AT`` names ``point``, ``step`` and this trainer ``rank``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in POINTS or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected <point>:<step>:<trainer rank> with a point among "
                         f"{', '.join(POINTS)}; unset it outside tests.")
    if parts[0] == point and int(parts[1]) == step and int(parts[2]) == rank:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
