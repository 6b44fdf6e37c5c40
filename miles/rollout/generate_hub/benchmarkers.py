"""Miles's benchmarking generate function: responses of a random length between 32K and 64K tokens.

    --custom-generate-function-path miles.rollout.generate_hub.benchmarkers.generate_with_random_osl

Each sample ignores end-of-sequence and asks for ``max_new_tokens`` drawn uniformly from
[32768, 65536) (Miles's fixed range), to load engines with long outputs; otherwise the default's call
(:func:`miles.rollout.sglang_rollout.generate`: routed experts under R3, top-k log-probs under top-k OPD).
"""

from __future__ import annotations

import random
from typing import Any

from miles.rollout import sglang_rollout
from miles.types import Sample
from miles.utils.logging import get_logger

logger = get_logger(__name__)

MIN_OSL, MAX_OSL = 32 * 1024, 64 * 1024


async def generate_with_random_osl(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    params = {**sampling_params, "ignore_eos": True, "max_new_tokens": random.randrange(MIN_OSL, MAX_OSL)}
    out = await sglang_rollout.generate(args, sample, params)
    logger.debug("generate_with_random_osl: max_new_tokens %d, response_length %d", params["max_new_tokens"],
                 out.response_length)
    return out
