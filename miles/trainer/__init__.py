"""The trainer plane: one RL step (``step.py``) over two sibling backends (``fsdp.py``: FSDP2 over HF models;
``megatron/``: megatron-core), log-probs, the RL loss family, reference model, critic, checkpoints.

Public entry points (imported lazily, so ``import miles.trainer`` stays light):

- ``build_trainer`` (``miles.trainer.build``): the trainer of ``--train-backend``; ``train(samples, rollout_id)``,
  ``iter_weight_buckets``, ``save``/``load``/``checkpoint``/``resume``/``should_save``, ``save_hf``,
  ``state_dict_for_check``, ``offload``/``onload``.
- ``RLTrainer`` (``miles.trainer.step``): the shared step both backends implement.
- ``save_checkpoint``, ``latest_checkpoint`` (``miles.trainer.checkpoint``): crash-safe checkpoint dirs.
- Pure functions: ``miles.trainer.advantages``, ``miles.trainer.losses``, ``miles.trainer.logprobs``.

See docs/trainer.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RLTrainer", "build_trainer", "latest_checkpoint", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "build_trainer":
        from miles.trainer.build import build_trainer

        return build_trainer
    if name == "RLTrainer":
        from miles.trainer.step import RLTrainer

        return RLTrainer
    if name in ("latest_checkpoint", "save_checkpoint"):
        from miles.trainer import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'miles.trainer' has no attribute {name!r}")
