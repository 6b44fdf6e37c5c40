"""Dynamic-sampling filters (``--dynamic-sampling-filter-path module.function``).

A filter decides whether a finished, rewarded group is kept for training::

    def f(args, samples: list[Sample], **kwargs) -> FilterOutput | bool

(Miles's signature; ``args`` is a :class:`~miles.rollout.plugins.PluginArgs`.) A plain bool is read as
``FilterOutput(keep=bool)``. Dropped groups are counted per ``reason`` in the rollout metrics
(``rollout/dynamic_filter/drop_<reason>``, :class:`MetricGatherer`). With a filter set, the manager over-samples
(``--over-sampling-batch-size`` prompts at a time) until ``--rollout-batch-size`` groups pass, then
aborts the surplus requests. ``call_dynamic_filter`` and ``MetricGatherer`` are Miles's names
(``filter_hub.base_types``) for rollout functions that filter groups themselves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.rollout.plugins import choose_arity, load_function
from miles.types import Sample, SampleStatus


@dataclass
class FilterOutput:
    keep: bool
    reason: str | None = None


DynamicFilterOutput = FilterOutput


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> FilterOutput:
    """Keep a group only when its rewards are not all equal (GRPO learns nothing from it otherwise).

    Samples without a reward (failed, aborted) are ignored; a group with fewer than two rewards is dropped.
    """
    rewards = [s.reward for s in samples if s.reward is not None]
    if len(rewards) < 2:
        return FilterOutput(keep=False, reason="too_few_rewards")
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return FilterOutput(keep=std > 1e-8, reason=None if std > 1e-8 else "zero_std")


def check_no_aborted(args: Any, samples: list[Sample], **kwargs: Any) -> FilterOutput:
    """Drop groups with an aborted or failed sample."""
    bad = any(s.status in (SampleStatus.ABORTED, SampleStatus.FAILED) for s in samples)
    return FilterOutput(keep=not bad, reason="aborted" if bad else None)


def load_filter(path: str) -> Callable[..., Any]:
    fn = load_function(path, "--dynamic-sampling-filter-path")
    choose_arity(fn, (2,), "--dynamic-sampling-filter-path", path, "def f(args, samples, **kwargs) -> FilterOutput | bool")
    return fn


def call_filter(fn: Callable[..., Any] | None, args: Any, samples: list[Sample]) -> FilterOutput:
    """Run a filter and normalise its answer; a result that is neither FilterOutput nor bool is an error."""
    return call_dynamic_filter(fn, args, samples)


def call_dynamic_filter(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> FilterOutput:
    """Miles's ``call_dynamic_filter(fn, *args, **kwargs)``: ``fn(*args, **kwargs)`` as a FilterOutput (keep
    everything without a filter; a bool answer is ``FilterOutput(keep=answer)``; another answer is a TypeError)."""
    if fn is None:
        return FilterOutput(keep=True)
    out = fn(*args, **kwargs)
    if isinstance(out, FilterOutput):
        return out
    if isinstance(out, bool) or type(out).__name__ in ("bool_", "bool"):
        return FilterOutput(keep=bool(out))
    if hasattr(out, "keep"):  # another FilterOutput class (e.g. Miles's own)
        return FilterOutput(keep=bool(out.keep), reason=getattr(out, "reason", None))
    raise TypeError(f"--dynamic-sampling-filter-path {getattr(fn, '__qualname__', fn)} returned {type(out).__name__}; "
                    f"expected FilterOutput(keep, reason) or a bool")


class MetricGatherer:
    """Counts dynamic-filter drops by reason; ``collect()`` gives ``{"rollout/dynamic_filter/drop_<reason>": n}``
    (Miles's metric names). A drop without a reason is counted as ``filtered`` (Miles does not count it)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        self.counts[reason or "filtered"] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{reason}": n for reason, n in self.counts.items()}
