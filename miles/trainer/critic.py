"""The PPO critic: the HF backbone plus a scalar value head, sharded on the actor's ranks.

``V_t`` for response token t is read at the same position as the actor's log-prob of that token
(the state before the token was produced). The head starts at zero, so the first values are 0.
The critic has its own AdamW (``--critic-lr``, default --lr) and the actor's schedule shape, and is
trained on the same micro-batches as the actor with the clipped value loss (``losses.value_loss``).
"""

from __future__ import annotations

import torch
from torch import nn

from miles.trainer import modeling
from miles.trainer.batching import MicroBatch
from miles.trainer.losses import Reducer, value_loss
from miles.trainer.optim import LRSchedule, build_adamw, clip_grad_norm, finite_step


class ValueModel(nn.Module):
    """HF backbone (no LM head) + Linear(hidden, 1); forward returns values [N] at ``logit_index``."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logit_index: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                            **modeling.attn_kwargs(self.backbone, cu_seqlens, max_seqlen))
        hidden = out.last_hidden_state[0].index_select(0, logit_index)      # [N, H]
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)  # [N], not a view (FSDP2 hooks)


class Critic:
    def __init__(self, train, algo, *, path: str, mesh, device: torch.device, total_steps: int | None):
        backbone = modeling.load_hf_model(path, device, causal_lm=False,
                                          flag="--critic-load" if path == train.critic_load else "--hf-checkpoint")
        self.model = ValueModel(backbone)
        modeling.shard_model(self.model, modeling.decoder_blocks(backbone), mesh,
                             mp_policy=modeling.mixed_precision(device, train.bf16),
                             recompute=train.activation_checkpointing)
        self.lr = train.critic_lr if train.critic_lr is not None else train.lr
        self.optimizer = build_adamw(self.model, lr=self.lr, weight_decay=train.weight_decay,
                                     betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, device=device)
        self.schedule = LRSchedule(lr=self.lr, min_lr=train.min_lr, style=train.lr_decay_style,
                                   warmup=train.critic_lr_warmup_iters,  # --critic-lr-warmup-iters (Miles: own, 0)
                                   decay_iters=train.lr_decay_iters or total_steps, init=train.lr_warmup_init)
        self.clip_grad = train.clip_grad
        self.check_nan = train.check_for_nan_in_loss_and_grad
        self.value_clip = algo.value_clip

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        return self.model(mb.input_ids, mb.position_ids, mb.logit_index, mb.cu_seqlens, mb.max_seqlen)

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> torch.Tensor:
        return self.forward(mb)

    def backward(self, mb: MicroBatch, old_values: torch.Tensor | None, returns: torch.Tensor | None,
                 reduce: Reducer | None, scale: float) -> dict[str, torch.Tensor]:
        """Value loss of one micro-batch, backward with ``scale``; dummies contribute zero."""
        v = self.forward(mb)
        if reduce is None:
            (v.sum() * 0.0).backward()
            return {}
        loss_tok, clipped = value_loss(v, old_values, returns, self.value_clip)
        loss = reduce(loss_tok)
        (loss * scale).backward()
        return {"value_loss": loss.detach(), "value_clipfrac": reduce(clipped).detach()}

    def step(self) -> dict[str, float]:
        grad_norm = clip_grad_norm(list(self.model.parameters()), self.clip_grad)
        lr = self.schedule.apply(self.optimizer)
        if finite_step(grad_norm, self.check_nan, "critic"):
            self.optimizer.step()
            self.schedule.advance()
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic_grad_norm": grad_norm, "critic_lr": lr}
