"""The trainer plane: FSDP2 backend, log-probs, the RL loss family, reference model, critic, checkpoints.

Public entry points (imported lazily, so ``import miles.trainer`` stays light):

- ``FSDPTrainer`` (``miles.trainer.fsdp``): build, ``train(samples, rollout_id)``, ``iter_weight_buckets``,
  ``save``/``load``/``checkpoint``/``resume``, ``save_hf``, ``offload``/``onload``.
- ``save_checkpoint``, ``latest_checkpoint`` (``miles.trainer.checkpoint``): crash-safe checkpoint dirs.
- Pure functions: ``miles.trainer.advantages``, ``miles.trainer.losses``, ``miles.trainer.logprobs``.

See docs/trainer.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDPTrainer", "latest_checkpoint", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "FSDPTrainer":
        from miles.trainer.fsdp import FSDPTrainer

        return FSDPTrainer
    if name in ("latest_checkpoint", "save_checkpoint"):
        from miles.trainer import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'miles.trainer' has no attribute {name!r}")
