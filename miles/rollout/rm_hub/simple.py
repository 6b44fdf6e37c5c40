"""``--rm-type random`` (0 or 1 uniformly, for plumbing tests) and ``deterministic_random`` (0 or 1 from a
hash of the token ids and the response, so the same sample always gets the same reward)."""

from __future__ import annotations

import hashlib
import random


def random_reward() -> int:
    return random.randint(0, 1)


def deterministic_random_reward(tokens: list[int], response: str) -> int:
    return hashlib.sha256((str(tokens) + response).encode()).digest()[0] % 2
