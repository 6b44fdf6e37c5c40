"""The filters Miles v0.1.0's launch scripts name, with Miles's meaning.

    --dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
    --dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted

Both take ``(args, samples)`` where ``samples`` is one prompt's group (nested lists are flattened, as
generate functions that return several samples per slot produce them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from miles.rollout.filters import DynamicFilterOutput
from miles.rollout.plugins import reward_value
from miles.types import Sample, SampleStatus

__all__ = ["check_no_aborted", "check_reward_nonzero_std"]

_MIN_STD = 1e-8


def _flatten(samples: list[Any]) -> Iterator[Sample]:
    for s in samples:
        if isinstance(s, list | tuple):
            yield from _flatten(list(s))
        else:
            yield s


def check_reward_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterOutput:
    """Keep the group when the sample standard deviation (n - 1) of its rewards exceeds 1e-8.

    A group of one has no deviation and is dropped; the drop reason is ``zero_std_<reward rounded to 0.1>``
    (Miles's metric key ``rollout/dynamic_filter/drop_zero_std_1.0`` ...). Samples without a reward
    (generation or reward failed, here status FAILED) are left out of the statistic.
    """
    rewards = [float(v) for v in (reward_value(s, args) for s in _flatten(samples)) if v is not None]
    if not rewards:
        return DynamicFilterOutput(keep=False, reason="no_reward")
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else math.nan
    keep = std > _MIN_STD  # NaN (one sample) compares False
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_no_aborted(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterOutput:
    """Drop the whole group when any of its samples was aborted (e.g. an environment timeout)."""
    if any(s.status is SampleStatus.ABORTED for s in _flatten(samples)):
        return DynamicFilterOutput(keep=False, reason="group_has_aborted")
    return DynamicFilterOutput(keep=True)
