"""AdamW, the learning-rate schedule and gradient clipping for DTensor (FSDP2) parameters.

Schedule (Megatron's shape; ``s`` counts optimizer steps from 0, ``W`` = --lr-warmup-iters,
``D`` = --lr-decay-iters, defaulting to the run's total optimizer steps when known):

    s < W:       lr = init + (lr_max - init) * s / W      (init = --lr-warmup-init, 0 by default: Megatron's and
                                                          Miles's warm-up, whose first step runs at init)
    s >= D:      lr = min_lr
    otherwise:   p = (s - W) / (D - W);  constant: lr_max;  linear: min + (max - min)(1 - p);
                 cosine: min + (max - min) * 0.5 (1 + cos(pi p))

Weight decay applies to matrices only (parameters with ndim >= 2), not to norms and biases.

``MasterWeights`` is the bf16 recipe of plain (not FSDP2-wrapped) modules, Megatron's: fp32 master
parameters (what AdamW updates, checkpoints save and the weight sync sends), bf16 copies for the forward
and backward, bf16 gradients accumulated into fp32 ones as they arrive. It computes what FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` computes: bf16 parameters and activations
throughout (no fp32 residual stream, unlike autocast), fp32 gradients and update.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

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


class MasterWeights:
    """bf16 compute on fp32 parameters (module docstring)::

        mw = MasterWeights([model, critic_model])
        with mw.compute():            # parameters hold bf16 copies of the masters (one cast each)
            loss(model(x)).backward() # their bf16 gradients are added to fp32 ones, one parameter at a time
        optimizer.step()              # outside: the fp32 masters, with fp32 .grad

    Inside ``compute`` each parameter's ``data`` is its bf16 copy (cast from the master on entry, so any
    change to the masters, an optimizer step or a checkpoint load, is seen; on the masters' device, so
    offloading them to CPU leaves nothing behind); on exit the fp32 masters are back, the copies are
    dropped and ``.grad`` holds the fp32 sum of every backward run inside (plus the fp32 gradient the
    parameter had on entry)."""

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype = torch.bfloat16):
        seen: dict[int, nn.Parameter] = {}
        for m in modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        self.params = list(seen.values())
        self.dtype = dtype
        self.copies: list[torch.Tensor] = []
        self._grads: dict[int, torch.Tensor] = {}
        self._active = False
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: torch.Tensor) -> None:
        if not self._active or p.grad is None:
            return
        g, p.grad = p.grad, None
        acc = self._grads.get(id(p))
        if acc is None:
            self._grads[id(p)] = g.float()
        else:
            acc.add_(g)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self._active:                             # nested (a critic inside the actor's window): one window
            yield
            return
        masters = [p.data for p in self.params]
        self.copies = [torch.empty_like(m, dtype=self.dtype) for m in masters]
        with torch.no_grad():
            torch._foreach_copy_(self.copies, masters)
        for p, c in zip(self.params, self.copies):
            if p.grad is not None:                   # an fp32 gradient from before: the sum starts from it
                self._grads[id(p)], p.grad = p.grad, None
            p.data = c
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for p, m in zip(self.params, masters):
                p.data = m
                p.grad = self._grads.pop(id(p), None)
            self._grads.clear()
            self.copies = []


class LRSchedule:
    """Sets ``lr`` on an optimizer's groups for optimizer step ``s`` (see module docstring)."""

    def __init__(self, *, lr: float, min_lr: float, style: str, warmup: int, decay_iters: int | None,
                 init: float = 0.0):
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
        self.init = init
        self.step = 0

    def lr_at(self, s: int) -> float:
        if s < self.warmup:
            return self.init + (self.lr - self.init) * s / self.warmup
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
def finite_step(grad_norm: float, check: bool, what: str, log: bool = True) -> bool:
    """Whether to apply an optimizer step with this (group-wide) gradient norm: always without the check
    (``--no-check-for-nan-in-loss-and-grad``), else only when it is finite. The norm is reduced over the whole
    trainer group, so every rank decides alike."""
    if math.isfinite(grad_norm) or not check:
        return True
    if log:
        logger.warning("%s: the gradient norm is %s; this optimizer step is skipped (weights, optimizer state and LR "
                       "schedule unchanged). --no-check-for-nan-in-loss-and-grad applies such steps.", what, grad_norm)
    return False


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Global L2 norm of the gradients (over all shards) and, when max_norm > 0, scale them to it."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor) and norm.device.type == "cpu" and norm.device_mesh.device_type != "cpu":
        # --fsdp-cpu-offload: CPU shards on a GPU group, which reduces device tensors only (sum of local norm^2)
        local = norm.to_local().to(norm.device_mesh.device_type).float().pow(2)
        torch.distributed.all_reduce(local, group=norm.device_mesh.get_group())
        norm = local.sqrt().cpu()
    elif isinstance(norm, DTensor):
        norm = norm.full_tensor()                       # all-reduce over the mesh (the trainer group)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return float(norm)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of the optimizer state (fused AdamW on GPU keeps even ``step`` there)."""
    non_blocking = device.type == "cuda"
    for st in optimizer.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor):
                st[k] = v.to(device, non_blocking=non_blocking)
