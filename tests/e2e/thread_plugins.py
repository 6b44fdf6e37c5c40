"""A ``--custom-loss-function-path`` for tests/e2e/test_cpu_threads.py: the GRPO policy gradient without clipping,
reporting the torch intra-op threads the trainer rank computes it with (``train/cpu_threads``)."""

from __future__ import annotations

import torch


def threads_loss(inp, algo):
    adv = inp.advantages if inp.advantages is not None else torch.ones_like(inp.log_probs)
    per_token = -inp.log_probs * adv
    return per_token, {"cpu_threads": torch.full_like(inp.log_probs, float(torch.get_num_threads()))}
