"""The megatron-core trainer (``--train-backend megatron``): the FSDP trainer's interface and RL math,
megatron-core's GPTModel with tensor parallelism underneath.

    trainer = MegatronTrainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=groups.trainer_group,
                              device=device, rollout_temperature=..., num_rollout=..., global_batch_size=...,
                              num_steps_per_rollout=steps, timeout=...)
    metrics = trainer.train(my_samples, rollout_id)          # every trainer rank, whole groups per rank
    for bucket in trainer.iter_weight_buckets(512 << 20, torch.bfloat16): ...   # HF names, full tensors

What is shared with ``FSDPTrainer`` (subclassed): sample validation, micro-batch planning (padded to
the same count on every data-parallel rank), the forward-only passes, advantages, the loss family
(``losses.py``), the loss normalisation over the step, metrics. What differs:

- groups: megatron-core's TP groups over the trainer ranks (``parallel.py``); ``self.group`` is the
  data-parallel group, so every sum "over the trainer group" of the shared code runs over DP. The
  ranks of one TP group train the same samples: ``train`` first gathers the samples of the TP group.
- micro-batches: the packed row of the shared planner becomes a right-padded ``[b, s]`` batch (one
  sample per row, causal attention; padding comes after the real tokens, so it is never attended to).
- log-probs: the shared chunked implementation, vocabulary-parallel under TP (``logprobs.VocabShard``:
  no rank materialises the full vocabulary); padding rows of the vocabulary are excluded.
- gradients: TP-partial ones summed over TP, all averaged over DP, the norm over the full model
  (``parallel.finish_grads`` / ``clip_grad_norm``); AdamW over this rank's shards, its state sharded over
  DP with ``--use-distributed-optimizer``.
- weights out: ``iter_weight_buckets`` gathers TP shards bucket by bucket and converts to HF names and
  shapes (``export.py``), so the weight senders and ``--check-weight-update-equal`` work unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.config.base import ConfigError
from miles.trainer.batching import MicroBatch
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.logprobs import VocabShard, logprobs_and_entropy
from miles.trainer.losses import custom_loss, load_custom_loss, policy_loss, sft_loss
from miles.trainer.megatron import convert, export, options, parallel
from miles.trainer.megatron import model as mmodel
from miles.trainer.metrics import peak_tflops
from miles.trainer.optim import LRSchedule, build_adamw
from miles.types import Sample
from miles.utils.logging import get_logger

logger = get_logger(__name__)


def padded_batch(mb: MicroBatch, pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed micro-batch as right-padded rows: (input_ids [b, s], position_ids [b, s], index [N] of the
    response-predicting positions in the flattened [b * s]); ``s`` rounded up to ``multiple``."""
    cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.long)
    b = cu.numel() - 1
    s = -(-int(mb.max_seqlen) // multiple) * multiple
    total = int(mb.input_ids.shape[1])                             # = cu[-1], without a device sync
    pos = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu[1:], pos, right=True)              # sample of each packed position
    flat = row * s + pos - cu[row]
    ids = torch.full((b * s,), pad_id, dtype=mb.input_ids.dtype, device=cu.device)
    ids[flat] = mb.input_ids[0, :total]
    position_ids = torch.arange(s, device=cu.device).unsqueeze(0).expand(b, s)
    return ids.view(b, s), position_ids, flat.index_select(0, mb.logit_index)


class MegatronTrainer(FSDPTrainer):
    def __init__(self, train, algo, ckpt, megatron=None, *, group: dist.ProcessGroup, device: torch.device,
                 rollout_temperature: float, num_rollout: int | None, global_batch_size: int | None,
                 num_steps_per_rollout: int, timeout: float, mesh=None):
        self.cfg, self.algo, self.ckpt = train, algo, ckpt
        self.opts = options.resolve(megatron, train)
        self.device, self.timeout, self.mesh = torch.device(device), float(timeout), None
        self.trainer_group = group
        self.trainer_rank, self.trainer_world = dist.get_rank(group), dist.get_world_size(group)
        self.num_rollout, self.global_batch_size = num_rollout, global_batch_size
        self.num_steps_per_rollout = num_steps_per_rollout
        self._validate(rollout_temperature)
        self.temperature = float(rollout_temperature) if algo.loss_type != "sft_loss" else 1.0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(train.seed)
        from transformers import AutoConfig

        self.shape = options.shape_of(AutoConfig.from_pretrained(train.hf_checkpoint))
        if getattr(train, "megatron_to_hf_mode", "raw") != "raw" and self.trainer_rank == 0:
            logger.info("--megatron-to-hf-mode %s: weights are converted by miles's own converter (convert.py), "
                        "to the same HF names and shapes.", train.megatron_to_hf_mode)
        options.check_shape(megatron, self.shape)
        options.check_supported(self.opts, self.shape, self.device, max(self.trainer_world // self.opts.tp, 1))
        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(self.trainer_world)):     # megatron-core lays its groups over ranks 0..n-1
            raise RuntimeError(f"the Megatron trainer needs the trainer ranks to be global ranks "
                               f"0..{self.trainer_world - 1}, got {ranks}")
        self.groups = parallel.init_parallel(tp_size=self.opts.tp, num_trainer_ranks=self.trainer_world,
                                             seed=train.seed, device=self.device)
        self.group, self.rank, self.world = self.groups.dp, self.groups.dp_rank, self.groups.dp_size
        tp = self.groups.tp_size
        self.padded_vocab = mmodel.padded_vocab_size(self.shape.vocab_size, self.opts.vocab_divisible_by, tp)
        self.vocab_size = self.shape.vocab_size
        self.pad_id = 0
        self.bf16 = self.device.type == "cuda" if train.bf16 is None else bool(train.bf16)
        if self.bf16 and self.device.type != "cuda":
            raise ConfigError("--bf16 with --train-backend megatron needs a GPU (megatron-core's layers are "
                              "autocast-aware on CUDA only); drop --bf16 to train in fp32 on CPU.")
        self.mp_policy = None
        self._dropout = self.opts.hidden_dropout > 0 or self.opts.attention_dropout > 0
        self.dropout_rng_state = torch.Generator().manual_seed(train.seed + 2718).get_state()
        self._hf_state: dict[str, torch.Tensor] | None = None

        total_steps = num_rollout * num_steps_per_rollout if num_rollout else None
        self.model = self._build_policy(train.hf_checkpoint, offload=False, recompute=True)
        self.num_params = self._full_param_count()
        adam = dict(lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2),
                    eps=train.adam_eps, device=self.device)
        self.distributed_optimizer = self.opts.distributed_optimizer and self.world > 1
        self.optimizer = (parallel.distributed_adamw(self.model, self.groups, **adam) if self.distributed_optimizer
                          else build_adamw(self.model, **adam))
        decay = train.lr_decay_iters or total_steps
        self.schedule = LRSchedule(lr=train.lr, min_lr=train.min_lr, style=train.lr_decay_style,
                                   warmup=train.warmup_steps(decay) if hasattr(train, "warmup_steps")
                                   else train.lr_warmup_iters, decay_iters=decay)
        policy = algo.loss_type != "sft_loss"
        self.ref = None
        if policy and (algo.kl_coef != 0 or algo.use_kl_loss):
            self.ref = self._build_policy(train.ref_load or train.hf_checkpoint, offload=True, recompute=False)
        self.teacher = None
        if policy and _teacher_in_trainer(algo):
            self.teacher = self._build_policy(algo.opd_teacher_load, offload=True, recompute=False)
        self.critic = None
        if policy and algo.advantage_estimator == "ppo":
            from miles.trainer.megatron.critic import MegatronCritic

            path = train.critic_load or train.hf_checkpoint
            self.critic = MegatronCritic(self, self._build_policy(path, offload=False, recompute=True))
        if algo.loss_type == "sft_loss":
            self.loss_fn = sft_loss
        elif algo.loss_type == "custom_loss":
            self.loss_fn = custom_loss(load_custom_loss(algo.custom_loss_function_path))
        else:
            self.loss_fn = policy_loss
        start = self.groups.tp_rank * (self.padded_vocab // tp)
        self.vocab_shard = VocabShard(self.groups.tp, start, self.vocab_size) if tp > 1 else None
        self.peak = peak_tflops(self.device, getattr(train, "mfu_peak_tflops", None))
        self._keep_unsharded = {id(m): False for m in (self.model, self.ref, self.teacher,
                                                     self.critic.model if self.critic else None) if m is not None}
        self.last_rollout_id: int | None = None
        self._hf_state = None                      # the converted weights are in the models now
        logger.info("Megatron trainer ready: %s params, TP %d x DP %d, device %s, %s layer spec, bf16 %s, ref %s, "
                    "critic %s", f"{self.num_params:,}", tp, self.world, self.device,
                    "transformer-engine" if mmodel.use_transformer_engine(self.device) else "local", self.bf16,
                    self.ref is not None, self.critic is not None)

    # ------------------------------------------------------------------ construction
    def _validate(self, temperature: float) -> None:
        t, a = self.cfg, self.algo
        if t.train_backend != "megatron":
            raise ValueError(f"MegatronTrainer serves --train-backend megatron, got {t.train_backend!r}.")
        if not t.hf_checkpoint:
            raise ConfigError("--hf-checkpoint DIR is required: the Megatron trainer converts the model from a local "
                              "HF directory.")
        if a.loss_type != "sft_loss" and temperature <= 0:
            raise ConfigError(f"--rollout-temperature must be > 0 for RL training (log-probs are taken under it), "
                              f"got {temperature}.")
        if t.use_dynamic_batch_size and not t.max_tokens_per_gpu:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N.")
        if self.num_steps_per_rollout is None or self.num_steps_per_rollout <= 0:
            raise ValueError(f"num_steps_per_rollout must be a positive int, got {self.num_steps_per_rollout}.")
        if _teacher_in_trainer(a) and not a.opd_teacher_load:
            raise ConfigError(f"--use-opd --opd-type {a.opd_type} needs --opd-teacher-load DIR.")

    def _hf(self, path: str) -> dict[str, torch.Tensor]:
        if path == self.cfg.hf_checkpoint and self._hf_state is not None:
            return self._hf_state
        sd = convert.read_hf_state_dict(path)
        if path == self.cfg.hf_checkpoint:
            self._hf_state = sd            # the reference model of --kl-coef reads the same weights
        return sd

    def _build_policy(self, path: str, *, offload: bool, recompute: bool):
        from transformers import AutoConfig

        shape = mmodel.ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
        if shape != self.shape:
            raise ConfigError(f"{path}: its architecture differs from --hf-checkpoint's ({shape} vs {self.shape}); "
                              "the reference and teacher models must share the policy's shape.")
        o = self.opts
        config = mmodel.transformer_config(
            shape, tp_size=self.groups.tp_size, device=self.device,
            recompute=o.recompute_granularity if recompute else None, recompute_method=o.recompute_method,
            recompute_num_layers=o.recompute_num_layers, attention_softmax_in_fp32=True,
            hidden_dropout=o.hidden_dropout if recompute else 0.0,
            attention_dropout=o.attention_dropout if recompute else 0.0)
        core = "unfused" if o.attention_backend in ("unfused", "local") else "sdpa"
        model = mmodel.build_gpt_model(shape, config, padded_vocab=self.padded_vocab, device=self.device,
                                       core_attention=core)
        convert.load_hf_into(model, self._hf(path), shape, self.padded_vocab, self.groups.tp_rank,
                             self.groups.tp_size)
        if offload:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        return model

    def _full_param_count(self) -> int:
        """Parameters of the whole model (TP shards summed once, vocabulary padding excluded)."""
        sharded = sum(p.numel() for n, p in self.model.named_parameters() if convert.partition_dim(n) is not None)
        replicated = sum(p.numel() for n, p in self.model.named_parameters() if convert.partition_dim(n) is None)
        t = torch.tensor([float(sharded)], dtype=torch.float64, device=self.device)
        if self.groups.tp_size > 1:
            dist.all_reduce(t, group=self.groups.tp)
        pad_rows = self.padded_vocab - self.vocab_size
        embeds = 1 if self.shape.tie_embeddings else 2
        return int(t.item()) + replicated - pad_rows * self.shape.hidden_size * embeds

    # ------------------------------------------------------------------ forward
    def _autocast(self):
        """bf16 (default on GPU): fp32 parameters (the AdamW masters), the forward under CUDA autocast
        (megatron-core's tensor-parallel linear layers are autocast-aware on CUDA only)."""
        if self.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _dropout_stream(self, model):
        """On CPU, megatron-core's hidden dropout draws from the global torch generator, which other code
        (data, samplers) uses differently on each rank; the ranks of a TP group must draw the same masks.
        Training forwards therefore run on the trainer's own CPU stream (same seed on every rank;
        checkpointed). On GPU megatron-core's seeding of the CUDA generator does this."""
        if self.device.type == "cuda" or not model.training or not self._dropout:
            yield
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self.dropout_rng_state)
        try:
            yield
        finally:
            self.dropout_rng_state = torch.get_rng_state()
            torch.set_rng_state(outer)

    def _hidden(self, model, mb: MicroBatch) -> torch.Tensor:
        """Final-norm hidden states [N, h] at the positions that predict the response tokens."""
        ids, pos, index = padded_batch(mb, self.pad_id)
        with self._autocast(), self._dropout_stream(model):
            hidden = model(ids, pos, attention_mask=None)                        # [s, b, h]
        b, s = ids.shape
        return hidden.transpose(0, 1).reshape(b * s, -1).index_select(0, index)

    def _policy_forward(self, model, mb: MicroBatch, *, with_entropy: bool = False, entropy_grad: bool = False):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        h = self._hidden(model, mb)                                              # [N, h]
        weight = mmodel.output_weight(model)
        if self.vocab_shard is not None:
            h = copy_to_tensor_model_parallel_region(h, group=self.groups.tp)   # backward: sum over TP

            def head(x):
                return F.linear(x, weight.to(x.dtype))
        else:
            vocab = self.vocab_size

            def head(x):
                return F.linear(x, weight[:vocab].to(x.dtype))
        return logprobs_and_entropy(h, head, mb.targets, temperature=self.temperature,
                                    chunk_size=self.cfg.log_probs_chunk_size, with_entropy=with_entropy,
                                    entropy_grad=entropy_grad, vocab_shard=self.vocab_shard)

    # ------------------------------------------------------------------ training
    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Train on this TP group's samples (each rank's share, gathered over the TP group)."""
        if self.groups.tp_size > 1:
            parts: list = [None] * self.groups.tp_size
            dist.all_gather_object(parts, list(samples), group=self.groups.tp)
            samples = [s for part in parts for s in part]
        return super().train(samples, rollout_id)

    def _clip_grad_norm(self) -> float:
        parallel.finish_grads(self.model, self.groups)
        return parallel.clip_grad_norm(self.model, self.groups, self.cfg.clip_grad)

    def _move(self, device) -> None:
        """offload/onload (colocated GPU): parameters and this rank's optimizer state."""
        if self.device.type != "cuda":
            return
        from miles.trainer.state import move_optimizer_state

        for model, opt in [(self.model, self.optimizer)] + (
                [(self.critic.model, self.critic.optimizer)] if self.critic is not None else []):
            model.to(device)
            move_optimizer_state(parallel.local_optimizer(opt), torch.device(device))
        torch.cuda.synchronize(self.device)
        if torch.device(device).type == "cpu":
            torch.cuda.empty_cache()

    def _perf_metrics(self, *args, **kwargs) -> dict[str, float]:
        out = super()._perf_metrics(*args, **kwargs)
        if "mfu" in out:                                   # the shared formula counts DP ranks as GPUs
            out["mfu"] /= self.groups.tp_size
        return out

    # ------------------------------------------------------------------ weights
    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                            prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters under their HF names and shapes, bucket by bucket (TP shards gathered per
        bucket); every trainer rank must iterate to the end and receives the full tensors."""
        return export.iter_hf_buckets(self.model, self.shape, self.groups, device=self.device,
                                      bucket_bytes=bucket_bytes, dtype=dtype, timeout=self.timeout,
                                      prefetch=prefetch)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra: dict) -> None:
        from miles.trainer.megatron import state

        state.save_trainer_state(self, Path(path), extra)

    def load(self, path: str | Path) -> dict:
        from miles.trainer.megatron import state

        return state.load_trainer_state(self, Path(path))

    def resume(self) -> dict | None:
        from miles.trainer.megatron import state

        return state.resume_latest(self)


def _teacher_in_trainer(algo) -> bool:
    flag = getattr(algo, "opd_teacher_in_trainer", None)
    if flag is not None:
        return bool(flag)
    return bool(algo.use_opd and algo.opd_type == "model")
