"""The anchor every GPU benchmark prints first: how fast the machine of this call was, to compare runs across
sessions and cards (device-to-device copy bandwidth of 1 GiB, a bf16 8192^3 matmul; best of 10, CUDA events)."""

from __future__ import annotations

import json

import torch


def anchor(device: str) -> dict:
    """``{"copy_TB_s", "bf16_matmul_TFLOP_s"}`` of ``device`` (printed as one JSON line), ``{}`` off CUDA. The
    tensors are freed before returning, so what runs next has the memory."""
    if not str(device).startswith("cuda"):
        return {}
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return min(times)
    copy_s = best(lambda: y.copy_(x))
    mm_s = best(lambda: a @ b)
    out = {"copy_TB_s": round(2 * x.numel() * 2 / copy_s / 1e12, 2), "bf16_matmul_TFLOP_s": round(2 * 8192**3 / mm_s / 1e12, 1),
           "card": torch.cuda.get_device_name(device)}
    x = y = a = b = None  # noqa: F841 - freed before the benchmark proper starts
    torch.cuda.empty_cache()
    print(json.dumps({"anchor": out}), flush=True)
    return out
