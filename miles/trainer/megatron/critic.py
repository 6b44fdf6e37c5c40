"""The PPO critic on the Megatron backend: a megatron-core GPTModel backbone (same TP layout as the actor)
plus a scalar value head, replicated over TP, that starts at zero.

Everything but the model is the FSDP critic's (``miles.trainer.critic.Critic``: the clipped value loss,
its reduction, the schedule); the values are read at the same positions as the actor's log-probs. The
value head sees the same full hidden states on every TP rank, so its gradient, and the gradient flowing
back into the backbone, are complete on each rank (no TP reduction beyond ``parallel.finish_grads``).
"""

from __future__ import annotations

import torch
from torch import nn

from miles.trainer.batching import MicroBatch
from miles.trainer.critic import Critic
from miles.trainer.megatron import forward, parallel
from miles.trainer.optim import LRSchedule, build_adamw, finite_step


class MegatronValueModel(nn.Module):
    """``gpt`` (hidden states [s, b, h]) + ``value_head`` Linear(h, 1); parameter names ``gpt.<megatron name>``."""

    def __init__(self, gpt: nn.Module, hidden_size: int):
        super().__init__()
        self.gpt = gpt
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)


class MegatronCritic(Critic):
    def __init__(self, trainer, gpt: nn.Module):
        train = trainer.cfg
        self.trainer = trainer
        self.model = MegatronValueModel(gpt, trainer.shape.hidden_size).to(trainer.device)
        self.lr = train.critic_lr if train.critic_lr is not None else train.lr
        adam = dict(lr=self.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2),
                    eps=train.adam_eps, device=trainer.device)
        self.optimizer = (parallel.distributed_adamw(self.model, trainer.groups, **adam)
                          if trainer.distributed_optimizer else build_adamw(self.model, **adam))
        total = trainer.num_rollout * trainer.num_steps_per_rollout if trainer.num_rollout else None
        decay = train.lr_decay_iters or total
        self.schedule = LRSchedule(lr=self.lr, min_lr=train.min_lr, style=train.lr_decay_style,
                                   warmup=train.critic_lr_warmup_iters,  # --critic-lr-warmup-iters, as the FSDP critic
                                   decay_iters=decay, init=train.lr_warmup_init)
        self.clip_grad = train.clip_grad
        self.check_nan = train.check_for_nan_in_loss_and_grad
        self.value_clip = trainer.algo.value_clip

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        h, _, full = forward.local_hidden(self.trainer, self.model.gpt, mb)   # [n, h]: this CP rank's positions
        return full(self.model.value_head(h.to(self.model.value_head.weight.dtype)).squeeze(-1).float())   # [N]

    def step(self) -> dict[str, float]:
        parallel.finish_grads(self.model, self.trainer.groups)
        grad_norm = parallel.clip_grad_norm(self.model, self.trainer.groups, self.clip_grad)
        lr = self.schedule.apply(self.optimizer)
        if finite_step(grad_norm, self.check_nan, "critic", log=self.trainer.trainer_rank == 0):
            self.optimizer.step()
            self.schedule.advance()
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic_grad_norm": grad_norm, "critic_lr": lr}
