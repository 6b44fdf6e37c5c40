"""Trainer checkpoints: one implementation of what both backends share, and each backend's format.

| module | what it holds |
|---|---|
| ``cadence.py`` | ``should_save`` (--save-interval, the last rollout) and ``to_prune`` (--keep-checkpoints, --save-retain-interval) |
| ``layout.py`` | directory naming (``step_*`` / Megatron-LM's ``iter_*``), listing, the tracker file, the crash-safe ``save_atomic`` (agree, rename, tracker, prune; cleanup and one line on failure) |
| ``resume.py`` | ``resume_newest`` (the newest usable checkpoint, an older one with a warning when it is corrupt), ``resume_root`` (``--save`` when it holds checkpoints, else ``--load``) |
| ``sync.py`` | agreement between trainer ranks (``any_rank``, ``raise_if_any``), ``CheckpointWriteError`` |
| ``faults.py`` | the save path's fault-injection points for tests (inert unless ``MILES_CKPT_KILL_AT`` is set) |
| ``rng.py`` | a process's RNG states |
| ``fsdp_format.py`` | the FSDP backend's ``step_*`` contents (DCP), ``save``/``resume`` |
| ``miles_fsdp.py`` | reading checkpoints Miles's FSDP backend wrote |

The Megatron backend's format lives with it (``miles/trainer/megatron/dist_ckpt.py``, ``torch_dist.py``,
``legacy_ckpt.py``) and uses the same ``layout``, ``resume`` and ``cadence``. See docs/trainer.md, "Checkpoints".
"""

from __future__ import annotations

from miles.trainer.checkpoint.layout import COMPLETE, latest_checkpoint, list_checkpoints, save_checkpoint
from miles.trainer.checkpoint.sync import CheckpointWriteError

__all__ = ["COMPLETE", "CheckpointWriteError", "latest_checkpoint", "list_checkpoints", "save_checkpoint"]
