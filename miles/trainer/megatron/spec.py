"""The Megatron backend's start-up checks of ``--spec`` and of the flags that need a GPU kernel package.

Registered with ``miles.run.preflight`` (so they run under ``--dry-run`` and at the real start, before anything is
loaded) and called again when a trainer rank builds its model (``MegatronTrainer``), where the packages must import
on that rank's own machine:

    preflight_check(cfg, config_json)   # --spec vs config.json's model_type and the families built (config/specs.py)
    kernels_check(cfg, config_json)     # --moe-grouped-gemm, DeepEP, ... vs their packages (config/kernels.py)
"""

from __future__ import annotations

from typing import Any

from miles.config.kernels import check_kernel_flags
from miles.config.specs import check_spec


def built_families() -> dict[str, str]:
    """model_type -> family name, for every family the Megatron backend builds."""
    from miles.trainer.megatron.families import FAMILIES

    return dict(FAMILIES)


def preflight_check(cfg, hf_config: dict[str, Any] | None) -> None:
    """``--spec`` against config.json (``hf_config``; skipped without one): one ``ConfigError`` line."""
    if cfg.megatron is not None and hf_config is not None:
        check_spec(cfg.megatron.spec, hf_config.get("model_type"), built_families())


def kernels_check(cfg, hf_config: dict[str, Any] | None = None) -> None:
    """The kernel-package flags against this machine: one ``ConfigError`` line for the first flag whose package does
    not import."""
    check_kernel_flags(cfg.megatron)
