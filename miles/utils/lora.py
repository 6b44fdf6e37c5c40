"""Miles's ``miles.utils.lora``: whether a run trains a LoRA adapter, and the adapter's name on the engines."""

from __future__ import annotations

from typing import Any

LORA_ADAPTER_NAME = "miles_lora"


def is_lora_enabled(args: Any) -> bool:
    """True with ``--lora-rank`` > 0 or a ``--lora-adapter-path``."""
    return (getattr(args, "lora_rank", 0) or 0) > 0 or getattr(args, "lora_adapter_path", None) is not None


def lora_rollout_enabled(args: Any) -> bool:
    """LoRA is on and the engines serve the adapter (not under ``--lora-train-only``). Miles's engines serve it in every
    LoRA run; here they do with ``--sglang-enable-lora`` (otherwise they hold merged weights and know no adapter:
    ``miles.config.sglang.serves_lora_adapters``), so a plugin names ``LORA_ADAPTER_NAME`` only then."""
    return (is_lora_enabled(args) and not getattr(args, "lora_train_only", False)
            and bool(getattr(args, "sglang_enable_lora", False)))
