"""Miles's ``miles.utils.lora``: whether a run trains a LoRA adapter, and the adapter's name on the engines."""

from __future__ import annotations

from typing import Any

LORA_ADAPTER_NAME = "miles_lora"


def is_lora_enabled(args: Any) -> bool:
    """True with ``--lora-rank`` > 0 or a ``--lora-adapter-path``."""
    return (getattr(args, "lora_rank", 0) or 0) > 0 or getattr(args, "lora_adapter_path", None) is not None


def lora_rollout_enabled(args: Any) -> bool:
    """LoRA is on and the engines serve the adapter (not under ``--lora-train-only``)."""
    return is_lora_enabled(args) and not getattr(args, "lora_train_only", False)
