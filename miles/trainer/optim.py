"""AdamW, the learning-rate schedule and gradient clipping for DTensor (FSDP2) parameters.

Schedule (Megatron's shape; ``s`` counts optimizer steps from 0, ``W`` = --lr-warmup-iters,
``D`` = --lr-decay-iters, defaulting to the run's total optimizer steps when known):

    s < W:       lr = lr_max * (s + 1) / W
    s >= D:      lr = min_lr
    otherwise:   p = (s - W) / (D - W);  constant: lr_max;  linear: min + (max - min)(1 - p);
                 cosine: min + (max - min) * 0.5 (1 + cos(pi p))

Weight decay applies to matrices only (parameters with ndim >= 2), not to norms and biases.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from miles.utils.logging import get_logger

logger = get_logger(__name__)


def build_adamw(module: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kw)


class LRSchedule:
    """Sets ``lr`` on an optimizer's groups for optimizer step ``s`` (see module docstring)."""

    def __init__(self, *, lr: float, min_lr: float, style: str, warmup: int, decay_iters: int | None):
        if style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {style!r} is not known; choose constant, linear or cosine.")
        if warmup < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {warmup}.")
        if decay_iters is not None and decay_iters <= warmup and style != "constant":
            raise ValueError(f"--lr-decay-iters ({decay_iters}) must exceed --lr-warmup-iters ({warmup}).")
        if style != "constant" and decay_iters is None:
            logger.warning("--lr-decay-style %s without --lr-decay-iters or a known number of steps: "
                           "the learning rate stays at --lr after warm-up.", style)
        self.lr, self.min_lr, self.style, self.warmup, self.decay_iters = lr, min_lr, style, warmup, decay_iters
        self.step = 0

    def lr_at(self, s: int) -> float:
        if s < self.warmup:
            return self.lr * (s + 1) / self.warmup
        if self.style == "constant" or self.decay_iters is None:
            return self.lr
        if s >= self.decay_iters:
            return self.min_lr
        p = (s - self.warmup) / (self.decay_iters - self.warmup)
        coeff = 1.0 - p if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return self.min_lr + (self.lr - self.min_lr) * coeff

    def apply(self, optimizer: torch.optim.Optimizer, scale: float = 1.0) -> float:
        lr = self.lr_at(self.step) * scale
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Global L2 norm of the gradients (over all shards) and, when max_norm > 0, scale them to it."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()                       # all-reduce over the mesh (the trainer group)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return float(norm)
