"""When a checkpoint is written and which ones are kept: one rule for both trainer backends and the run loop.

- ``should_save``: ``--save-interval N`` saves after every N-th rollout (rollout ids N-1, 2N-1, ...) and always
  after the last one (``--num-rollout``); nothing without ``--save``.
- ``to_prune``: after a save, the newest ``--keep-checkpoints`` stay, and so does every checkpoint whose step (the
  rollout id) is a multiple of ``--save-retain-interval`` (step 0 included). This is Megatron-LM's meaning of
  ``--save-retain-interval``, which Miles's Megatron backend uses (after each save the previous checkpoint is
  deleted unless its iteration is a multiple of the interval: ``--keep-checkpoints 1``); ``--keep-checkpoints``
  is this project's (0 keeps every checkpoint).
"""

from __future__ import annotations

from typing import Protocol


class _Cadence(Protocol):
    save: str | None
    save_interval: int
    keep_checkpoints: int
    save_retain_interval: int | None


def should_save(ckpt: _Cadence, rollout_id: int, num_rollout: int | None) -> bool:
    """Whether the checkpoint after ``rollout_id`` is due (``ckpt``: the checkpoint flags, ``CheckpointConfig``)."""
    if not ckpt.save:
        return False
    last = num_rollout is not None and rollout_id + 1 >= num_rollout
    return last or (ckpt.save_interval > 0 and (rollout_id + 1) % ckpt.save_interval == 0)


def to_prune(steps: list[int], keep: int | None, retain_interval: int | None) -> list[int]:
    """The steps among ``steps`` (any order) that pruning deletes: all but the newest ``keep`` (None or <= 0 keeps
    all), except multiples of ``retain_interval``."""
    if not keep or keep <= 0:
        return []
    older = sorted(steps)[:-keep]
    return [s for s in older if not (retain_interval and s % retain_interval == 0)]
