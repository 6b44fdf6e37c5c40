"""The RL step both trainer backends share: ``RLTrainer``, whose subclasses (``miles.trainer.fsdp.FSDPTrainer``,
``miles.trainer.megatron.trainer.MegatronTrainer``) are siblings that implement only what differs.

    trainer = build_trainer(cfg.train, cfg.algo, cfg.checkpoint, cfg.megatron, group=..., device=..., ...)
    metrics = trainer.train(my_samples, rollout_id)          # on every trainer rank, whole groups per rank
    for bucket in trainer.iter_weight_buckets(512 << 20, torch.bfloat16): ...   # lockstep on all trainer ranks

``train`` runs, in order: forward-only passes (old log-probs unless --use-rollout-logprobs or they would equal
the first training forward, reference log-probs when --kl-coef != 0 or --use-kl-loss, teacher log-probs for
--use-opd --opd-type model, critic values for ppo), advantages and returns, then --num-steps-per-rollout
optimizer steps over contiguous slices of the local samples. Losses are normalised by step totals over the
(data-parallel) group ``self.group``, so N ranks compute what one rank with all the samples would. Each phase is
timed (``metrics.TRAIN_PHASES``, ``phase/*`` metrics). Here: sample validation, micro-batch planning, the
forward-only passes, advantages, the loss family (``losses.py``) per micro-batch, the optimizer step with its
schedule and non-finite guard, metrics, --save-interval, --deterministic-mode, ``save_hf`` and
``state_dict_for_check``.

What a backend provides (abstract below): its models (``_build_policy``, the critic in its constructor), the
policy forward to log-probs (``_policy_forward``), the gradient reduction and clipping (``_clip_grad_norm``),
the weight export (``iter_weight_buckets``: full HF-named tensors on every trainer rank), the checkpoint format
(``save``/``load``/``checkpoint``/``resume``), what offload moves (``_offload_parts``); and optionally how a pass keeps parameters
gathered (``_pass_scope``, ``_accumulation``: FSDP2's resharding), ``iter_weight_shards`` (``p2p`` weight sync
from local shards, FSDP only) and ``_checkpoint_buffers``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.distributed as dist

from miles.config.base import ConfigError
from miles.trainer.advantages import AdvantageInputs, compute_advantages_and_returns
from miles.trainer.batching import MicroBatch, SampleData, padded_micro_batches, plan_micro_batches, split_into_steps
from miles.trainer.collectives import bounded_union_of_names
from miles.trainer.hf_export import checkpoint_dtype, write_hf_dir
from miles.trainer.losses import (
    accumulate_metrics,
    cat_per_sample,
    custom_loss,
    dummy_micro_batch_loss,
    load_custom_loss,
    load_tis_function,
    micro_batch_loss,
    policy_loss,
    policy_loss_with_tis,
    sft_loss,
)
from miles.trainer.metrics import MetricSums, PhaseClock, extra_metrics, mfu, step_means
from miles.trainer.optim import finite_step
from miles.types import Sample
from miles.utils.logging import get_logger, warn_once

logger = get_logger(__name__)


class _Plain:
    """A step's micro-batches without any communication schedule (the default ``_accumulation``)."""

    def __init__(self, num: int) -> None:
        self.num = num

    def __enter__(self) -> _Plain:
        return self

    def before_backward(self, index: int) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


def teacher_in_trainer(algo) -> bool:
    """Whether the OPD teacher is a model of the trainer (--use-opd --opd-type model / megatron)."""
    flag = getattr(algo, "opd_teacher_in_trainer", None)
    if flag is not None:
        return bool(flag)
    return bool(algo.use_opd and algo.opd_type == "model")


class RLTrainer(ABC):
    """One instance per trainer rank; see the module docstring. Attributes every backend sets: ``cfg``, ``algo``,
    ``ckpt``, ``device``, ``timeout``, ``group``/``rank``/``world`` (the data-parallel group the step's sums run
    over), ``trainer_group``/``trainer_rank``/``trainer_world`` (the whole trainer group: saves, exports,
    barriers), ``model``, ``optimizer``, ``schedule``, ``ref``, ``teacher``, ``critic``, ``loss_fn``,
    ``vocab_size``, ``pad_id``, ``num_params``, ``num_active_params``, ``peak``, ``_masters``, ``_images``."""

    backend: ClassVar[str]                        # the --train-backend value this class serves

    # ------------------------------------------------------------------ construction (shared parts)
    def _setup(self, train, algo, ckpt, *, device: torch.device, timeout: float, rollout_temperature: float,
               num_rollout: int | None, global_batch_size: int | None, num_steps_per_rollout: int) -> None:
        """The flags, the checks every backend makes, the seed and --deterministic-mode; first in a constructor."""
        self.cfg, self.algo, self.ckpt = train, algo, ckpt
        self.device, self.timeout = torch.device(device), float(timeout)
        self.num_rollout, self.global_batch_size = num_rollout, global_batch_size
        self.num_steps_per_rollout = num_steps_per_rollout
        self._validate(rollout_temperature)
        self.temperature = float(rollout_temperature) if algo.loss_type != "sft_loss" else 1.0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(train.seed)
        if train.deterministic_mode:
            self._deterministic_mode()
        self.last_rollout_id: int | None = None
        self._mm: list | None = None
        self._disk = None                         # --offload-train-target disk (disk_offload.py): this rank's files
        if getattr(train, "offload_train_target", "cpu") == "disk":
            from miles.trainer.disk_offload import DiskOffload

            self._disk = DiskOffload(train.offload_disk_root, rank=dist.get_rank() if dist.is_initialized() else 0,
                                     chunk_bytes=train.offload_train_disk_chunk_mb << 20, device=self.device)

    @staticmethod
    def _deterministic_mode() -> None:
        """--deterministic-mode, as Miles sets it up for Megatron
        (radixark/miles@v0.1.0:miles/backends/megatron_utils/initialize.py): deterministic torch algorithms (an op
        without one raises),
        cuDNN deterministic and not autotuned; cuBLAS needs its workspace setting before its first use."""
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)

    def _validate(self, temperature: float) -> None:
        t, a = self.cfg, self.algo
        if t.train_backend != self.backend:
            raise ValueError(f"{type(self).__name__} serves --train-backend {self.backend}, got {t.train_backend!r}.")
        if not t.hf_checkpoint:
            raise ConfigError(f"--hf-checkpoint DIR is required: the {self.backend} trainer builds the model from a "
                              "local HF directory.")
        if a.loss_type != "sft_loss" and temperature <= 0:
            raise ConfigError(f"--rollout-temperature must be > 0 for RL training (log-probs are taken under it), "
                              f"got {temperature}.")
        if t.use_dynamic_batch_size and not t.max_tokens_per_gpu:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N.")
        if self.num_steps_per_rollout is None or self.num_steps_per_rollout <= 0:
            raise ValueError(f"num_steps_per_rollout must be a positive int, got {self.num_steps_per_rollout} "
                             "(set --num-steps-per-rollout or --global-batch-size).")
        if teacher_in_trainer(a) and not a.opd_teacher_load:
            raise ConfigError(f"--use-opd --opd-type {a.opd_type} needs --opd-teacher-load DIR.")

    def _build_frozen(self) -> None:
        """The frozen reference (--kl-coef != 0 or --use-kl-loss) and teacher (OPD in the trainer) models."""
        train, algo = self.cfg, self.algo
        policy = algo.loss_type != "sft_loss"
        self.ref = self.teacher = None
        if policy and (algo.kl_coef != 0 or algo.use_kl_loss):
            self.ref = self._build_policy(train.ref_load or train.hf_checkpoint, offload=True, recompute=False)
        if policy and teacher_in_trainer(algo):
            self.teacher = self._build_policy(algo.opd_teacher_load, offload=True, recompute=False)

    def _select_loss(self, custom_config: dict | None) -> None:
        """``self.loss_fn`` from --loss-type, --custom-loss-function-path, --custom-tis-function-path."""
        train, algo = self.cfg, self.algo
        if algo.loss_type == "sft_loss":
            self.loss_fn = sft_loss
        elif algo.loss_type == "custom_loss":
            self.loss_fn = custom_loss(load_custom_loss(algo.custom_loss_function_path))
        elif algo.custom_tis_function_path:  # Miles's args: the flags, then the --custom-config-path extras
            tis_args = SimpleNamespace(**{**(custom_config or {}), **asdict(train), **asdict(algo)})
            self.loss_fn = policy_loss_with_tis(load_tis_function(algo.custom_tis_function_path), tis_args)
        else:
            self.loss_fn = policy_loss

    # ------------------------------------------------------------------ what a backend implements
    @abstractmethod
    def _build_policy(self, path: str, *, offload: bool, recompute: bool) -> torch.nn.Module:
        """A policy-shaped model from ``path``; ``offload``: frozen (reference, teacher)."""

    @abstractmethod
    def _policy_forward(self, model, mb: MicroBatch, *, with_entropy: bool = False, entropy_grad: bool = False):
        """(log-probs [N], entropy [N] or None) of the micro-batch's response tokens under ``self.temperature``."""

    @abstractmethod
    def _clip_grad_norm(self) -> float:
        """Finish the step's gradients (reductions the backend owes), clip to --clip-grad; the norm."""

    @abstractmethod
    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                            prefetch: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters under their HF names, bucket by bucket; every trainer rank iterates to the end and
        receives the full tensors."""

    @abstractmethod
    def save(self, path: str | Path, extra: dict) -> None: ...

    @abstractmethod
    def load(self, path: str | Path) -> dict | None: ...

    @abstractmethod
    def checkpoint(self, rollout_id: int, extra: dict) -> Path: ...

    @abstractmethod
    def resume(self) -> dict | None: ...

    @abstractmethod
    def _offload_parts(self) -> tuple[list[torch.nn.Module], list]:
        """What offload/onload moves: the trained modules (parameters, gradients, buffers: the policy, its LoRA
        adapters, the critic) and the holders of their optimizer state (objects with a torch optimizer's ``state``)."""

    def _pass_scope(self, model, num_micro_batches: int) -> contextlib.AbstractContextManager:
        """Around a forward-only pass of ``num_micro_batches`` (FSDP: parameters gathered once)."""
        return contextlib.nullcontext()

    def _accumulation(self, models: list, num_micro_batches: int):
        """Around a step's forwards and backwards: an object with ``num`` and ``before_backward(index)``."""
        return _Plain(num_micro_batches)

    def _checkpoint_buffers(self, have: set[str]) -> list[tuple[str, torch.Tensor]]:
        """Buffers ``save_hf`` writes beside the parameters (none by default)."""
        return []

    # ------------------------------------------------------------------ data
    def _sample_data(self, s: Sample, i: int) -> SampleData:
        where = f"sample {i} (index {s.index}, group {s.group_index})"
        n, r = len(s.tokens), int(s.response_length)
        if r <= 0 or r >= n:
            raise ValueError(f"{where}: response_length {r} with {n} tokens; the trainer needs at least one prompt "
                             "token and one response token (drop empty or aborted samples before training).")
        # the bounds on the Python ints (a sample's few tokens): two tensor reductions and their host reads cost
        # more than the sample's whole tensor; a tensor of tokens (not a list) is checked the same way
        hi, lo = (max(s.tokens), min(s.tokens)) if isinstance(s.tokens, list) else (None, None)
        tokens = torch.as_tensor(s.tokens, dtype=torch.long)
        if hi is None:
            hi, lo = int(tokens.max()), int(tokens.min())
        if hi >= self.vocab_size or lo < 0:
            bad = hi if hi >= self.vocab_size else lo
            raise ValueError(f"{where}: token id {int(bad)} is outside the model's vocabulary of "
                             f"{self.vocab_size} (--hf-checkpoint and the engine's tokenizer disagree).")
        if s.loss_mask is None:
            mask = torch.ones(r, dtype=torch.float32)
        else:
            if len(s.loss_mask) != r:
                raise ValueError(f"{where}: loss_mask has {len(s.loss_mask)} entries, response_length is {r}.")
            mask = torch.as_tensor(s.loss_mask, dtype=torch.float32)
        if s.remove_sample:            # Miles: kept (its group's advantages saw it), trained on by no token
            mask = torch.zeros(r, dtype=torch.float32)
        return SampleData(tokens=tokens, response_length=r, loss_mask=mask)

    def _per_sample_floats(self, samples: list[Sample], what: str, getter, required: bool) -> list[torch.Tensor] | None:
        vals = [getter(s) for s in samples]
        if all(v is None for v in vals) and not required:
            return None
        out = []
        for i, (s, v) in enumerate(zip(samples, vals)):
            if v is None or len(v) != s.response_length:
                got = "none" if v is None else f"{len(v)} values"
                raise ValueError(f"sample {i} (index {s.index}): {what} must have one value per response token "
                                 f"({s.response_length}), got {got}.")
            out.append(torch.as_tensor(v, dtype=torch.float32))
        return out

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        return plan_micro_batches(lengths, micro_batch_size=self.cfg.micro_batch_size,
                                  max_tokens=self.cfg.max_tokens_per_gpu, dynamic=self.cfg.use_dynamic_batch_size)

    def _micro_batches(self, data: list[SampleData], ids: list[int]) -> list[MicroBatch]:
        """The planned micro-batches, as many on every rank of the group (zero-weight dummies pad the count)."""
        sub = self._plan([data[i].length for i in ids])
        return padded_micro_batches(data, [[ids[j] for j in mb] for mb in sub], self.group, self.device, self.pad_id)

    def _bf16(self, *models) -> contextlib.ExitStack:
        """The trained ``models`` with bf16 compute copies of fp32 masters (``self._masters``) run on their bf16
        copies inside; their fp32 masters and gradients are back on exit (``optim.MasterWeights``)."""
        stack = contextlib.ExitStack()
        for m in models:
            if m is not None and id(m) in getattr(self, "_masters", {}):
                stack.enter_context(self._masters[id(m)].compute())
        return stack

    @torch.no_grad()
    def _forward_pass(self, model, fn, data: list[SampleData]) -> list[torch.Tensor]:
        """Run ``fn(micro_batch) -> [N]`` over all local samples; per-sample CPU float32 results."""
        out: list[torch.Tensor | None] = [None] * len(data)
        mbs = self._micro_batches(data, list(range(len(data))))
        done: list[tuple[MicroBatch, torch.Tensor]] = []
        with self._bf16(model), self._pass_scope(model, len(mbs)):
            for mb in mbs:
                vals = fn(mb.to(self.device))
                if not mb.is_dummy:
                    done.append((mb, vals.float()))
        if done:                                   # one device -> host copy for the whole pass
            flat = torch.cat([v for _, v in done]).cpu().split([sum(mb.lengths) for mb, _ in done])
            for (mb, _), vals in zip(done, flat):
                for sid, piece in zip(mb.sample_ids, vals.split(mb.lengths)):
                    out[sid] = piece
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ training
    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Train on this rank's share of a rollout (see module docstring); metrics reduced over the group."""
        if self._disk is not None and self._disk.spilled:   # its tensors have no memory: reading them would crash
            raise RuntimeError("train() while the trainer's state is spilled to disk (--offload-train-target disk): "
                               "call onload() first")
        self._sync()
        t_start = time.perf_counter()
        clock = self.clock = PhaseClock(self._sync)
        policy = self.algo.loss_type != "sft_loss"
        with clock("data"):
            data = [self._sample_data(s, i) for i, s in enumerate(samples)]
            if getattr(self, "_images", None) is not None:
                self._mm = [self._images.sample_inputs(s, f"sample {i} (index {s.index})") for i, s in enumerate(samples)]
        with clock("logprobs"):
            per_sample, n_fwd_passes = self._prepare(samples, data, policy)
        advantages, extras = None, {}
        # --num-critic-only-steps (PPO): the first rollouts train the critic only, the actor stays as it is
        self._actor_frozen = self.critic is not None and rollout_id < self.cfg.num_critic_only_steps
        with clock("advantages"):
            if policy and self.algo.compute_advantages_and_returns:  # --disable-compute-advantages-and-returns
                self._advantages(samples, data, per_sample)
                advantages, extras = per_sample["adv"], per_sample.pop("extras")

        t_train = time.perf_counter()
        self._rollout_id = rollout_id
        step_sums, grad_norms, critic_stats, local_tokens, lr = [], [], [], 0, 0.0
        for ids in split_into_steps(len(data), self.num_steps_per_rollout):
            sums, gn, lr, cst, ntok = self._train_step(data, ids, per_sample, samples)
            step_sums.append(sums)
            grad_norms.append(gn)
            critic_stats.append(cst)
            local_tokens += ntok
        self._sync()
        t_end = time.perf_counter()

        with clock("metrics"):             # this rank's sums; the group's come from ONE all-gather below
            keys = self._all_keys(set().union(*(s.sums.keys() for s in step_sums)))
            step_local = [v for s in step_sums for v in s.values(keys)]
            extra_names, extra_local = self._extra_local(data, extras, advantages, samples if policy else None)
            perf_local = [float(local_tokens), float(sum(d.length for d in data)), float(len(data))]
        phase_names = sorted(clock.times)
        rows = self._group_rows(step_local + extra_local + perf_local + [t_end - t_train, t_end - t_start]
                                + [clock.times[n] for n in phase_names])        # [world][...]: every rank's values
        n_sums = len(step_local) + len(extra_local) + len(perf_local)
        tot = [sum(r[j] for r in rows) for j in range(n_sums)]     # the group sums, summed in rank order
        metrics = step_means(keys, tot[:len(step_local)], len(step_sums))
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if self.cfg.check_for_nan_in_loss_and_grad:      # the steps finite_step skipped (0 in a healthy run)
            metrics["nonfinite_grad_steps"] = float(sum(not math.isfinite(g) for g in grad_norms))
        metrics["lr"] = lr
        if self.critic is not None:
            metrics["critic_grad_norm"] = sum(c["critic_grad_norm"] for c in critic_stats) / len(critic_stats)
        metrics.update(extra_metrics(extra_names, tot[len(step_local):len(step_local) + len(extra_local)],
                                     samples if policy else None))
        metrics.update(self._perf_metrics(rollout_id, n_fwd_passes, tot[n_sums - len(perf_local):n_sums],
                                          [r[n_sums:] for r in rows], phase_names))
        self.last_rollout_id = rollout_id
        self._mm = None                            # this rollout's pixel values (a VLM) are not kept
        return metrics

    def _advantages(self, samples: list[Sample], data: list[SampleData], per_sample: dict) -> None:
        """Fills ``per_sample["adv"]``, ``["ret"]`` and ``["extras"]`` (reward-shaping terms for metrics)."""
        inp = AdvantageInputs(
            rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
            group_ids=[s.group_index for s in samples], loss_masks=[d.loss_mask for d in data],
            log_probs=per_sample["old"], ref_log_probs=per_sample["ref"], values=per_sample["values"],
            teacher_log_probs=per_sample["teacher"], opd_reverse_kl=per_sample.get("opd_rkl"))
        per_sample["adv"], per_sample["ret"], per_sample["extras"] = compute_advantages_and_returns(
            self.algo, inp, self.group, self.device)

    def _prepare(self, samples: list[Sample], data: list[SampleData], policy: bool) -> tuple[dict, int]:
        """Validate per-sample inputs and run the forward-only passes. Returns (per-sample lists, #passes)."""
        a = self.algo
        per: dict[str, list[torch.Tensor] | None] = dict.fromkeys(
            ("old", "rollout", "ref", "teacher", "values", "adv", "ret"))
        per["rollout"] = self._per_sample_floats(samples, "rollout_log_probs", lambda s: s.rollout_log_probs,
                                                 required=policy and (a.use_rollout_logprobs or a.use_tis))
        if policy and a.use_opd and a.opd_type == "sglang" and a.opd_log_prob_top_k > 0:  # top-k OPD
            per["opd_rkl"] = self._per_sample_floats(samples, 'metadata["opd_reverse_kl"]',
                                                     lambda s: s.metadata.get("opd_reverse_kl"), required=True)
        elif policy and a.use_opd and a.opd_type == "sglang":
            per["teacher"] = self._per_sample_floats(samples, 'metadata["teacher_log_probs"]',
                                                     lambda s: s.metadata.get("teacher_log_probs"), required=True)
        if policy and any(s.reward is None for s in samples):
            bad = next(i for i, s in enumerate(samples) if s.reward is None)
            raise ValueError(f"sample {bad} (index {samples[bad].index}) has no reward; policy training needs a "
                             "reward per sample (or use --loss-type sft_loss).")
        passes = 0
        # old log-probs equal the first training forward's when there is one step and nothing before
        # training needs them; then the training forward supplies them (detached)
        need_old_for_adv = a.kl_coef != 0 or a.use_opd
        skip_old = a.use_rollout_logprobs or (self.num_steps_per_rollout == 1 and not need_old_for_adv)
        if policy and not skip_old:
            self.model.eval()
            per["old"] = self._forward_pass(self.model, lambda mb: self._policy_forward(self.model, mb)[0], data)
            passes += 1
        if a.use_rollout_logprobs:
            per["old"] = per["rollout"]
        for name, model in (("ref", self.ref), ("teacher", self.teacher)):
            if model is not None:
                per[name] = self._forward_pass(model, lambda mb, m=model: self._policy_forward(m, mb)[0], data)
                passes += 1
        if self.critic is not None:
            self.critic.model.eval()
            per["values"] = self._forward_pass(self.critic.model, self.critic.values, data)
            passes += 1
        return per, passes

    def _train_step(self, data, ids, per_sample, samples) -> tuple[MetricSums, float, float, dict, int]:
        clock = getattr(self, "clock", None) or PhaseClock(self._sync)
        with clock("fwd_bwd"):
            sums, n_local_tokens = self._forward_backward(data, ids, per_sample, samples)
        with clock("optimizer"):
            grad_norm = self._clip_grad_norm()
            lr = self.schedule.apply(self.optimizer)
            ok = finite_step(grad_norm, self.cfg.check_for_nan_in_loss_and_grad,
                             f"rollout {getattr(self, '_rollout_id', '?')}, actor", log=self.trainer_rank == 0)
            if ok and not getattr(self, "_actor_frozen", False):
                self.optimizer.step()
                self.schedule.advance()
            self.optimizer.zero_grad(set_to_none=True)
            cstats = self.critic.step() if self.critic is not None else {}
        return sums, grad_norm, lr, cstats, n_local_tokens

    def _forward_backward(self, data, ids, per_sample, samples) -> tuple[MetricSums, int]:
        """One optimizer step's micro-batches, forward and backward (gradients accumulated); (metric sums, tokens)."""
        mbs = self._micro_batches(data, ids)
        ntok, nsamp = self._group_sum([float(sum(float(data[i].loss_mask.sum()) for i in ids)), float(len(ids))])
        self.model.train()
        if self.critic is not None:
            self.critic.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = MetricSums()
        acc_metrics: dict[str, torch.Tensor] = {}      # on the device: no host sync per micro-batch
        n_local_tokens = 0
        models = [self.model] + ([self.critic.model] if self.critic is not None else [])
        with self._bf16(*models), self._accumulation(models, len(mbs)) as acc:
            for i, mb in enumerate(mbs):
                n_local_tokens += self._micro_step(mb, i, acc, per_sample, samples, ntok, nsamp, acc_metrics)
        if acc_metrics:
            keys = sorted(acc_metrics)
            host = torch.stack([acc_metrics[k] for k in keys]).cpu()
            sums.add(dict(zip(keys, host.unbind())))
        return sums, n_local_tokens

    def _micro_step(self, mb: MicroBatch, index: int, acc, per_sample, samples, ntok: float,
                    nsamp: float, acc_metrics: dict[str, torch.Tensor]) -> int:
        """Forward and backward of one micro-batch; adds its metrics to ``acc_metrics``. Returns its tokens."""
        a = self.algo
        dmb = mb.to(self.device)
        lp, ent = self._policy_forward(self.model, dmb, with_entropy=True, entropy_grad=a.entropy_coef != 0)
        acc.before_backward(index)
        if mb.is_dummy:
            dummy_micro_batch_loss(lp, ent).backward()
            if self.critic is not None:
                self.critic.backward(dmb, None, None, None, 1.0)
            return 0
        loss, metrics, reduce = micro_batch_loss(self.loss_fn, a, mb, dmb, lp, ent, per_sample, samples, ntok, nsamp,
                                                 self.device)
        (loss * self.world).backward()            # gradients are averaged over the (data-parallel) group
        if self.critic is not None:
            values, ret = (cat_per_sample(per_sample, k, mb.sample_ids, self.device) for k in ("values", "ret"))
            metrics = {**metrics, **self.critic.backward(dmb, values, ret, reduce, float(self.world))}
        accumulate_metrics(acc_metrics, metrics)
        return mb.num_tokens

    # ------------------------------------------------------------------ metrics
    def _perf_metrics(self, rollout_id: int, n_fwd_passes: int, totals: list[float], per_rank: list[list[float]],
                      names: list[str]) -> dict[str, float]:
        """From the group's (trained tokens, tokens, samples) ``totals`` and each rank's row of (step seconds, train
        seconds, then the phases ``names``' seconds)."""
        train_tokens, all_tokens, num_samples = totals
        expected = (self.global_batch_size or 0) * self.num_steps_per_rollout
        if expected and int(num_samples) != expected and self.rank == 0:
            warn_once(logger, f"rollout {rollout_id}: the trainer group got {int(num_samples)} samples, not "
                              f"--global-batch-size x --num-steps-per-rollout = {expected}; each of the "
                              f"{self.num_steps_per_rollout} optimizer steps takes an equal share of what arrived.")
        step_secs, total_secs = (max(r[j] for r in per_rank) for j in (0, 1))
        out = {f"phase/{n}": per_rank[0][2 + j] for j, n in enumerate(names)}
        out.update({f"phase_max/{n}": max(r[2 + j] for r in per_rank) for j, n in enumerate(names)})
        out.update({
            "num_samples": num_samples, "num_tokens": all_tokens, "train_time": total_secs, "step_time": step_secs,
            "tokens_per_s": train_tokens / step_secs if step_secs > 0 else 0.0,
            "num_optimizer_steps": float(self.num_steps_per_rollout),
        })
        m = mfu(num_params=self.num_active_params, train_tokens=train_tokens, forward_tokens=all_tokens * n_fwd_passes,
                seconds=total_secs, num_gpus=self.trainer_world, peak=self.peak)
        if m is not None:
            out["mfu"] = m
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _group_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    def _group_rows(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (one all-gather over the group), in rank order."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world == 1:
            return [t.cpu().tolist()]
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=self.device)
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out.view(self.world, -1).cpu().tolist()

    def _all_keys(self, keys: set[str]) -> list[str]:
        if self.world == 1:
            return sorted(keys)
        return bounded_union_of_names(keys, self.group, self.timeout, self.device,
                                      what="gathering the step's metric names")

    def _extra_local(self, data, extras, advantages, samples) -> tuple[list[str], list[float]]:
        """This rank's sums for ``metrics.extra_metrics``: (names, [token sum, mask sum per name..., reward sum,
        samples])."""
        names = sorted(extras) + (["advantages"] if advantages is not None else [])
        sums = [0.0] * (2 * len(names))
        if data:                                   # float64 sums over all local tokens: two host values per name
            mask = torch.cat([d.loss_mask for d in data]).double()
            for j, name in enumerate(names):
                lst = advantages if name == "advantages" else extras[name]
                sums[2 * j] = float((torch.cat(list(lst)).double() * mask).sum())
                sums[2 * j + 1] = float(mask.sum())
        reward_sum = sum(float(s.reward) for s in samples) if samples else 0.0
        return names, sums + [reward_sum, float(len(data))]

    # ------------------------------------------------------------------ weights out
    def state_dict_for_check(self) -> dict[str, torch.Tensor]:
        """Full parameters (CPU) on trainer rank 0, {} elsewhere; collective on the trainer group."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.iter_weight_buckets(256 << 20):
            if self.trainer_rank == 0:
                out.update({n: t.detach().cpu().clone() for n, t in bucket})
        return out

    def save_hf(self, path: str | Path) -> None:
        """A HF model dir (safetensors + config + tokenizer from --hf-checkpoint); collective."""
        dtype = checkpoint_dtype(self.cfg.hf_checkpoint)
        tensors = []
        for bucket in self.iter_weight_buckets(512 << 20, dtype):
            if self.trainer_rank == 0:
                tensors.extend((n, t.detach().cpu().clone()) for n, t in bucket)
        if self.trainer_rank == 0:
            write_hf_dir(path, tensors + self._checkpoint_buffers({n for n, _ in tensors}), self.cfg.hf_checkpoint)
        self._barrier()

    # ------------------------------------------------------------------ checkpoint cadence, colocation
    def _barrier(self) -> None:
        if self.trainer_world > 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.trainer_group)

    def should_save(self, rollout_id: int) -> bool:
        """--save-interval rule: every N rollouts and always after the last (needs --save); ``cadence.should_save``."""
        from miles.trainer.checkpoint import cadence

        return cadence.should_save(self.ckpt, rollout_id, self.num_rollout)

    def offload(self) -> None:
        """Pause (``--offload-train``): the trained state (``_offload_parts``) to CPU (``--offload-train-target cpu``;
        a no-op off GPU) or to this rank's files (``disk``, on any device: it frees host memory on CPU)."""
        if self._disk is not None:
            from miles.trainer.disk_offload import tensors_of

            self._disk.offload(tensors_of(*self._offload_parts()))
        else:
            self._move("cpu")

    def onload(self) -> None:
        if self._disk is not None:
            self._disk.onload()
        else:
            self._move(self.device)

    @contextlib.contextmanager
    def resident(self, weights_only: bool = False) -> Iterator[None]:
        """Around a reader of the paused trainer (the weight sync: ``weights_only``; a checkpoint): the state spilled
        to disk is read back for it and freed again after (readers change nothing, so nothing is written). The CPU
        target's state stays readable where it is: nothing to do."""
        if self._disk is None:
            yield
            return
        with self._disk.resident(("weights",) if weights_only else None):
            yield

    def _move(self, device) -> None:
        """--offload-train-target cpu: the trained modules and their optimizer state to ``device`` (GPU only)."""
        if self.device.type != "cuda":
            return
        from miles.trainer.optim import move_optimizer_state

        modules, optimizers = self._offload_parts()
        for module in modules:
            module.to(device)
        for opt in optimizers:
            move_optimizer_state(opt, torch.device(device))
        torch.cuda.synchronize(self.device)
        if torch.device(device).type == "cpu":
            torch.cuda.empty_cache()

