"""The megatron-core backend (``--train-backend megatron``) of the RL step (``miles.trainer.step.RLTrainer``, which
the FSDP backend implements too): megatron-core's GPTModel with tensor, pipeline, context and expert parallelism.

    trainer = build_trainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=groups.trainer_group,
                            device=device, rollout_temperature=..., num_rollout=..., global_batch_size=...,
                            num_steps_per_rollout=steps, timeout=...)          # miles.trainer.build
    metrics = trainer.train(my_samples, rollout_id)          # every trainer rank, whole groups per rank
    for bucket in trainer.iter_weight_buckets(512 << 20, torch.bfloat16): ...   # HF names, full tensors

What the shared step does: sample validation, micro-batch planning (here without dynamic batching, planned
micro-batches share forwards up to a token budget: ``_coalesce``; the count is padded over data-parallel ranks
only for MoE and pipeline parallelism), the forward-only passes, advantages, the loss family (``losses.py``), the
loss normalisation over the step, metrics, --deterministic-mode (here also megatron-core's
``TransformerConfig.deterministic_mode``). What this backend does its own way:

- groups: megatron-core's TP groups over the trainer ranks (``parallel.py``); ``self.group`` is the
  data-parallel group, so every sum "over the trainer group" of the shared code runs over DP. The
  ranks of one TP group train the same samples: ``train`` first gathers the samples of the TP group.
- the policy forward (``forward.py``): the packed row of the shared planner becomes a right-padded ``[b, s]``
  batch (one sample per row, causal attention; padding comes after the real tokens, so it is never attended
  to); log-probs by the shared chunked implementation, vocabulary-parallel under TP (``logprobs.VocabShard``:
  no rank materialises the full vocabulary); padding rows of the vocabulary are excluded. Context parallelism
  (``context_parallel.py``): each CP rank runs its two chunks of every row and computes log-probs, entropy and
  values on its own positions; ``RowShard.reassemble`` all-gathers them into micro-batch order for the shared
  loss. ``--sequence-parallel``: the sequence-split output is all-gathered over TP before the head.
- gradients: TP-partial ones summed over TP, all averaged over DP, the norm over the full model
  (``parallel.finish_grads`` / ``clip_grad_norm``); AdamW over this rank's shards, its state sharded over
  DP with ``--use-distributed-optimizer`` (the experts' over the expert-DP group under expert parallelism).
- weights out: ``iter_weight_buckets`` gathers TP shards bucket by bucket and converts to HF names and
  shapes (``export.py``), so the weight senders and ``--check-weight-update-equal`` work unchanged. There is no
  ``iter_weight_shards`` (TP shards are not dim-0 row ranges of the HF tensors): ``p2p`` weight sync takes the
  full tensors every trainer rank holds and each rank sends its dim-0 share (``miles.weight_sync.p2p``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from miles.config import specs
from miles.config.base import ConfigError
from miles.config.kernels import check_kernel_flags
from miles.trainer import lora as lora_mod
from miles.trainer import vlm as hf_vlm
from miles.trainer.batching import MicroBatch, coalesce_micro_batches, pack, plan_micro_batches
from miles.trainer.collectives import bounded_all_gather_object
from miles.trainer.logprobs import VocabShard
from miles.trainer.losses import accumulate_metrics
from miles.trainer.megatron import convert, export, fork_flags, forward, moe, options, parallel, pipeline, provider
from miles.trainer.megatron import model as mmodel
from miles.trainer.megatron import mtp as mtp_mod
from miles.trainer.megatron import vlm as mvlm
from miles.trainer.megatron.families import FAMILIES
from miles.trainer.metrics import active_params, moe_routing, peak_tflops
from miles.trainer.optim import LRSchedule, MasterWeights, build_adamw
from miles.trainer.step import RLTrainer
from miles.trainer.weights import checkpoint_tensors
from miles.types import Sample
from miles.utils.logging import get_logger

logger = get_logger(__name__)

# Without --use-dynamic-batch-size, planned micro-batches share a forward up to this many tokens (``_coalesce``);
# a GPU keeps a small budget (activation memory), a CPU host a larger one. --max-tokens-per-gpu overrides both.
COALESCE_TOKENS = {"cpu": 8192, "default": 1024}


class MegatronTrainer(RLTrainer):
    backend = "megatron"

    def __init__(self, train, algo, ckpt, megatron=None, *, group: dist.ProcessGroup, device: torch.device,
                 rollout_temperature: float, num_rollout: int | None, global_batch_size: int | None,
                 num_steps_per_rollout: int, timeout: float, custom_config: dict | None = None):
        self.opts = options.resolve(megatron, train)
        self.megatron_cfg = megatron            # the checkpoint flags (dist_ckpt.py): --finetune, --ckpt-step, ...
        self.trainer_group = group
        self.trainer_rank, self.trainer_world = dist.get_rank(group), dist.get_world_size(group)
        self._setup(train, algo, ckpt, device=device, timeout=timeout, rollout_temperature=rollout_temperature,
                    num_rollout=num_rollout, global_batch_size=global_batch_size,
                    num_steps_per_rollout=num_steps_per_rollout)
        from transformers import AutoConfig

        from miles.utils.model_dir import load_config

        hf_config = load_config(train.hf_checkpoint, "--hf-checkpoint", check=False)   # kimi_k2 registered
        self.shape = dataclasses.replace(options.shape_of(hf_config),
                                         mtp_num_layers=self.opts.mtp_num_layers)      # the MTP block (mtp.py)
        # Qwen3-VL (vlm.py): image inputs per micro-batch, as the FSDP trainer reads them (miles.trainer.vlm)
        mvlm.check_static(self.opts, self.shape, lora=lora_mod.LoraSpec.from_config(train) is not None)
        self._images = (hf_vlm.ImageProcessor(train.hf_checkpoint, hf_config.image_token_id) if self.shape.vision
                        else None)
        if getattr(train, "megatron_to_hf_mode", "raw") != "raw" and self.trainer_rank == 0:
            logger.info("--megatron-to-hf-mode %s: weights are converted by miles's own converter (convert.py), "
                        "to the same HF names and shapes.", train.megatron_to_hf_mode)
        options.check_shape(megatron, self.shape)
        check_kernel_flags(megatron)                    # --moe-grouped-gemm, DeepEP, ...: their packages, on this rank
        options.check_supported(self.opts, self.shape, self.device,
                                max(self.trainer_world // (self.opts.tp * self.opts.pp), 1),
                                lora=lora_mod.LoraSpec.from_config(train) is not None)
        options.check_pipeline_algo(self.opts, algo)
        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(self.trainer_world)):     # megatron-core lays its groups over ranks 0..n-1
            raise RuntimeError(f"the Megatron trainer needs the trainer ranks to be global ranks "
                               f"0..{self.trainer_world - 1}, got {ranks}")
        self.groups = parallel.init_parallel(tp_size=self.opts.tp, num_trainer_ranks=self.trainer_world,
                                             seed=train.seed, device=self.device, pp_size=self.opts.pp,
                                             timeout=self.timeout, cp_size=self.opts.cp, ep_size=self.opts.ep,
                                             etp_size=self.opts.etp)
        if self.shape.num_experts:            # megatron-core's MoE modules without TE / on CPU (compat.py)
            from miles.trainer.megatron import compat

            compat.apply_moe_compat()
            if self.device.type != "cuda":
                compat.apply_moe_cpu_compat()
        self._sequence_parallel = self.opts.sequence_parallel and self.opts.tp > 1    # TP 1: nothing to split
        self.stage = pipeline.Stage.from_parallel_state(self.timeout)
        self.group, self.rank, self.world = self.groups.dp, self.groups.dp_rank, self.groups.dp_size
        tp = self.groups.tp_size
        self.padded_vocab = mmodel.padded_vocab_size(self.shape.vocab_size, self.opts.vocab_divisible_by, tp)
        self.vocab_size = self.shape.vocab_size
        self.pad_id = 0
        self.bf16 = self.device.type == "cuda" if train.bf16 is None else bool(train.bf16)
        self._dropout = self.opts.hidden_dropout > 0 or self.opts.attention_dropout > 0
        self.dropout_rng_state = torch.Generator().manual_seed(train.seed + 2718).get_state()
        self._hf_state: dict[str, torch.Tensor] | None = None

        total_steps = num_rollout * num_steps_per_rollout if num_rollout else None
        self.model = self._build_policy(train.hf_checkpoint, offload=False, recompute=True, mtp=True)
        self.num_params = self._full_param_count()
        self.num_active_params = active_params(self.num_params, self._expert_param_count(),  # MFU's N
                                               moe_routing(AutoConfig.from_pretrained(train.hf_checkpoint)))
        self.lora = self._attach_lora()          # --lora-rank: base frozen, adapters trained (miles/trainer/lora.py)
        adam = dict(lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2),
                    eps=train.adam_eps, device=self.device)
        self.distributed_optimizer = (self.opts.distributed_optimizer and self.world * self.groups.cp_size > 1
                                      and self.lora is None)
        if self.opts.cpu_offload_fraction is not None:      # --optimizer-cpu-offload (cpu_offload.py)
            from miles.trainer.megatron.cpu_offload import build_offloaded_adamw

            self.optimizer = build_offloaded_adamw(self.lora if self.lora is not None else self.model,
                                                   fraction=self.opts.cpu_offload_fraction, **adam)
        else:
            self.optimizer = (parallel.distributed_adamw(self.model, self.groups, **adam) if self.distributed_optimizer
                              else build_adamw(self.lora if self.lora is not None else self.model, **adam))
        decay = train.lr_decay_iters or total_steps
        self.schedule = LRSchedule(lr=train.lr, min_lr=train.min_lr, style=train.lr_decay_style,
                                   warmup=train.warmup_steps(decay) if hasattr(train, "warmup_steps")
                                   else train.lr_warmup_iters, decay_iters=decay, init=train.lr_warmup_init)
        self._build_frozen()
        self.critic = None
        if algo.loss_type != "sft_loss" and algo.advantage_estimator == "ppo":
            from miles.trainer.megatron.critic import MegatronCritic

            path = train.critic_load or train.hf_checkpoint
            self.critic = MegatronCritic(self, self._build_policy(path, offload=False, recompute=True))
        self._select_loss(custom_config)
        start = self.groups.tp_rank * (self.padded_vocab // tp)
        self.vocab_shard = VocabShard(self.groups.tp, start, self.vocab_size) if tp > 1 else None
        self.peak = peak_tflops(self.device, getattr(train, "mfu_peak_tflops", None))
        # bf16 (default on GPU): Megatron's recipe, the FSDP backend's too: fp32 masters, bf16 compute copies,
        # fp32 gradients (optim.MasterWeights); the frozen reference and teacher are plain bf16 models
        self._masters = {id(m): MasterWeights([m] + ([self.lora] if m is self.model and self.lora else []))
                         for m in (self.model, self.critic.model if self.critic else None) if m is not None and self.bf16}
        self._hf_state = None                      # the converted weights are in the models now
        from miles.trainer import routing_replay

        self.routing_replay = routing_replay.install(self)   # --use-(rollout-)routing-replay (MoE)
        from miles.trainer.megatron import optional_kernels_line

        kernels = optional_kernels_line()
        if kernels and self.trainer_rank == 0:          # megatron-core's own warnings of this are filtered (__init__)
            logger.info(kernels)
        logger.info("Megatron trainer ready: %s params, TP %d x PP %d x DP %d (EP %d), device %s, %s layer spec, "
                    "bf16 %s, ref %s, critic %s", f"{self.num_params:,}", tp, self.groups.pp_size, self.world,
                    self.groups.ep_size, self.device,
                    "transformer-engine" if mmodel.use_transformer_engine(self.device) else "local", self.bf16,
                    self.ref is not None, self.critic is not None)

    # ------------------------------------------------------------------ construction
    def _hf(self, path: str) -> dict[str, torch.Tensor]:
        if path == self.cfg.hf_checkpoint and self._hf_state is not None:
            return self._hf_state
        sd = convert.read_hf_state_dict(path)
        if path == self.cfg.hf_checkpoint:
            self._hf_state = sd            # the reference model of --kl-coef reads the same weights
        return sd

    def _build_policy(self, path: str, *, offload: bool, recompute: bool, mtp: bool = False):
        from transformers import AutoConfig

        from miles.trainer.megatron import dist_ckpt, torch_dist

        megatron_ckpt, ckpt_path = torch_dist.is_megatron_root(path), path    # --ref-load of a Megatron checkpoint
        if megatron_ckpt:                       # built like --hf-checkpoint, then its weights are loaded
            path = self.cfg.hf_checkpoint
        shape = mmodel.ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
        if dataclasses.replace(shape, mtp_num_layers=self.shape.mtp_num_layers) != self.shape:
            raise ConfigError(f"{path}: its architecture differs from --hf-checkpoint's ({shape} vs {self.shape}); "
                              "the reference and teacher models must share the policy's shape.")
        shape = self.shape if mtp else shape          # the MTP block: the policy only (mtp.py)
        o = self.opts
        config = mmodel.transformer_config(
            shape, tp_size=self.groups.tp_size, device=self.device,
            recompute=o.recompute_granularity if recompute else None, recompute_method=o.recompute_method,
            recompute_num_layers=o.recompute_num_layers, attention_softmax_in_fp32=True,
            hidden_dropout=o.hidden_dropout if recompute else 0.0,
            attention_dropout=o.attention_dropout if recompute else 0.0, pp_size=o.pp,
            first_stage_layers=o.first_stage_layers, last_stage_layers=o.last_stage_layers,
            sequence_parallel=self._sequence_parallel, cp_size=o.cp, cp_comm_type=o.cp_comm_type,
            moe=moe.config_kwargs(shape, o.moe, ep=o.ep, etp=o.etp, te=mmodel.use_transformer_engine(self.device)),
            mtp_loss_scale=o.mtp_loss_scale, deterministic=self.cfg.deterministic_mode)
        core = "unfused" if o.attention_backend in ("unfused", "local") else "sdpa"
        custom = getattr(self.megatron_cfg, "custom_model_provider_path", None)
        if specs.known_provider(custom) is not None:    # Miles's own provider of a family built here: the family's
            specs.check_provider(custom, shape.model_type, FAMILIES)     # builder in its place (config/specs.py)
            custom = None
        if custom:                      # --custom-model-provider-path (provider.py): the user's GPTModel
            model, self.padded_vocab = provider.build_for_trainer(self, custom, shape, config, path)
        else:
            model = mmodel.build_gpt_model(shape, config, padded_vocab=self.padded_vocab, device=self.device,
                                           core_attention=core, pre_process=self.stage.is_first,
                                           post_process=self.stage.is_last, mtp_training=mtp and o.mtp_training,
                                           hf_config=AutoConfig.from_pretrained(path) if shape.vision else None)
        load = pipeline.load_hf_into if o.pp > 1 else convert.load_hf_into
        ep = {"ep_rank": self.groups.ep_rank, "ep_size": self.groups.ep_size} if self.groups.ep_size > 1 else {}
        try:
            load(model, self._hf(path), shape, self.padded_vocab, self.groups.tp_rank, self.groups.tp_size, **ep)
        except KeyError as e:
            if not custom:
                raise
            raise ConfigError(f"--custom-model-provider-path {custom}: {e.args[0] if e.args else e} (the "
                              f"{shape.family.name} converter's names): the provider's model must have the "
                              "parameter names of --hf-checkpoint's family; rename its modules or drop the flag."
                              ) from None
        if megatron_ckpt:
            ref = ckpt_path == self.cfg.ref_load
            dist_ckpt.load_weights(self, model, ckpt_path, getattr(self.megatron_cfg, "ref_ckpt_step", None) if ref
                                   else None, "--ref-load" if ref else "--critic-load/--opd-teacher-load")
        fork_flags.apply(model, o)          # --moe-router-freeze-gate, --no-activation-func-clamp-shared-expert
        if offload:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
                if self.bf16:                  # frozen: bf16 parameters only (as the trained models compute)
                    p.data = p.data.to(torch.bfloat16)
        return model

    def _attach_lora(self):
        spec = lora_mod.LoraSpec.from_config(self.cfg)
        if spec is None:
            return None
        lora_mod.check_megatron(self.opts, self.shape, spec)
        mtp_mod.check_mtp_lora(self.opts)
        g = self.groups
        adapters = lora_mod.attach(self.model, spec, tp_rank=g.tp_rank, tp_size=g.tp_size, tp_group=g.tp,
                                   seed=self.cfg.seed, ep_rank=g.ep_rank, ep_size=g.ep_size, ep_group=g.ep,
                                   num_experts=self.shape.num_experts or 0,
                                   inputs_require_grad=self.opts.recompute_granularity == "full",
                                   path_prefix=self.shape.family.lora_path_prefix(self.shape),
                                   family_targets=self.shape.family.lora_targets, pp_size=g.pp_size, pp_group=g.pp,
                                   timeout=self.timeout)
        n = lora_mod.trainable_count(adapters)
        logger.info("LoRA rank %d alpha %s on %s: %s trainable of %s params (base frozen)", spec.rank, spec.alpha,
                    ",".join(sorted({name.rsplit(".", 1)[-1] for name in adapters.targets})), f"{n:,}",
                    f"{self.num_params:,}")
        return adapters

    def _expert_param_count(self) -> int:
        """Parameters of every routed expert of the whole model (summed over EP and PP)."""
        n = sum(p.numel() for name, p in self.model.named_parameters() if moe.is_expert(name))
        t = torch.tensor([float(n)], dtype=torch.float64, device=self.device)
        if self.groups.ep_size > 1:
            dist.all_reduce(t, group=self.groups.ep)
        if self.groups.pp_size > 1:
            dist.all_reduce(t, group=self.groups.pp)
        return int(t.item())

    def _full_param_count(self) -> int:
        """Parameters of the whole model (TP shards summed once, PP stages summed, a tied embedding and the
        vocabulary padding counted once)."""
        named = [(n, p) for n, p in self.model.named_parameters() if not pipeline.is_tied_copy(p)]
        sharded = sum(p.numel() for n, p in named if convert.partition_dim(n) is not None)
        replicated = sum(p.numel() for n, p in named if convert.partition_dim(n) is None
                         and not moe.ep_sharded(n, self.groups))
        experts = sum(p.numel() for n, p in named if moe.ep_sharded(n, self.groups))   # EP > 1: summed over EP
        t = torch.tensor([float(sharded), float(replicated)], dtype=torch.float64, device=self.device)
        if experts:
            e = torch.tensor([float(experts)], dtype=torch.float64, device=self.device)
            dist.all_reduce(e, group=self.groups.ep)
            t[1] += e[0]
        if self.groups.tp_size > 1:
            dist.all_reduce(t[:1], group=self.groups.tp)
        if self.groups.pp_size > 1:
            dist.all_reduce(t, group=self.groups.pp)
        sharded, replicated = t.tolist()
        pad_rows = self.padded_vocab - self.vocab_size
        embeds = 1 if self.shape.tie_embeddings else 2
        return int(sharded + replicated) - pad_rows * self.shape.hidden_size * embeds

    # ------------------------------------------------------------------ forward (forward.py)
    def _policy_forward(self, model, mb: MicroBatch, *, with_entropy: bool = False, entropy_grad: bool = False,
                        x: torch.Tensor | None = None):
        """The shared step's hook: log-probs (and entropy) of ``mb``'s targets (``forward.policy_forward``; under
        pipeline parallelism the last stage's, ``x`` its input)."""
        return forward.policy_forward(self, model, mb, with_entropy=with_entropy, entropy_grad=entropy_grad, x=x)

    def _stage_forward(self, model, mb: MicroBatch, x: torch.Tensor | None = None):
        """The pipeline schedule's hook: this stage's (hidden states [s, b, h], index [N] of the
        response-predicting positions in the flattened [b * s]); ``x`` is the previous stage's output (None on the
        first stage). ``forward.rows_forward`` without its CP shard."""
        return forward.rows_forward(self, model, mb, x)[:2]

    # ------------------------------------------------------------------ training
    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Train on this model replica's samples (each rank's share, gathered over the TP x PP group)."""
        if self.groups.mp_size > 1:
            parts = bounded_all_gather_object(list(samples), self.groups.mp, self.timeout, self.device,
                                              "gathering the samples of the model-parallel group")
            samples = [s for part in parts for s in part]
        if self.groups.cp_size > 1:          # the CP ranks of a replica train the same samples (their chunks)
            parts = bounded_all_gather_object(list(samples), self.groups.cp, self.timeout, self.device,
                                              "gathering the samples of the context-parallel group")
            samples = [s for part in parts for s in part]
        return super().train(samples, rollout_id)

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """Miles's budget under context parallelism: a micro-batch of ``--max-tokens-per-gpu`` x CP tokens (each
        CP rank holds 1/CP of them)."""
        cp, budget = self.groups.cp_size, self.cfg.max_tokens_per_gpu
        if not self.cfg.use_dynamic_batch_size:
            return self._coalesce(super()._plan(lengths), lengths)
        if cp == 1:
            return super()._plan(lengths)
        if lengths and max(lengths) > budget * cp:
            raise ConfigError(f"a sample of {max(lengths)} tokens (prompt + response) exceeds --max-tokens-per-gpu "
                              f"{budget} x --context-parallel-size {cp} = {budget * cp}; raise --max-tokens-per-gpu "
                              f"to at least {-(-max(lengths) // cp)} or cap --rollout-max-response-len.")
        return plan_micro_batches(lengths, micro_batch_size=self.cfg.micro_batch_size, max_tokens=budget * cp,
                                  dynamic=True)

    def _micro_batches(self, data, ids: list[int]) -> list[MicroBatch]:
        """The planned micro-batches of this rank only: DP gradients are reduced once a step (``finish_grads``), so
        unlike FSDP's per-micro-batch collectives nothing needs every DP rank to run as many forwards: no
        all-reduce of the count, no zero-weight dummy passes (the ranks of a TP/CP/PP group plan the same
        gathered samples). MoE keeps the group-wide count (the router's auxiliary loss and the experts'
        all-to-all reach over data-parallel ranks), and so does the pipeline schedule."""
        if self.shape.num_experts or self.stage.size > 1:
            return super()._micro_batches(data, ids)
        return [pack(data, [ids[j] for j in mb]) for mb in self._plan([data[i].length for i in ids])]

    def _coalesce(self, plan: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """``--micro-batch-size N`` without dynamic batching: consecutive planned micro-batches share one forward
        and backward while it holds at most ``coalesce_tokens()`` tokens (``batching.coalesce_micro_batches``).
        The step's loss is a sum over samples normalised by the step's totals, so the loss, gradients and metrics
        are Miles's up to float summation order; each forward's fixed costs (megatron-core's Python, one
        autograd graph, per-micro-batch tensors), which were the whole step on a small model, are paid once."""
        budget = self.coalesce_tokens()
        return coalesce_micro_batches(plan, lengths, budget) if budget > 0 and len(plan) > 1 else plan

    def coalesce_tokens(self) -> int:
        """Tokens a coalesced forward may hold: ``--max-tokens-per-gpu`` (x CP) when given, else
        ``COALESCE_TOKENS`` of the device type (a micro-batch planned larger runs alone, as planned). 0 (off) for
        a ``--custom-loss-function-path`` / ``--custom-tis-function-path``, whose function sees the micro-batch, with
        ``--enable-mtp-training`` (the MTP loss is a mean per micro-batch, as Miles's: mtp.py), and under pipeline
        parallelism, whose schedule needs the micro-batches to fill the pipeline."""
        if self.algo.loss_type == "custom_loss" or self.algo.custom_tis_function_path or self.stage.size > 1 \
                or self.opts.mtp_training:
            return 0
        if self.cfg.max_tokens_per_gpu:
            return int(self.cfg.max_tokens_per_gpu) * self.groups.cp_size
        return COALESCE_TOKENS.get(self.device.type, COALESCE_TOKENS["default"])

    def _forward_pass(self, model, fn, data) -> list[torch.Tensor]:
        """With PP, a forward-only pass is a log-prob pass through the pipeline (``pipeline.forward_pass``; the
        critic, the other user of this hook, is refused with PP)."""
        if self.stage.size == 1:
            return super()._forward_pass(model, fn, data)
        with self._bf16(model):
            return pipeline.forward_pass(self, model, data)

    def _forward_backward(self, data, ids, per_sample, samples):
        """With PP, the step's micro-batches go through the pipeline schedule (``pipeline.forward_backward``)."""
        if self.stage.size == 1:
            return super()._forward_backward(data, ids, per_sample, samples)
        with self._bf16(self.model, self.critic.model if self.critic is not None else None):
            return pipeline.forward_backward(self, data, ids, per_sample, samples)

    def _micro_step(self, mb: MicroBatch, index: int, acc, per_sample, samples, ntok: float, nsamp: float,
                    acc_metrics: dict[str, torch.Tensor]) -> int:
        """The shared micro-step; with ``--enable-mtp-training`` the attached MTP loss's gradient is scaled like the
        policy loss (x DP size, over the rank's micro-batches) and ``mtp_loss`` (the step's mean) is logged."""
        if not getattr(self.model, "mtp_training", False):
            return super()._micro_step(mb, index, acc, per_sample, samples, ntok, nsamp, acc_metrics)
        share = 1.0 / max(acc.num, 1)
        mtp_mod.set_backward_scale(self.world * share, self.device)
        self.model.mtp_loss_value = None
        n = super()._micro_step(mb, index, acc, per_sample, samples, ntok, nsamp, acc_metrics)
        if self.model.mtp_loss_value is not None:
            accumulate_metrics(acc_metrics, {"mtp_loss": self.model.mtp_loss_value * (share / self.world)})
        return n

    def _clip_grad_norm(self) -> float:
        if self.lora is not None:
            lora_mod.finish_grads(self.lora, self.groups)
            return lora_mod.clip_grad_norm(self.lora, self.cfg.clip_grad)
        parallel.finish_grads(self.model, self.groups)
        return parallel.clip_grad_norm(self.model, self.groups, self.cfg.clip_grad)

    def _offload_parts(self) -> tuple[list[torch.nn.Module], list]:
        """The policy (with its LoRA adapters), the critic, and this rank's part of their optimizer state
        (--optimizer-cpu-offload: its device part; the CPU part stays in host memory)."""
        modules = [self.model] + ([self.lora] if self.lora is not None else [])
        optimizers = [self.optimizer]
        if self.critic is not None:
            modules.append(self.critic.model)
            optimizers.append(self.critic.optimizer)
        local = [parallel.local_optimizer(opt) for opt in optimizers]
        return modules, [o.device_part() if hasattr(o, "device_part") else o for o in local]

    # ------------------------------------------------------------------ weights
    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                            prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters under their HF names and shapes, bucket by bucket (TP shards gathered per
        bucket); every trainer rank must iterate to the end and receives the full tensors."""
        it = export.iter_hf_buckets(self.model, self.shape, self.groups, device=self.device,
                                    bucket_bytes=bucket_bytes, dtype=dtype, timeout=self.timeout,
                                    prefetch=prefetch, stage=self.stage, spelling=self._checkpoint_spelling())
        return it if self.lora is None else _merged_buckets(self.lora, it)   # LoRA: W + (alpha / r) B @ A

    def _checkpoint_spelling(self):
        """HF names as --hf-checkpoint spells them (``hf_layout.checkpoint_spelling``, as the FSDP backend's export
        spells them; e.g. a DeepSeek-V4 checkpoint written by ``save_pretrained``: ``model.layers.L.attn.*``);
        its safetensors headers read once."""
        if getattr(self, "_spelling", None) is None:
            from miles.trainer.weights import checkpoint_tensor_names
            from miles.weight_sync.hf_layout import checkpoint_spelling

            self._spelling = checkpoint_spelling(self.shape.model_type, checkpoint_tensor_names(self.cfg.hf_checkpoint))
        return self._spelling

    def iter_trained_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                                    prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``iter_weight_buckets`` less the tensors training never changes: under LoRA, the merged target linears'
        weights only (``--lora-base-cpu-backup``: the engines keep the frozen rest, WeightSource in weight_sync/base.py);
        without LoRA, everything."""
        if self.lora is None:
            return self.iter_weight_buckets(bucket_bytes, dtype, prefetch=prefetch)
        names = {name + ".weight" for name in self.lora.all_targets}       # every stage's (global layer names)
        it = export.iter_hf_buckets(self.model, self.shape, self.groups, device=self.device,
                                    bucket_bytes=bucket_bytes, dtype=dtype, timeout=self.timeout,
                                    prefetch=prefetch, stage=self.stage, only=names.__contains__,
                                    spelling=self._checkpoint_spelling())
        return _merged_buckets(self.lora, it)

    def iter_base_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                                 prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``iter_weight_buckets`` without merging the LoRA adapters: the frozen base, for engines that serve the
        adapters themselves (``lora_adapter``; WeightSource in weight_sync/base.py)."""
        return export.iter_hf_buckets(self.model, self.shape, self.groups, device=self.device,
                                      bucket_bytes=bucket_bytes, dtype=dtype, timeout=self.timeout,
                                      prefetch=prefetch, stage=self.stage, spelling=self._checkpoint_spelling())

    def lora_adapter(self) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
        """The LoRA adapters as an HF PEFT adapter: (adapter_config.json's dict, the PEFT-named tensors, CPU fp32);
        collective (TP, EP and PP gathers)."""
        tensors = lora_mod.peft_tensors(self.lora, self.shape)
        return lora_mod.peft_config(tensors, self.lora.spec, self.cfg.hf_checkpoint), tensors

    def mtp_weight_prefixes(self) -> tuple[str, ...]:
        """The HF name prefixes of the MTP layers ``iter_weight_buckets`` exports (``--mtp-num-layers``, mtp.py):
        ``model.layers.<num_layers + k>.``; --check-weight-update-equal skips them (engines serve the main model)."""
        if self.shape.mtp_num_layers and self.shape.family.mtp_prefix is not None:    # e.g. Qwen3-Next's mtp.*
            return (self.shape.family.mtp_prefix,)
        return tuple(f"model.layers.{self.shape.num_layers + k}." for k in range(self.shape.mtp_num_layers))

    def weight_export_is_partial(self) -> bool:
        """A multimodal checkpoint trained text-only (``Family.text_prefix``): the export is its text model, the
        towers stay as the engines loaded them (``WeightSource.weight_export_is_partial``)."""
        return self.shape.family.text_prefix(self.shape) is not None

    def _checkpoint_buffers(self, have: set[str]) -> list[tuple[str, torch.Tensor]]:
        """A multimodal checkpoint trained text-only (``Family.text_prefix``): its other tensors (the towers) as
        --hf-checkpoint holds them, so the --save-hf directory loads as the checkpoint did."""
        prefix = self.shape.family.text_prefix(self.shape)
        if prefix is None:
            return []
        return checkpoint_tensors(self.cfg.hf_checkpoint, lambda n: not n.startswith(prefix) and n not in have)

    def save_hf(self, path: str | Path) -> None:
        """The HF model dir (merged weights under LoRA), and with LoRA also the adapter alone in HF PEFT format
        under ``path/adapter`` (as Miles writes it); collective."""
        super().save_hf(path)
        if self.lora is None:
            return
        tensors = lora_mod.peft_tensors(self.lora, self.shape)
        if self.trainer_rank == 0:
            lora_mod.write_peft_adapter(Path(path) / "adapter", tensors, self.lora.spec, self.cfg.hf_checkpoint)
        self._barrier()

    # ------------------------------------------------------------------ checkpoints
    # Megatron-LM's layout: <save>/iter_<rollout_id>/ (torch_dist) + latest_checkpointed_iteration.txt
    def save(self, path: str | Path, extra: dict) -> None:
        from miles.trainer.megatron import dist_ckpt

        if self.lora is None:
            dist_ckpt.write_state(self, Path(path), extra)
            return
        with self._lora_ckpt():        # the frozen base without optimizer state; adapters + AdamW per rank
            dist_ckpt.write_state(self, Path(path), extra)
        lora_mod.save_files(self.lora, None if self.ckpt.no_save_optim else self.optimizer, Path(path),
                            self.trainer_rank, self.trainer_group)

    def load(self, path: str | Path) -> dict | None:
        from miles.trainer.megatron import dist_ckpt

        if self.lora is None:
            return dist_ckpt.load_state(self, Path(path))
        with self._lora_ckpt():
            extra = dist_ckpt.load_state(self, Path(path))
        self._load_lora(Path(path))
        return extra

    @contextlib.contextmanager
    def _lora_ckpt(self):
        ckpt = self.ckpt
        self.ckpt = dataclasses.replace(ckpt, no_save_optim=True, no_load_optim=True)
        try:
            yield
        finally:
            self.ckpt = ckpt

    def _load_lora(self, path: Path) -> None:
        lora_mod.load_files(self.lora, None if self.ckpt.no_load_optim else self.optimizer, path, self.trainer_rank)

    def checkpoint(self, rollout_id: int, extra: dict) -> Path:
        """Crash-safe save under --save as iter_<rollout_id> + the tracker (+ --save-hf); collective."""
        from miles.trainer.megatron import dist_ckpt

        path = dist_ckpt.save(self, rollout_id, extra)
        if self.ckpt.save_hf:
            self.save_hf(self.ckpt.save_hf.format(rollout_id=rollout_id))
        return path

    def resume(self) -> dict | None:
        """Load the newest usable checkpoint under --load (default --save) through ``load`` (``dist_ckpt.resume``);
        None when there is none."""
        from miles.trainer.megatron import dist_ckpt

        return dist_ckpt.resume(self)


def _merged_buckets(lora, it: Iterator) -> Iterator:
    with lora_mod.merged(lora):
        yield from it

