"""Fixtures of the Megatron backend's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def group(one_rank_group):
    """The one-rank gloo group, with megatron-core's model-parallel groups made on it and destroyed after (the
    next test's group is a new one)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    try:
        yield one_rank_group
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
