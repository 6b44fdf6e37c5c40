"""``--train-memory-margin-bytes``: GPU memory the trainer leaves free once it is back on the GPU (both backends).

Miles sets torch_memory_saver's margin with ``--offload-train``: an allocation of the trainer that would
leave less than the margin free fails as out-of-memory. Here, each time a colocated trainer moves its state
back to the GPU (``Worker.onload_train``), this process's CUDA caching allocator is capped
(``torch.cuda.set_per_process_memory_fraction``) at what it holds plus what the device has free, less the
margin: the same bound for every allocation of the training step, measured when it starts.
"""

from __future__ import annotations

import torch

from miles.utils.logging import get_logger

logger = get_logger(__name__)


def allocator_fraction(*, free: int, total: int, reserved: int, margin: int) -> float | None:
    """The fraction of the device this process may hold so that ``margin`` bytes stay free (None: no cap)."""
    if margin <= 0:
        return None
    return min(1.0, max(reserved + free - margin, 0) / total)


def keep_free(device: torch.device, margin: int) -> None:
    """Cap this process's CUDA allocator on ``device`` so that ``margin`` bytes of it stay free; no-op off GPU."""
    if device.type != "cuda" or margin <= 0:
        return
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    fraction = allocator_fraction(free=free, total=total, reserved=reserved, margin=margin)
    if fraction is None:
        return
    if free < margin:
        logger.warning("--train-memory-margin-bytes %d: only %.2f GiB of %s is free, so the trainer cannot allocate "
                       "beyond the %.2f GiB it holds", margin, free / 2**30, device, reserved / 2**30)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    logger.info("--train-memory-margin-bytes %d: trainer allocator capped at %.2f GiB of %.2f GiB on %s", margin,
                fraction * total / 2**30, total / 2**30, device)
