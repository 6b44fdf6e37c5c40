"""Building blocks of the native forward (``native_lm``, ``native_decode``): HF's RMSNorm as one fused op, RoPE's
half rotation, and the weight fusion that makes q/k/v (gate/up) one GEMM over views of a single buffer."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm as one fused ``F.rms_norm`` (statistics in fp32 inside the kernel, the weight applied before
    the single rounding to the activation dtype) where the module allows; otherwise the module itself."""
    eps = getattr(module, "variance_epsilon", None)
    w = getattr(module, "weight", None)
    if eps is None or w is None or type(module).__name__ not in _PLAIN_RMSNORMS:
        return module(x)
    if x.dtype == torch.float32 or w.dtype != x.dtype:
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight=w, eps=eps)


_PLAIN_RMSNORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
_SILU = {"SiLU", "SiLUActivation"}


def _fuse_linears(mods: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One ``[sum(out), in]`` buffer holding the weights (and biases) of ``mods``, whose parameters become views
    of it: an in-place weight update (``load_tensors``) writes the fused buffer, and one GEMM replaces several.
    None (nothing changed) when the layers cannot share one (bias on some only, other dtypes or devices)."""
    ws = [m.weight for m in mods]
    bs = [getattr(m, "bias", None) for m in mods]
    has_bias = [b is not None for b in bs]
    if any(has_bias) and not all(has_bias):
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    with torch.no_grad():
        w_all = torch.cat([w.data for w in ws])
        b_all = torch.cat([b.data for b in bs]) if all(has_bias) else None
        o = 0
        for w, b in zip(ws, bs):
            n = w.shape[0]
            w.data = w_all[o:o + n]
            if b_all is not None:
                b.data = b_all[o:o + n]
            o += n
    return w_all, b_all


def prefill_attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """Around a prefill's forward on CUDA: SDPA picks flash attention, then the memory-efficient kernel, then the math
    one, never cuDNN's. cuDNN builds an execution plan for every new shape, and a prefill's (batch, length) is new
    most of the time: on an H200 (torch 2.11) its plans cost ~6 ms of host time per attention call, ~170 ms a prefill
    of 28 layers, where flash attention starts at once."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                       set_priority=True)
