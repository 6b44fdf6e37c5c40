"""Gradient accumulation over micro-batches without per-micro-batch FSDP2 traffic.

FSDP2's defaults are right for one forward/backward per step: every block all-gathers its parameters
before its forward, frees them after it, all-gathers again for its backward, and reduce-scatters its
gradients after it. With ``--micro-batch-size 1`` a step is as many passes as samples, and on a small
model those collectives (plus their hooks) are the whole cost: with 2 gloo ranks, 128 samples of a
0.8M-parameter model took 3.4 s per step against 0.25 s with ``--use-dynamic-batch-size``
(``benchmarks/micro_batch.py``, docs/benchmarks.md).

``Accumulation`` keeps the math (gradients summed over the step's micro-batches, one optimizer step,
the same loss normalisation) and changes only when FSDP communicates, when the unsharded parameters
and gradients fit the budget below:

- parameters stay unsharded from the first micro-batch's all-gather to the last backward
  (``set_reshard_after_forward(False)`` / ``set_reshard_after_backward``);
- gradients accumulate unsharded and are reduce-scattered once, in the last micro-batch's backward
  (``set_requires_gradient_sync`` true only there), so every rank still runs the same collectives in
  the same order (the micro-batch count is padded group-wide).

Budget: always on CPU (each rank already held the full model in host memory when loading it); on a
GPU when the full parameters (in their compute dtype) plus, for training, full fp32 gradients take at
most ``GPU_FRACTION`` of the device's memory. Larger models keep FSDP's per-micro-batch behaviour
(ZeRO-3 memory), which is what they need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

GPU_FRACTION = 0.25


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unsharded_bytes(model: nn.Module, *, with_grads: bool, param_dtype: torch.dtype | None) -> int:
    """Bytes the full (unsharded) parameters take in ``param_dtype`` (default: their own), plus fp32
    gradients of the trainable ones when ``with_grads``."""
    total = 0
    for p in model.parameters():
        n = p.numel()                                        # a DTensor's numel is the global one
        total += n * (param_dtype.itemsize if param_dtype is not None else p.element_size())
        if with_grads and p.requires_grad:
            total += n * 4
    return total


def fits(model: nn.Module, device: torch.device, *, with_grads: bool, param_dtype: torch.dtype | None) -> bool:
    """Whether ``model`` may stay unsharded across micro-batches on ``device`` (module docstring)."""
    if device.type != "cuda":
        return True
    budget = GPU_FRACTION * torch.cuda.get_device_properties(device).total_memory
    return unsharded_bytes(model, with_grads=with_grads, param_dtype=param_dtype) <= budget


def _restore(modules: list[nn.Module]) -> None:
    """FSDP2's defaults as ``fully_shard`` set them on one model: blocks reshard after forward, the root
    (listed first by ``modules()``) does not; all reshard after backward and reduce their gradients."""
    for i, m in enumerate(modules):
        m.set_reshard_after_forward(i != 0, recurse=False)
        m.set_reshard_after_backward(True, recurse=False)
        m.set_requires_gradient_sync(True, recurse=False)
    for m in modules:
        m.reshard()


class Accumulation:
    """One optimizer step of ``num_micro_batches`` forward/backward passes over ``models``::

        with Accumulation([model, critic_model], n, enabled=fits(...)) as acc:
            for i, mb in enumerate(mbs):
                acc.before_backward(i)
                loss(mb).backward()

    Disabled, it changes nothing. Enabled, see the module docstring (with one micro-batch this still
    saves the blocks' second all-gather, for the backward); on exit every module is resharded and
    FSDP's defaults are restored (also when the step raised).
    """

    def __init__(self, models: list[nn.Module], num_micro_batches: int, *, enabled: bool):
        self.per_model = [mods for mods in (_fsdp_modules(model) for model in models) if mods]
        self.modules = [m for mods in self.per_model for m in mods]
        self.num = num_micro_batches
        self.enabled = enabled and num_micro_batches > 0 and bool(self.modules)

    def __enter__(self) -> Accumulation:
        if self.enabled:
            for m in self.modules:
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)
                m.set_requires_gradient_sync(False, recurse=False)
        return self

    def before_backward(self, index: int) -> None:
        """Call before the backward of micro-batch ``index`` (0-based): the last one syncs and reshards."""
        if self.enabled and index == self.num - 1:
            for m in self.modules:
                m.set_reshard_after_backward(True, recurse=False)
                m.set_requires_gradient_sync(True, recurse=False)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            for mods in self.per_model:
                _restore(mods)


@contextlib.contextmanager
def unsharded_forward(model: nn.Module, num_micro_batches: int, *, enabled: bool) -> Iterator[None]:
    """Forward-only passes: all-gather once, keep the parameters through every micro-batch, reshard at
    the end (restoring FSDP's defaults). Disabled or with one micro-batch it changes nothing."""
    modules = _fsdp_modules(model)
    on = enabled and num_micro_batches > 1 and bool(modules)
    if on:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        if on:
            _restore(modules)
