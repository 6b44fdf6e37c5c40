"""Miles's ``miles.utils.dumper_utils``, the part its rollout plugins call (Miles's verifiers example).

    await dumper_utils.configure_sglang(args)   # before a rollout: turn on SGLang's tensor dumper if asked
    env = dumper_utils.get_sglang_env(args)     # the engines' environment for it

Miles's tensor dumper (``--dumper-enable``, ``--dumper-inference``, ...) is not provided: those flags are
refused by name at parse time, so in a run the dumper is never enabled and both calls do nothing, as Miles's do
with the dumper off. Args that do ask for it (set by hand) get one line saying it is not provided.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["DumperPhase", "configure_sglang", "get_sglang_env"]


class DumperPhase(enum.Enum):
    INFERENCE = "inference"
    FWD_ONLY = "fwd_only"
    FWD_BWD = "fwd_bwd"


def _check_off(args: Any, phase: DumperPhase) -> None:
    enabled = bool(getattr(args, "dumper_enable", False))
    raw = getattr(args, f"dumper_{phase.value}", None)
    if enabled or raw:
        raise ValueError(f"the tensor dumper (--dumper-enable / --dumper-{phase.value.replace('_', '-')}) is not "
                         "provided by miles: drop those settings.")


def get_sglang_env(args: Any) -> dict[str, str]:
    """The dumper's environment for the engines: none (the dumper is off)."""
    _check_off(args, DumperPhase.INFERENCE)
    return {}


async def configure_sglang(args: Any) -> None:
    """Configure the engines' dumper: nothing to do (the dumper is off)."""
    _check_off(args, DumperPhase.INFERENCE)
