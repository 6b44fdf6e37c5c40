"""--train-memory-margin-bytes: the trainer's CUDA allocator leaves the margin free after each onload."""

from __future__ import annotations

import pytest
import torch

from miles.trainer.memory_margin import allocator_fraction, keep_free

GIB = 2**30


def test_fraction_leaves_the_margin_free():
    # 80 GiB device, this process holds 10 GiB, 50 GiB free: it may hold 10 + 50 - 3 = 57 GiB
    assert allocator_fraction(free=50 * GIB, total=80 * GIB, reserved=10 * GIB, margin=3 * GIB) == 57 / 80
    assert allocator_fraction(free=50 * GIB, total=80 * GIB, reserved=10 * GIB, margin=0) is None  # 0: no cap
    # less free than the margin: no growth beyond what is gone already (never a negative fraction)
    assert allocator_fraction(free=GIB, total=80 * GIB, reserved=0, margin=3 * GIB) == 0.0


def test_no_cap_off_gpu():
    keep_free(torch.device("cpu"), 3 * GIB)  # a CPU trainer has no CUDA allocator to cap: nothing happens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_allocation_past_the_margin_is_out_of_memory():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(dev)
    try:
        keep_free(dev, free - 512 * 2**20)          # room for about 512 MiB more
        small = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)   # 128 MiB: fits
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GIB, dtype=torch.uint8, device=dev)           # 2 GiB: past the margin
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
