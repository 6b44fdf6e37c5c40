"""Trainer metrics: reduction over the trainer group, phase times, throughput and MFU.

MFU counts ``6 N`` FLOPs per trained token (forward + backward) and ``2 N`` per token of a
forward-only pass (old/ref/teacher log-probs, critic values), N = parameters a token passes through (tied
embeddings once; of a MoE's routed experts only the top-k share, :func:`active_params`) -- the count of the
reference figures in docs/benchmarks.md -- divided by the elapsed time,
the number of trainer GPUs and the GPU's dense bf16 peak (table below, or --mfu-peak-tflops).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

# The phases of one ``train`` call, in order; timed on every rank (``PhaseClock``) and reported as rank 0's
# seconds (``phase/<name>``) and the slowest rank's (``phase_max/<name>``); "metrics" is this rank's metric sums and
# the agreement on their names; the rest of ``train_time`` (the one all-gather that reduces the metric sums over the
# group together with these times) is the caller's residual.
TRAIN_PHASES = ("data", "logprobs", "advantages", "fwd_bwd", "optimizer", "metrics")


class PhaseClock:
    """``with clock("fwd_bwd"): ...`` adds the wall time of the block to ``clock.times["fwd_bwd"]``;
    ``sync`` (a device synchronise on GPU) runs at both ends, so queued kernels count where they were issued."""

    def __init__(self, sync=None) -> None:
        self.times: dict[str, float] = dict.fromkeys(TRAIN_PHASES, 0.0)
        self._sync = sync or (lambda: None)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

# dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "GH200": 989.0,
    "B200": 2250.0, "B300": 2250.0, "GB200": 2500.0,
    "A100": 312.0, "A800": 312.0, "A10G": 70.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0,
    "RTX 4090": 165.0, "RTX 3090": 71.0,
}


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The bf16 peak of ``device`` in TFLOP/s (override wins); None on CPU or an unknown GPU."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def moe_routing(config) -> tuple[int, int] | None:
    """(routed experts E, experts per token k) of an HF config (a multimodal one's ``text_config``), or None for a
    dense model."""
    config = getattr(config, "text_config", None) or config
    e = next((getattr(config, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
              if getattr(config, a, None)), None)
    k = next((getattr(config, a) for a in ("num_experts_per_tok", "moe_topk", "top_k_experts")   # Gemma 4: the last
              if getattr(config, a, None)), None)
    return (int(e), int(k)) if e and k else None


def active_params(num_params: int, expert_params: int, routing: tuple[int, int] | None) -> int:
    """Parameters a token passes through: all of them, less the unrouted ``(E - k) / E`` of the routed
    experts' weights (``expert_params``: every routed expert's, summed)."""
    if routing is None or not expert_params:
        return int(num_params)
    e, k = routing
    return int(num_params - expert_params * (e - min(k, e)) / e)


def mfu(*, num_params: int, train_tokens: float, forward_tokens: float, seconds: float, num_gpus: int,
        peak: float | None) -> float | None:
    if not peak or seconds <= 0:
        return None
    flops = 6.0 * num_params * train_tokens + 2.0 * num_params * forward_tokens
    return flops / seconds / num_gpus / (peak * 1e12)


class MetricSums:
    """Accumulates scalar tensors by name; ``values`` hands this rank's sums to the caller's one group reduction."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums[k] + v.detach().to("cpu", torch.float64)

    def values(self, keys: list[str]) -> list[float]:
        """This rank's sums of ``keys`` (0.0 for a key it has not seen), for a reduction done by the caller."""
        return [float(self.sums[k]) if k in self.sums else 0.0 for k in keys]


def step_means(keys: list[str], sums: list[float], num_steps: int) -> dict[str, float]:
    """Each key's group sum (``sums``: step by step, ``keys`` within a step), averaged over the optimizer steps."""
    k = len(keys)
    return {key: sum(sums[j * k + i] for j in range(num_steps)) / num_steps for i, key in enumerate(keys)}


def extra_metrics(names: list[str], tot: list[float], samples) -> dict[str, float]:
    """Token-mean of the reward-shaping KL / OPD reverse KL, and advantage and reward means, from the group sums
    of ``RLTrainer._extra_local`` ([token sum, mask sum per name..., reward sum, samples])."""
    out = {f"{n}_mean": tot[2 * j] / max(tot[2 * j + 1], 1.0) for j, n in enumerate(names)}
    if samples is not None:
        out["reward_mean"] = tot[-2] / max(tot[-1], 1.0)
    return out
