"""Miles's ``filter_hub.base_types``: the filter result type, ``call_dynamic_filter`` and ``MetricGatherer``
(one implementation, :mod:`miles.rollout.filters`)."""

from __future__ import annotations

from miles.rollout.filters import DynamicFilterOutput, FilterOutput, MetricGatherer, call_dynamic_filter, call_filter

__all__ = ["DynamicFilterOutput", "FilterOutput", "MetricGatherer", "call_dynamic_filter", "call_filter"]
