"""The FSDP2 backend (``--train-backend fsdp``) of the RL step (``miles.trainer.step.RLTrainer``): HF models
sharded with FSDP2 over the trainer group, one instance per trainer rank.

    trainer = build_trainer(cfg.train, cfg.algo, cfg.checkpoint, group=groups.trainer, mesh=groups.trainer_mesh,
                            device=device, rollout_temperature=..., num_rollout=..., global_batch_size=...,
                            num_steps_per_rollout=steps, timeout=...)          # miles.trainer.build

What this backend adds to the shared step: the models (``modeling.PolicyModel`` over an HF model, FSDP2-wrapped;
the PPO critic ``critic.Critic``), the packed varlen forward (``_policy_forward``; right-padded rows where SDPA
would need a block-diagonal mask), FSDP2's communication schedule across micro-batches (``accumulation.py``:
``_pass_scope``, ``_accumulation``), every pass running the same number of micro-batches on every rank (padded
with zero-weight dummies: FSDP's collectives run per micro-batch), the weight export (``iter_weight_buckets``:
shards gathered bucket by bucket; ``iter_weight_shards``: this rank's own rows, for ``p2p``), its checkpoint
format (``state.py``) and offload. Only the trainer group is used for collectives, never the default group.
A one-rank group keeps its models unwrapped (``unwrapped``): FSDP2 would only add hooks and copies there; with
bf16 the policy then computes on bf16 copies of its fp32 masters (``optim.MasterWeights``), the numbers of
FSDP2's ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from miles.trainer import modeling, routing_replay, vlm
from miles.trainer.accumulation import Accumulation, fits, unsharded_forward
from miles.trainer.batching import MicroBatch, padded_rows
from miles.trainer.checkpoint import fsdp_format
from miles.trainer.critic import Critic
from miles.trainer.metrics import active_params, moe_routing, peak_tflops
from miles.trainer.optim import LRSchedule, MasterWeights, build_adamw, clip_grad_norm
from miles.trainer.step import RLTrainer
from miles.trainer.weights import checkpoint_tensor_names, iter_checkpoint_buckets, iter_full_params
from miles.utils.logging import get_logger
from miles.weight_sync.hf_layout import CheckpointLayout
from miles.weight_sync.p2p import iter_local_shards

logger = get_logger(__name__)


class FSDPTrainer(RLTrainer):
    backend = "fsdp"

    def __init__(self, train, algo, ckpt, *, mesh, group: dist.ProcessGroup, device: torch.device,
                 rollout_temperature: float, num_rollout: int | None, global_batch_size: int | None,
                 num_steps_per_rollout: int, timeout: float, custom_config: dict | None = None):
        self.mesh, self.group = mesh, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # the whole trainer group (saves, exports, barriers): the data-parallel group here
        self.trainer_group, self.trainer_rank, self.trainer_world = group, self.rank, self.world
        self._setup(train, algo, ckpt, device=device, timeout=timeout, rollout_temperature=rollout_temperature,
                    num_rollout=num_rollout, global_batch_size=global_batch_size,
                    num_steps_per_rollout=num_steps_per_rollout)

        total_steps = num_rollout * num_steps_per_rollout if num_rollout else None
        self.mp_policy = modeling.mixed_precision(self.device, train.bf16)
        # --fsdp-cpu-offload (Miles): the policy's parameters, gradients and AdamW state live on CPU (FSDP2's
        # CPUOffloadPolicy; each block is copied to the device for its forward/backward), the step runs on CPU
        self.model = self._build_policy(train.hf_checkpoint, offload=False, recompute=train.activation_checkpointing,
                                        cpu_offload=train.fsdp_cpu_offload)
        self._masters = ({id(self.model): MasterWeights([self.model])}
                         if self.mp_policy is not None and not modeling.is_fsdp(self.model) else {})
        config = self.model.lm.config
        self.vocab_size = int(vlm.text_config(config).vocab_size)
        pad = getattr(config, "pad_token_id", None)            # a VLM's (Gemma 4) may be its text config's only
        pad = getattr(vlm.text_config(config), "pad_token_id", None) if pad is None else pad
        self.pad_id = int(pad if pad is not None else 0)
        # a vision-language --hf-checkpoint (Qwen3-VL): image inputs per micro-batch (miles.trainer.vlm)
        self._images = vlm.ImageProcessor(train.hf_checkpoint, config.image_token_id) if vlm.is_vlm(config) else None
        self.num_params = modeling.count_params(self.model)
        experts = sum(p.numel() for n, p in self.model.named_parameters() if ".experts." in n)   # Gemma 4: layers.L.*
        self.num_active_params = active_params(self.num_params, experts, moe_routing(config))  # MFU's N
        self.lora = self._attach_lora(train)       # --lora-rank: base frozen, adapters trained (lora_hf.py)
        self.optimizer = build_adamw(self.lora if self.lora is not None else self.model, lr=train.lr, weight_decay=train.weight_decay,
                                     betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                                     device=self.policy_param_device)
        self.schedule = LRSchedule(lr=train.lr, min_lr=train.min_lr, style=train.lr_decay_style,
                                   warmup=train.warmup_steps(train.lr_decay_iters or total_steps),
                                   decay_iters=train.lr_decay_iters or total_steps, init=train.lr_warmup_init)

        self._build_frozen()
        self.critic = None
        if algo.loss_type != "sft_loss" and algo.advantage_estimator == "ppo":
            self.critic = Critic(train, algo, path=train.critic_load or train.hf_checkpoint, mesh=mesh,
                                 device=self.device, total_steps=total_steps)
        self._select_loss(custom_config)
        self.peak = peak_tflops(self.device, getattr(train, "mfu_peak_tflops", None))
        self._keep_unsharded = self._unsharded_plan()
        self.routing_replay = routing_replay.install(self)   # --use-(rollout-)routing-replay (MoE)
        logger.info("FSDP trainer ready: %s params, %d rank(s)%s, device %s, attention %s, bf16 %s, ref %s, critic %s",
                    f"{self.num_params:,}", self.world, " (unwrapped: no FSDP2 on one rank)" if self.unwrapped() else "",
                    self.device, config._attn_implementation, self.mp_policy is not None, self.ref is not None,
                    self.critic is not None)

    # ------------------------------------------------------------------ construction
    def _attach_lora(self, train):
        from miles.trainer import lora as lora_mod
        from miles.trainer import lora_hf

        spec = lora_mod.LoraSpec.from_config(train)
        if spec is None:
            return None
        lora_hf.check_model(spec, self.model.lm.config.to_dict())
        adapters = lora_hf.attach_hf_model(self.model.lm, spec, seed=train.seed)    # a VLM: its text model's layers
        logger.info("LoRA rank %d alpha %s on %s: %s trainable params (base frozen)", spec.rank, spec.alpha,
                    ",".join(spec.targets), f"{sum(p.numel() for p in adapters.parameters()):,}")
        return adapters

    def _unsharded_plan(self) -> dict[int, bool]:
        """Per model (by id): may it stay unsharded across micro-batches (``accumulation.fits``)? Agreed
        over the group (MIN), since every rank must run the same FSDP collectives."""
        dtype = self.mp_policy.param_dtype if self.mp_policy is not None else None
        models = [(self.model, True), (self.ref, False), (self.teacher, False),
                  (self.critic.model if self.critic is not None else None, True)]
        models = [(m, grads) for m, grads in models if m is not None]
        ok = torch.tensor([float(fits(m, self.device, with_grads=g, param_dtype=dtype)) for m, g in models],
                          device=self.device)
        if self.world > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        return {id(m): bool(v) for (m, _), v in zip(models, ok.tolist())}

    def unwrapped(self, offload: bool = False) -> bool:
        """Whether a model of this trainer is left a plain module instead of FSDP2-wrapped: a one-rank
        trainer group (and, on GPU, not CPU-offloaded), where sharding only adds the hooks, the all-gather
        copies and the resharding of every pass, and computes the same numbers (with bf16: ``_bf16``)."""
        return self.world == 1 and not (offload and self.device.type == "cuda")

    @property
    def policy_param_device(self) -> torch.device:
        """Where the policy's parameters, gradients and optimizer state live: CPU with --fsdp-cpu-offload on GPU."""
        return torch.device("cpu") if self.cfg.fsdp_cpu_offload else self.device

    def _flag_of(self, path: str) -> str | None:
        """The flag ``path`` came from, for a one-line refusal naming it."""
        train, algo = self.cfg, self.algo
        for flag, value in (("--hf-checkpoint", train.hf_checkpoint), ("--ref-load", train.ref_load),
                            ("--opd-teacher-load", getattr(algo, "opd_teacher_load", None))):
            if value and path == value:
                return flag
        return None

    def _build_policy(self, path: str, *, offload: bool, recompute: bool,
                      cpu_offload: bool = False) -> modeling.PolicyModel:
        """``offload``: a frozen model kept on CPU between uses (ref, teacher); ``cpu_offload``: the trained
        policy under --fsdp-cpu-offload (its parameters on CPU, trainable)."""
        hf = modeling.load_hf_model(path, self.device, flag=self._flag_of(path))
        model = modeling.PolicyModel(hf)
        if cpu_offload and self.device.type == "cuda":
            modeling.shard_model(model, modeling.decoder_blocks(hf), self.mesh, mp_policy=self.mp_policy,
                                 offload=True, recompute=recompute)
        elif self.unwrapped(offload):
            if recompute:
                modeling._enable_recompute(modeling.decoder_blocks(hf))
            model.to(self.device)
        else:
            modeling.shard_model(model, modeling.decoder_blocks(hf), self.mesh, mp_policy=self.mp_policy,
                                 offload=offload, recompute=recompute)
        if offload:
            model.eval()
            plain_bf16 = self.mp_policy is not None and not modeling.is_fsdp(model)
            for p in model.parameters():
                p.requires_grad_(False)
                if plain_bf16:                 # frozen and plain: bf16 parameters only (buffers, RoPE's, stay)
                    p.data = p.data.to(self.mp_policy.param_dtype)
        return model

    # ------------------------------------------------------------------ forward
    def _policy_forward(self, model, mb: MicroBatch, *, with_entropy: bool = False, entropy_grad: bool = False):
        ids, pos, index = mb.input_ids, mb.position_ids, mb.logit_index
        mm = None
        if self._images is not None:  # a VLM: always rows, its own 3-D positions, the micro-batch's images
            ids, pos, index = padded_rows(mb, self.pad_id)
            mm = vlm.batch_inputs(self._mm or [], mb.sample_ids, ids, self._images.image_token_id, ids.device)
        elif self._as_rows(model, mb):
            ids, pos, index = padded_rows(mb, self.pad_id)
        return model(ids, pos, index, mb.targets, mb.cu_seqlens, mb.max_seqlen, mm=mm,
                     temperature=self.temperature, chunk_size=self.cfg.log_probs_chunk_size,
                     with_entropy=with_entropy, entropy_grad=entropy_grad)

    @staticmethod
    def _as_rows(model, mb: MicroBatch) -> bool:
        """Run a micro-batch of several samples as right-padded rows rather than one packed row: without
        varlen attention (SDPA), when the padding at most doubles the tokens; always for a model that cannot be
        packed (``modeling.NO_PACKING``). SDPA then needs no [T, T]
        block-diagonal mask (building and applying it dominated small steps on CPU); same values up to
        float rounding (tests/unit/trainer/test_logprobs_packing.py compares packed and unpacked)."""
        k = int(mb.cu_seqlens.numel()) - 1
        if k >= 2 and getattr(model.lm.config, "model_type", None) in modeling.NO_PACKING:
            return True                                  # DeepSeek-V4: never packed (modeling.NO_PACKING)
        if k < 2 or model.lm.config._attn_implementation == modeling.VARLEN_ATTN:
            return False
        return k * int(mb.max_seqlen) <= 2 * mb.num_tokens

    def _pass_scope(self, model, num_micro_batches: int) -> contextlib.AbstractContextManager:
        """A forward-only pass gathers the parameters once when they fit (``accumulation.unsharded_forward``) and
        leaves the model resharded."""
        stack = contextlib.ExitStack()
        stack.callback(modeling.reshard_all, model)
        stack.enter_context(unsharded_forward(model, num_micro_batches, enabled=self._keep_unsharded[id(model)]))
        return stack

    def _accumulation(self, models: list, num_micro_batches: int) -> Accumulation:
        return Accumulation(models, num_micro_batches, enabled=all(self._keep_unsharded[id(m)] for m in models))

    def _clip_grad_norm(self) -> float:
        """The step's gradient norm, clipped to --clip-grad (FSDP2 reduced the gradients in the backward; LoRA:
        the replicated adapters' gradients are averaged over the group here)."""
        if self.lora is not None:
            from miles.trainer.lora_hf import finish_grads

            finish_grads(self.lora, self.group, self.world)
            return clip_grad_norm(list(self.lora.parameters()), self.cfg.clip_grad)
        return clip_grad_norm(list(self.model.parameters()), self.cfg.clip_grad)

    # ------------------------------------------------------------------ weights
    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                            prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters under the checkpoint's names and shapes, bucket by bucket; every trainer rank must
        iterate to the end. The gather of bucket k+1 is issued before bucket k is yielded (``prefetch``).
        transformers' load-time conversion is reverted (``_checkpoint_layout``: renames, fused MoE experts per
        expert), as ``save_pretrained`` does."""
        modeling.reshard_all(self.model)
        layout = self._checkpoint_layout()
        if self.lora is not None:                  # LoRA: merged in the parameters' dtype, then cast (lora_hf.py)
            from miles.trainer.lora_hf import merge_buckets

            return iter_checkpoint_buckets(merge_buckets(self.lora, iter_full_params(
                self.model, group=self.group, device=self.device, bucket_bytes=bucket_bytes, dtype=None,
                name_fn=modeling.hf_name, timeout=self.timeout, prefetch=prefetch, together=layout.together), dtype),
                layout)
        return iter_checkpoint_buckets(iter_full_params(
            self.model, group=self.group, device=self.device, bucket_bytes=bucket_bytes, dtype=dtype,
            name_fn=modeling.hf_name, timeout=self.timeout, prefetch=prefetch, together=layout.together), layout)

    def iter_base_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                                 prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``iter_weight_buckets`` without merging the LoRA adapters: the frozen base, for engines that serve the
        adapters themselves (``lora_adapter``; WeightSource in weight_sync/base.py)."""
        modeling.reshard_all(self.model)
        layout = self._checkpoint_layout()
        return iter_checkpoint_buckets(iter_full_params(
            self.model, group=self.group, device=self.device, bucket_bytes=bucket_bytes, dtype=dtype,
            name_fn=modeling.hf_name, timeout=self.timeout, prefetch=prefetch, together=layout.together), layout)

    def lora_adapter(self) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
        """The LoRA adapters as an HF PEFT adapter: (adapter_config.json's dict, the PEFT-named tensors); the
        adapters are replicated on every rank, so nothing is gathered."""
        from miles.trainer import lora as lora_mod
        from miles.trainer import lora_hf

        tensors = lora_hf.peft_tensors(self.lora)
        return lora_mod.peft_config(tensors, self.lora.spec, self.cfg.hf_checkpoint), tensors

    def _checkpoint_names(self) -> frozenset[str] | None:
        """The tensor names of --hf-checkpoint (read once; None when it has no safetensors)."""
        if getattr(self, "_ckpt_names", None) is None:
            self._ckpt_names = checkpoint_tensor_names(self.cfg.hf_checkpoint)
        return self._ckpt_names or None

    def _checkpoint_layout(self) -> CheckpointLayout:
        """Where the checkpoint's tensors lie in the policy's (``miles.weight_sync.hf_layout``; built once, on meta
        tensors, from transformers' conversion of --hf-checkpoint at load)."""
        if getattr(self, "_layout", None) is None:
            tensors = [(modeling.hf_name(n), tuple(t.shape)) for n, t in
                       [*self.model.named_parameters(), *self.model.named_buffers()]]
            self._layout = CheckpointLayout(self.model.lm, tensors, self._checkpoint_names())
        return self._layout

    def iter_weight_shards(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[list]:
        """This rank's own FSDP2 shards in the buckets of ``iter_weight_buckets`` and under its names and shapes
        (the same ``_checkpoint_layout``), without any gather (``--update-weight-transfer-mode p2p``:
        ``miles.weight_sync.p2p.iter_local_shards``)."""
        modeling.reshard_all(self.model)
        return iter_local_shards(self.model, rank=self.rank, world=self.world, bucket_bytes=bucket_bytes, dtype=dtype,
                                 device=self.device, name_fn=modeling.hf_name, layout=self._checkpoint_layout())

    def _checkpoint_buffers(self, have: set[str]) -> list[tuple[str, torch.Tensor]]:
        """Buffers the checkpoint stores beside the parameters (DeepSeek-style routers' ``e_score_correction_bias``),
        in their own dtype: FSDP2 keeps buffers whole on every rank, and a reload without them routes wrongly."""
        names, layout = self._checkpoint_names() or frozenset(), self._checkpoint_layout()
        out = layout.revert([(modeling.hf_name(n), b.detach()) for n, b in self.model.named_buffers()])
        return [(n, b.cpu().clone()) for n, b in out if n in names and n not in have]

    def weight_export_is_partial(self) -> bool:
        """The export holds the parameters only: where the checkpoint also stores buffers (routers'
        ``e_score_correction_bias``, never trained) they stay as the engines loaded them, so disk-delta's full
        versions say they are partial (``WeightSource.weight_export_is_partial``)."""
        if getattr(self, "_partial_export", None) is None:
            self._partial_export = bool(self._checkpoint_buffers(set()))
        return self._partial_export

    def save_hf(self, path: str | Path) -> None:
        """The HF model dir (merged weights under LoRA) and with LoRA the adapter alone in HF PEFT format under
        ``path/adapter/``, as the Megatron backend writes it; collective."""
        super().save_hf(path)
        if self.lora is not None and self.rank == 0:
            from miles.trainer import lora as lora_mod
            from miles.trainer import lora_hf

            lora_mod.write_peft_adapter(Path(path) / "adapter", lora_hf.peft_tensors(self.lora), self.lora.spec,
                                        self.cfg.hf_checkpoint)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra: dict) -> None:
        """Write model, optimizer (unless --no-save-optim), schedule, RNG and ``extra`` into ``path``
        (a directory every trainer rank sees); collective. Use ``checkpoint`` for the crash-safe layout."""
        fsdp_format.write(self, Path(path), extra)

    def load(self, path: str | Path) -> dict:
        """Restore what ``save`` wrote; returns ``extra``. Collective."""
        return fsdp_format.read(self, Path(path))

    def checkpoint(self, rollout_id: int, extra: dict) -> Path:
        """Crash-safe save under --save as step_<rollout_id> (+ --save-hf, formatted with rollout_id)."""
        path = fsdp_format.save(self, rollout_id, extra)
        if self.ckpt.save_hf:
            self.save_hf(self.ckpt.save_hf.format(rollout_id=rollout_id))
        return path

    def resume(self) -> dict | None:
        """Load the newest usable complete checkpoint under --load (default --save), skipping corrupt ones
        with a warning (``fsdp_format.resume``); None when there is none."""
        return fsdp_format.resume(self)

    # ------------------------------------------------------------------ colocation
    def _offload_parts(self) -> tuple[list[torch.nn.Module], list]:
        """The policy (with its LoRA adapters) and its AdamW, unless --fsdp-cpu-offload keeps them in (pinned) host
        memory on GPU already; the critic and its AdamW."""
        modules, optimizers = [], []
        if not (self.cfg.fsdp_cpu_offload and self.device.type == "cuda"):
            modules += [self.model] + ([self.lora] if self.lora is not None else [])
            optimizers.append(self.optimizer)
        if self.critic is not None:
            modules.append(self.critic.model)
            optimizers.append(self.critic.optimizer)
        return modules, optimizers
