"""Trainer plane flags: backend, optimizer, batching, checkpoints."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("trainer")
    t.add_argument("--train-backend", choices=["fsdp", "megatron"], default="fsdp", help="Training backend.")
    t.add_argument("--lr", type=float, default=1e-6, help="Peak learning rate.")
    t.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    t.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant", help="Decay schedule.")
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="Optimizer steps of linear warm-up.")
    t.add_argument("--lr-decay-iters", type=int, default=None, help="Optimizer steps to decay over.")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay.")
    t.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    t.add_argument("--adam-beta2", type=float, default=0.98, help="AdamW beta2.")
    t.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    t.add_argument("--clip-grad", type=float, default=1.0, help="Gradient norm clip (0: off).")
    t.add_argument("--micro-batch-size", type=int, default=1, help="Samples per micro-batch.")
    t.add_argument("--use-dynamic-batch-size", action="store_true", help="Pack micro-batches up to --max-tokens-per-gpu.")
    t.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Token budget per micro-batch.")
    t.add_argument("--log-probs-chunk-size", type=int, default=1024, help="Tokens per chunk when computing log-probs.")
    t.add_argument("--recompute-activations", action="store_true", help="Activation checkpointing per block.")
    t.add_argument("--seed", type=int, default=1234, help="Random seed of the trainer.")
    t.add_argument("--bf16", action="store_true", default=None, help="bf16 mixed precision (default on GPU).")
    t.add_argument("--hf-checkpoint", type=str, default=None, help="Local HF model directory (weights, config, tokenizer).")
    t.add_argument("--ref-load", type=str, default=None, help="Reference model (HF dir); default: the initial weights.")
    t.add_argument("--critic-load", type=str, default=None, help="Critic initial weights (HF dir); default: --hf-checkpoint.")
    t.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default: --lr).")
    t.add_argument("--mfu-peak-tflops", type=float, default=None, help="Per-GPU bf16 peak TFLOP/s for MFU (default: from the GPU name).")

    c = parser.add_argument_group("checkpoints")
    c.add_argument("--save", type=str, default=None, help="Checkpoint directory.")
    c.add_argument("--save-interval", type=int, default=100, help="Save every N rollouts (and always after the last).")
    c.add_argument("--load", type=str, default=None, help="Resume from this checkpoint directory (default: --save if one exists).")
    c.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer state.")
    c.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    c.add_argument("--save-hf", type=str, default=None, help="Also write a HF model dir (safetensors) here at each save.")
    c.add_argument("--keep-checkpoints", type=int, default=2, help="Complete checkpoints to keep.")


@dataclass(kw_only=True)
class TrainConfig:
    train_backend: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    log_probs_chunk_size: int
    recompute_activations: bool
    seed: int
    bf16: bool | None
    hf_checkpoint: str | None
    ref_load: str | None
    critic_load: str | None
    critic_lr: float | None
    mfu_peak_tflops: float | None


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None
    save_interval: int
    load: str | None
    no_save_optim: bool
    no_load_optim: bool
    save_hf: str | None
    keep_checkpoints: int
