"""User plugins that misbehave, for the fault tests of ``tests/e2e/test_run_errors.py``."""

from __future__ import annotations

import asyncio
from typing import Any


async def generate_never_returns(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """A --custom-generate-function-path function that never returns (a tool call that hangs, a lost await)."""
    await asyncio.Event().wait()
