"""Miles's ``filter_hub.base_types``: the filter result type, shared with :mod:`miles.rollout.filters`."""

from __future__ import annotations

from miles.rollout.filters import DynamicFilterOutput, FilterOutput, call_filter

__all__ = ["DynamicFilterOutput", "FilterOutput", "call_filter"]
