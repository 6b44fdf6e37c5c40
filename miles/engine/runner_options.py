"""The embedded engine's runner settings and the sizes that follow from them: ``RunnerOptions`` (what
``python -m miles.engine``'s flags set), the CUDA-graph batch buckets, the mixed prefill + decode step's token
budgets, the KV page sizes, and the dtype / KV-cache-kind resolution. No model code: the forward implementations
(``native_lm``, ``generic_lm``) and ``model_runner`` import these."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

NATIVE_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class RunnerOptions:
    device: str = "cpu"
    dtype: str = "auto"
    max_running_requests: int = 64
    max_context_len: int | None = None
    cuda_graph: bool = True
    native: bool = True            # False forces the generic HF path (for tests and odd models)
    max_total_tokens: int | None = None      # KV tokens in all (sglang --max-total-tokens): caps the slots
    cuda_graph_bs: list[int] | None = None   # decode batch sizes captured as graphs (sglang --cuda-graph-bs)
    cuda_graph_max_bs: int | None = None     # largest such batch (sglang --cuda-graph-max-bs)
    kv_cache: str = "auto"                   # "paged" | "slots" | "auto" (paged on GPU, slots on CPU)
    page_size: int = 16                      # tokens per KV page (paged cache; sglang --page-size)
    deterministic: bool = False              # batch-invariant forwards (sglang --enable-deterministic-inference)
    clamp_shared_expert: bool = True         # off: --no-activation-func-clamp-shared-expert (unclamp_shared_experts)
    mix_step_tokens: int | None = None       # prompt tokens a mixed step carries with CUDA graphs (None: MIX_STEP_TOKENS)
    enable_lora: bool = False                # serve LoRA adapters (sglang --enable-lora; miles.engine.lora)
    max_lora_rank: int | None = None         # sglang --max-lora-rank: larger adapters are refused at load
    max_loaded_loras: int | None = None      # sglang --max-loaded-loras
    lora_target_modules: list[str] | None = None   # sglang --lora-target-modules: the linears adapters may target
    experts_shared_outer_loras: bool = False       # sglang --experts-shared-outer-loras (miles.engine.lora_experts)


def graph_batch_sizes(max_slots: int, sizes: list[int] | None = None, max_bs: int | None = None) -> list[int]:
    """Decode batch sizes captured as CUDA graphs; a larger batch runs without one (as in SGLang).

    Default: 1, 2, 4, .., 32, then steps of 32, up to the slot count (or ``max_bs``)."""
    cap = min(max_slots, max_bs) if max_bs is not None else max_slots
    if sizes is None:
        sizes, b = [], 1
        while b < cap:
            sizes.append(b)
            b = b * 2 if b < 32 else b + 32
        sizes.append(cap)
    return sorted({b for b in sizes if 1 <= b <= cap})


# prompt tokens a mixed prefill + decode step carries in its CUDA graphs (paged cache): their chunk size
MIX_TOKENS = 256
# prompts a mixed step carries at most (each in its own block-table row), and the prompt tokens it carries at most
# with CUDA graphs (a step carrying more than MIX_TOKENS runs eagerly: its prompt tokens' compute outweighs the
# launches a graph saves); without graphs a mixed step carries MIX_TOKENS
MIX_RIDERS = 8
MIX_STEP_TOKENS = 1024

PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # divisors of the 64-token alignment of the decode context buckets


def resolve_kv_cache(name: str, device: torch.device) -> str:
    if name == "auto":
        return "paged" if device.type == "cuda" else "slots"
    if name not in ("paged", "slots"):
        raise ValueError(f"--kv-cache {name!r} is not one of auto, paged, slots")
    return name


def resolve_dtype(name: str, device: torch.device, config) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = getattr(torch, ckpt, None)
        return ckpt if ckpt in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype {name!r} is not one of auto, float32, bfloat16, float16")
    return table[name]

def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 40
