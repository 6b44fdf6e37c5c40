"""Trainer plane flags: backend, optimizer, batching, checkpoints.

Some defaults depend on ``--train-backend``, as in Miles v0.1.0 (whose FSDP backend has its own argument
dataclass, while the Megatron one inherits Megatron-LM's defaults). ``BACKEND_DEFAULTS`` holds both tables;
``miles.config.parse_args`` reads ``--train-backend`` first and applies the table before the full parse,
so a value given on the command line always wins and validation never rewrites one.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from miles.config.base import ConfigError
from miles.config.data import json_object
from miles.config.lora import resolve_targets

DEFAULT_BACKEND = "megatron"  # as in Miles v0.1.0; --train-backend fsdp for FSDP2

# Miles v0.1.0: radixark/miles@v0.1.0:miles/backends/fsdp_utils/arguments.py (FSDPArgs) for fsdp; Megatron-LM's
# megatron/training/arguments.py for megatron. --lr is 1e-6 on both: Miles resets it after either parser.
BACKEND_DEFAULTS: dict[str, dict[str, object]] = {
    "fsdp": {"adam_beta2": 0.95, "weight_decay": 0.0, "lr_decay_style": "constant"},
    "megatron": {"adam_beta2": 0.999, "weight_decay": 0.01, "lr_decay_style": "linear"},
}

OFFLOAD_TARGETS = ("cpu", "disk")  # --offload-train-target (Miles's choices)
ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")  # --attn-implementation values the FSDP trainer honours
OPTIMIZERS = ["adam"]  # Miles's FSDP backend: "adam" (AdamW); Megatron's others are refused by name


def env_vars(value: str) -> dict[str, str]:
    """``--train-env-vars``: a JSON object of environment variables (values are stringified)."""
    env = {str(k): str(v) for k, v in json_object(value).items()}
    bad = next((k for k in env if not k or "=" in k or "\0" in k), None)
    if bad is not None or any("\0" in v for v in env.values()):
        what = f"{bad!r} is not an environment variable name" if bad is not None else "a value holds a NUL byte"
        raise argparse.ArgumentTypeError(f"{value!r}: {what} (names are non-empty, without '=' or NUL)")
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BACKEND_DEFAULTS[DEFAULT_BACKEND]
    t = parser.add_argument_group("trainer")
    t.add_argument("--train-backend", choices=["fsdp", "megatron"], default=DEFAULT_BACKEND,
                   help="Training backend: megatron (megatron-core, as in Miles; pip install 'miles[megatron]') or "
                        "fsdp (torch FSDP2 on the HF model).")
    t.add_argument("--optimizer", type=str, default="adam",
                   help="Optimizer: adam (AdamW, decoupled weight decay); no other is supported.")
    t.add_argument("--lr", type=float, default=1e-6, help="Peak learning rate.")
    t.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    t.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default=d["lr_decay_style"],
                   help="Decay schedule (default: constant with fsdp, linear with megatron).")
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="Optimizer steps of linear warm-up.")
    t.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="Learning rate of the first warm-up step (Megatron's; warm-up rises linearly from it to --lr).")
    t.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warm-up as a fraction of the decay steps (instead of --lr-warmup-iters).")
    t.add_argument("--lr-decay-iters", type=int, default=None, help="Optimizer steps to decay over.")
    t.add_argument("--weight-decay", type=float, default=d["weight_decay"],
                   help="AdamW weight decay (default: 0.0 with fsdp, 0.01 with megatron).")
    t.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    t.add_argument("--adam-beta2", type=float, default=d["adam_beta2"],
                   help="AdamW beta2 (default: 0.95 with fsdp, 0.999 with megatron).")
    t.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    t.add_argument("--clip-grad", type=float, default=1.0, help="Gradient norm clip (0: off).")
    t.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
                   help="Apply an optimizer step whose gradient norm is NaN or infinite (Megatron-LM's flag). By "
                        "default such a step is skipped: the weights, the optimizer state and the LR schedule stay "
                        "as they were, with a warning and the train/nonfinite_grad_steps metric.")
    t.add_argument("--micro-batch-size", type=int, default=1, help="Samples per micro-batch.")
    t.add_argument("--use-dynamic-batch-size", action="store_true", help="Pack micro-batches up to --max-tokens-per-gpu.")
    t.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Token budget per micro-batch.")
    t.add_argument("--balance-data", action="store_true",
                   help="Balance tokens over the data-parallel ranks. Always on here: every rollout is split in whole "
                        "groups, longest first, to the rank with the fewest tokens.")
    t.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="Tokens per chunk when computing log-probs (-1: the whole micro-batch at once).")
    t.add_argument("--recompute-activations", action="store_true", help="Activation checkpointing per block.")
    t.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                   help="FSDP backend: activation checkpointing per block (same as --recompute-activations).")
    t.add_argument("--attn-implementation", type=str, default="flash_attention_2",
                   help="FSDP backend attention: flash_attention_2 or flash_attention_3, which mean the same here: "
                        "packed rows run through a flash varlen kernel on GPU, sdpa on CPU and for sliding-window or "
                        "vision-language models. Other values are refused.")
    t.add_argument("--fsdp-cpu-offload", action=argparse.BooleanOptionalAction, default=False,
                   help="FSDP backend: keep the policy's parameters, gradients and optimizer state on CPU (FSDP2 "
                        "CPUOffloadPolicy; the optimizer step runs on CPU; --offload-train then moves only the critic).")
    t.add_argument("--train-env-vars", type=env_vars, default={},
                   help="JSON object of environment variables set in every rank before torch starts, "
                        "e.g. '{\"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"}'.")
    t.add_argument("--train-memory-margin-bytes", type=int, default=1024**3,
                   help="With --offload-train on GPU (colocated), both backends: each time the trainer moves its state "
                        "back to the GPU, its CUDA allocator is capped so that it leaves this many bytes of the device "
                        "free (an allocation past that is a CUDA out-of-memory error, as Miles's torch_memory_saver "
                        "margin). 0: no cap.")
    t.add_argument("--offload-train-target", choices=list(OFFLOAD_TARGETS), default="cpu",
                   help="Where --offload-train puts the paused trainer: cpu (host memory) or disk (rank files).")
    t.add_argument("--offload-train-disk-dir", type=str, default=None,
                   help="Node-local dir of the disk target (default $SCRATCH/miles_train_offload_<uid>).")
    t.add_argument("--offload-train-disk-chunk-mb", type=int, default=256,
                   help="MiB of the disk target's staging buffer.")
    t.add_argument("--qkv-format", choices=["thd", "bshd"], default="thd",
                   help="Attention input layout: thd (the default; the FSDP backend's packed variable-length rows); "
                        "bshd (padded batches, as Miles's gpt-oss script passes it): Megatron backend only, which "
                        "runs every micro-batch as right-padded [b, s] rows either way.")
    t.add_argument("--megatron-to-hf-mode", choices=["raw", "bridge"], default="raw",
                   help="Megatron backend: how Megatron weights are converted to HF names for the engines.")
    lo = parser.add_argument_group("LoRA (both backends; miles/trainer/lora.py, lora_hf.py)")
    lo.add_argument("--lora-rank", type=int, default=0, help="LoRA rank. 0: LoRA off, every parameter trains.")
    lo.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha: the adapter delta is (alpha / rank) * B @ A.")
    lo.add_argument("--lora-dropout", type=float, default=0.0, help="Dropout on the LoRA input (training only).")
    lo.add_argument("--lora-type", type=str, default="lora",
                    help="LoRA variant: lora (fused q/k/v and gate/up targets, one adapter each); canonical_lora "
                         "is not supported.")
    lo.add_argument("--target-modules", type=str, default=None,
                    help="LoRA targets: all-linear or a comma list of HF names (q_proj,k_proj,v_proj,o_proj,gate_proj,"
                         "up_proj,down_proj), Megatron names (linear_qkv,linear_proj,linear_fc1,linear_fc2; the gated "
                         "DeltaNet's in_proj,out_proj) or Megatron-Bridge module paths with * wildcards "
                         "(decoder.layers.*.self_attention.linear_qkv).")
    lo.add_argument("--exclude-modules", type=str, default=None,
                    help="LoRA targets to leave out (comma list of names or module paths).")
    lo.add_argument("--experts-shared-outer-loras", action="store_true", default=False,
                    help="MoE experts' LoRA: one linear_fc1 (gate/up) A and one linear_fc2 (down) B per layer, shared "
                         "by its experts (the hidden-size side); B of fc1 and A of fc2 stay per expert. Default: "
                         "each expert has its own A and B.")
    t.add_argument("--seed", type=int, default=1234, help="Random seed of the trainer.")
    t.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic torch kernels in the trainer (torch.use_deterministic_algorithms).")
    t.add_argument("--bf16", action="store_true", default=None, help="bf16 mixed precision (default on GPU).")
    t.add_argument("--hf-checkpoint", type=str, default=None, help="Local HF model directory (weights, config, tokenizer).")
    t.add_argument("--model-name", type=str, default=None,
                   help="Miles picks its weight converter by this name (e.g. deepseekv4); miles reads the weight names "
                        "from --hf-checkpoint's config.json, so it must name that model (model_type or config class, "
                        "case, - and _ ignored), else refused.")
    t.add_argument("--ref-load", type=str, default=None, help="Reference model (HF dir); default: the initial weights.")
    t.add_argument("--critic-load", type=str, default=None, help="Critic initial weights (HF dir); default: --hf-checkpoint.")
    t.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default: --lr).")
    t.add_argument("--critic-lr-warmup-iters", type=int, default=0, help="Optimizer steps of critic LR warm-up.")
    t.add_argument("--num-critic-only-steps", type=int, default=0,
                   help="PPO: the first N rollouts train only the critic (value warm-up); the actor stays frozen.")
    t.add_argument("--mfu-peak-tflops", type=float, default=None, help="Per-GPU bf16 peak TFLOP/s for MFU (default: from the GPU name).")

    c = parser.add_argument_group("checkpoints")
    c.add_argument("--save", type=str, default=None, help="Checkpoint directory.")
    c.add_argument("--save-interval", type=int, default=100, help="Save every N rollouts (and always after the last).")
    c.add_argument("--load", type=str, default=None, help="Resume from this checkpoint directory (default: --save if one exists).")
    c.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer state.")
    c.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    c.add_argument("--save-hf", type=str, default=None, help="Also write a HF model dir (safetensors) here at each save.")
    c.add_argument("--keep-checkpoints", type=int, default=2, help="Complete checkpoints to keep.")
    c.add_argument("--save-retain-interval", type=int, default=None,
                   help="Checkpoints at multiples of N rollouts are kept as well (never pruned by --keep-checkpoints).")


@dataclass(kw_only=True)
class TrainConfig:
    train_backend: str
    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_warmup_init: float
    lr_decay_iters: int | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    check_for_nan_in_loss_and_grad: bool
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    balance_data: bool
    log_probs_chunk_size: int
    recompute_activations: bool
    gradient_checkpointing: bool
    attn_implementation: str
    fsdp_cpu_offload: bool
    train_env_vars: dict[str, str]
    train_memory_margin_bytes: int
    qkv_format: str
    megatron_to_hf_mode: str
    seed: int
    deterministic_mode: bool
    bf16: bool | None
    hf_checkpoint: str | None
    model_name: str | None
    ref_load: str | None
    critic_load: str | None
    critic_lr: float | None
    critic_lr_warmup_iters: int
    num_critic_only_steps: int
    mfu_peak_tflops: float | None
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_type: str = "lora"
    target_modules: str | None = None
    exclude_modules: str | None = None
    experts_shared_outer_loras: bool = False
    offload_train_target: str = "cpu"
    offload_train_disk_dir: str | None = None
    offload_train_disk_chunk_mb: int = 256

    @property
    def activation_checkpointing(self) -> bool:
        """--recompute-activations (Megatron's name) or --gradient-checkpointing (Miles's FSDP name)."""
        return self.recompute_activations or self.gradient_checkpointing

    @property
    def offload_disk_root(self) -> str:
        """--offload-train-disk-dir, or Miles's default: $SCRATCH/miles_train_offload_<uid> (/scratch without SCRATCH).
        Each trainer rank spills under ``rank_<global rank>/`` of it."""
        if self.offload_train_disk_dir:
            return self.offload_train_disk_dir
        uid = os.getuid() if hasattr(os, "getuid") else 0
        return os.path.join(os.environ.get("SCRATCH", "/scratch"), f"miles_train_offload_{uid}")

    def warmup_steps(self, decay_iters: int | None) -> int:
        """Warm-up optimizer steps: --lr-warmup-fraction x the decay steps when given, else --lr-warmup-iters."""
        if self.lr_warmup_fraction is not None and decay_iters:
            return int(self.lr_warmup_fraction * decay_iters)
        return self.lr_warmup_iters

    def validate(self) -> None:
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: pass only one.")
            if not 0.0 <= self.lr_warmup_fraction <= 1.0:
                raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}.")
        if self.optimizer != "adam":
            raise ConfigError(f"--optimizer {self.optimizer} is not supported: miles trains with AdamW; "
                              "pass --optimizer adam (or drop the flag).")
        if self.log_probs_chunk_size == 0 or self.log_probs_chunk_size < -1:
            raise ConfigError(f"--log-probs-chunk-size must be a positive number of tokens or -1 (no chunking), "
                              f"got {self.log_probs_chunk_size}.")
        if self.train_backend == "fsdp" and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(f"--attn-implementation {self.attn_implementation} is not supported: the FSDP trainer "
                              "packs samples into variable-length rows and runs them through a flash varlen kernel on "
                              "GPU (sdpa on CPU); pass --attn-implementation flash_attention_2 (or flash_attention_3) "
                              "or drop the flag.")
        if self.train_memory_margin_bytes < 0:
            raise ConfigError(f"--train-memory-margin-bytes must be >= 0 (0: no cap), got "
                              f"{self.train_memory_margin_bytes}.")
        if self.offload_train_disk_chunk_mb <= 0:
            raise ConfigError(f"--offload-train-disk-chunk-mb must be a positive number of MiB, got "
                              f"{self.offload_train_disk_chunk_mb}: e.g. --offload-train-disk-chunk-mb 256.")
        if self.lora_rank:
            self._validate_lora()
        elif self.experts_shared_outer_loras:
            raise ConfigError("--experts-shared-outer-loras without --lora-rank: it shapes the MoE experts' LoRA "
                              "adapters; add --lora-rank R with --target-modules, or drop the flag.")
        if self.num_critic_only_steps < 0:
            raise ConfigError(f"--num-critic-only-steps must be >= 0, got {self.num_critic_only_steps}.")

    def _validate_lora(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be >= 0 (0: LoRA off), got {self.lora_rank}.")
        if self.lora_type != "lora":
            raise ConfigError(f"--lora-type {self.lora_type} is not supported: pass --lora-type lora (fused q/k/v "
                              "and gate/up adapters) or drop the flag.")
        if self.lora_alpha <= 0:
            raise ConfigError(f"--lora-alpha must be > 0, got {self.lora_alpha}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}.")
        resolve_targets(self.target_modules, self.exclude_modules)


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None
    save_interval: int
    load: str | None
    no_save_optim: bool
    no_load_optim: bool
    save_hf: str | None
    keep_checkpoints: int
    save_retain_interval: int | None
