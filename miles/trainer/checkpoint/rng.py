"""The RNG states of one trainer process (python, numpy, torch CPU and, when present, CUDA), as a checkpoint
stores them."""

from __future__ import annotations

import random

import torch


def rng_state() -> dict:
    """RNG states of this process: python, numpy, torch CPU and (if present) CUDA."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
