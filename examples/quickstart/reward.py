"""The quickstart's reward, for reading and for ``--custom-rm-path``.

The built-in ``--rm-type quickstart`` runs the same function, ``miles.rollout.rm_hub.quickstart``.
As a custom reward (``--custom-rm-path reward.reward`` with this folder on PYTHONPATH) it has Miles's
per-sample signature ``async def reward(args, sample) -> float``.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.rm_hub.quickstart import normalize_answer, quickstart_reward

__all__ = ["normalize_answer", "quickstart_reward", "reward"]


async def reward(args: Any, sample: Any) -> float:
    return quickstart_reward(sample.response, sample.label)
