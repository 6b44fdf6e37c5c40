"""Cross-section checks. They raise ConfigError naming flag, value and fix; they never rewrite values.

Checks that need the world size (the role plan) live in ``miles.spmd.roles``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from miles.config.base import ConfigError
from miles.config.data import FULLY_ASYNC_PATH
from miles.config.sglang import serves_lora_adapters

if TYPE_CHECKING:
    from miles.config import MilesConfig


P2P_NEEDS_EMBEDDED = ("--update-weight-transfer-mode p2p needs the embedded engine (SGLang's "
                      "/update_weights_from_distributed takes whole buckets from one rank): pass --rollout-engine "
                      "embedded, or use --update-weight-transfer-mode broadcast with SGLang.")

PATH_SUFFIXES = ("_path", "_load", "_dir", "_url", "_checkpoint", "_data")
PATH_FIELDS = ("save", "load", "save_hf", "dump_details")
POSITIVE_SGLANG_SIZES = ("max_running_requests", "context_length", "max_total_tokens", "max_queued_requests",
                         "max_prefill_tokens", "cuda_graph_bs", "cuda_graph_bs_decode", "cuda_graph_max_bs",
                         "cuda_graph_max_bs_decode")


def _validate_lora_serving(cfg: MilesConfig, *, fully_async: bool) -> None:
    """LoRA served by the engines (``--sglang-enable-lora``): the serving limits the trained adapter must fit, checked
    here because the engines would refuse it only at the first weight sync, after they have started."""
    args, rank = cfg.sglang.server_args, cfg.train.lora_rank
    max_rank = args.get("max_lora_rank")
    if max_rank is not None and int(max_rank) < rank:
        raise ConfigError(f"--sglang-max-lora-rank {max_rank} is below --lora-rank {rank}: the engines could not load "
                          f"the trained adapter; give --sglang-max-lora-rank {rank} or more, or a smaller --lora-rank.")
    max_loaded, preloaded = args.get("max_loaded_loras"), len(args.get("lora_paths") or [])
    if max_loaded is not None and int(max_loaded) < preloaded + 1:
        raise ConfigError(f"--sglang-max-loaded-loras {max_loaded} leaves no room for the trained adapter beside the "
                          f"{preloaded} of --sglang-lora-paths; give --sglang-max-loaded-loras {preloaded + 1} or more.")
    if fully_async:
        raise ConfigError("--sglang-enable-lora with --lora-rank and the fully async rollout is not supported: its "
                          "requests keep arriving while a weight sync replaces the adapter they name; drop "
                          "--sglang-enable-lora (merged weights) or the fully async rollout.")


def validate_config(cfg: MilesConfig) -> None:
    c, d, a, w = cfg.cluster, cfg.data, cfg.algo, cfg.weights
    _validate_miles_flags(cfg)
    _validate_ranges(cfg)
    _refuse_empty_paths(cfg)
    from miles.config.sglang import validate_sglang

    validate_sglang(cfg.sglang, rollout_num_gpus_per_engine=c.rollout_num_gpus_per_engine)
    if cfg.rollout.rollout_engine == "embedded":  # --rollout-engine auto: checked when the start picks the engine
        from miles.config.sglang import check_embedded_engine

        check_embedded_engine(cfg.sglang, why="--rollout-engine embedded")
    from miles.config.router import validate_router

    validate_router(cfg.rollout)
    from miles.config.eval_datasets import resolve_eval_datasets

    specs = resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)  # --eval-config's document (read, checked)
    from miles.config.eval_datasets import custom_eval_function

    if custom_eval_function(cfg.eval) and not specs and cfg.eval.eval_interval:  # Miles asserts datasets here
        raise ConfigError(f"--eval-function-path {cfg.eval.eval_function_path} (with --eval-interval "
                          f"{cfg.eval.eval_interval}) runs in place of the evaluation of the --eval-config / "
                          "--eval-prompt-data datasets, and none is given (Miles requires them too): add --eval-config "
                          "FILE (or --eval-prompt-data NAME PATH), or drop --eval-function-path.")
    if c.debug_train_only and c.debug_rollout_only:
        raise ConfigError("--debug-train-only and --debug-rollout-only exclude each other: pass at most one.")
    if cfg.is_async and c.colocate:
        raise ConfigError("train_async.py does not support --colocate (generation overlaps training, so they "
                          "cannot share GPUs): drop --colocate or use train.py.")
    if cfg.train.offload_train_target == "disk":
        _validate_disk_offload(cfg)
    if not cfg.output.dry_run:
        if d.num_rollout is None and d.num_epoch is None:
            raise ConfigError("--num-rollout is required (there is no default since Miles 0.1.0): add "
                              "--num-rollout N, or --num-epoch E to derive it from the data size.")
        if d.rollout_batch_size is None and not c.debug_train_only:
            raise ConfigError("--rollout-batch-size is required: add --rollout-batch-size N (prompts per rollout).")
    for name in ("rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout", "num_rollout"):
        v = getattr(d, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}.")
    if d.rollout_batch_size and d.global_batch_size and d.num_steps_per_rollout:
        total = d.rollout_batch_size * d.n_samples_per_prompt
        if total != d.global_batch_size * d.num_steps_per_rollout:
            raise ConfigError(
                f"--rollout-batch-size x --n-samples-per-prompt ({d.rollout_batch_size} x {d.n_samples_per_prompt} = {total}) "
                f"must equal --global-batch-size x --num-steps-per-rollout ({d.global_batch_size} x "
                f"{d.num_steps_per_rollout}); pass only one of --global-batch-size / --num-steps-per-rollout.")
    if d.rollout_batch_size and d.global_batch_size and not d.num_steps_per_rollout:
        total = d.rollout_batch_size * d.n_samples_per_prompt
        if total % d.global_batch_size:
            raise ConfigError(f"--global-batch-size {d.global_batch_size} must divide --rollout-batch-size x "
                              f"--n-samples-per-prompt = {total}.")
    if d.use_dynamic_global_batch_size:
        samples = (d.rollout_batch_size or 0) * d.n_samples_per_prompt
        if not cfg.train.use_dynamic_batch_size:
            raise ConfigError("--use-dynamic-global-batch-size needs --use-dynamic-batch-size (with "
                              "--max-tokens-per-gpu), as in Miles: add it.")
        if d.num_steps_per_rollout not in (None, 1):
            raise ConfigError(f"--num-steps-per-rollout {d.num_steps_per_rollout} with --use-dynamic-global-batch-size:"
                              " the dynamic global batch is one optimizer step per rollout; drop one of them.")
        if d.global_batch_size is not None and samples and d.global_batch_size != samples:
            raise ConfigError(f"--global-batch-size {d.global_batch_size} with --use-dynamic-global-batch-size: the "
                              f"dynamic global batch is every sample of a rollout (--rollout-batch-size x "
                              f"--n-samples-per-prompt = {samples}), one optimizer step; drop --global-batch-size.")
    if d.over_sampling_batch_size is not None and d.rollout_batch_size and d.over_sampling_batch_size < d.rollout_batch_size:
        raise ConfigError(f"--over-sampling-batch-size ({d.over_sampling_batch_size}) must be at least "
                          f"--rollout-batch-size ({d.rollout_batch_size}).")
    if a.loss_type == "custom_loss" and not a.custom_loss_function_path:
        raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path module.function.")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1.0:
        raise ConfigError(f"--eps-clip-c must be > 1.0 (dual-clip constant), got {a.eps_clip_c}.")
    if a.opd_teacher_in_trainer and not a.opd_teacher_load:
        raise ConfigError(f"--use-opd with --opd-type {a.opd_type} needs --opd-teacher-load DIR (a HF teacher).")
    named = any("=" in v and "://" not in v.split("=", 1)[0] for v in a.opd_teacher_urls or [])  # Miles's NAME=URL
    if named:
        names = [v.partition("=")[0].strip() for v in a.opd_teacher_urls]
        bad = next((v for v in a.opd_teacher_urls if not v.partition("=")[2].strip() or "://" in v.partition("=")[0]
                    or not v.partition("=")[0].strip()), None)
        if bad is not None or len(set(names)) != len(names):
            raise ConfigError(f"--opd-teacher-urls {' '.join(a.opd_teacher_urls)}: give NAME=URL entries with distinct "
                              f"names (e.g. math=http://h1:30001/generate default=http://h2:30002/generate), or plain "
                              f"URLs only{f'; {bad!r} is not NAME=URL' if bad else ''}.")
    rw = cfg.reward
    if (a.use_opd and a.opd_type == "sglang" and (named or not a.opd_teacher_urls)
            and not ((rw.rm_url or named) and rw.custom_rm_path and rw.custom_reward_post_process_path)):
        raise ConfigError("--use-opd with --opd-type sglang needs a teacher: --rm-url TEACHER/generate (or --opd-teacher-urls "
                          "NAME=URL ...) with --custom-rm-path miles.rollout.on_policy_distillation.reward_func and "
                          "--custom-reward-post-process-path miles.rollout.on_policy_distillation.post_process_rewards "
                          "(Miles's way), or --opd-teacher-urls URL [URL ...] (teacher engines queried after each rollout).")
    for v in a.opd_teacher_urls or []:
        _check_url("--opd-teacher-urls", v.partition("=")[2].strip() if named else v, "http://host:30001/generate")
    if cfg.reward.rm_url:
        _check_url("--rm-url", cfg.reward.rm_url, "http://host:8000/reward")
    if a.opd_teacher_urls and a.opd_type != "sglang":
        raise ConfigError(f"--opd-teacher-urls is only used with --opd-type sglang, not {a.opd_type}: drop it or pass --opd-type sglang.")
    fully_async = d.fully_async or d.rollout_function_path == "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"
    if fully_async and not cfg.is_async:
        raise ConfigError("--fully-async runs in train_async.py (generation goes on while the trainer trains): use "
                          "train_async.py, or drop --fully-async.")
    if d.fully_async and d.rollout_function_path is not None:
        raise ConfigError(f"--fully-async and --rollout-function-path {d.rollout_function_path} both select a rollout "
                          "function: pass only one.")
    if fully_async and cfg.weights.pause_generation_mode == "abort":
        raise ConfigError("--fully-async with --pause-generation-mode abort would throw away every weight update's "
                          "in-flight generation: use --pause-generation-mode retract (the default) or in_place.")
    if fully_async and c.debug_train_only:
        raise ConfigError("--fully-async generates on engines, and --debug-train-only runs none: drop one of them.")
    if a.opd_log_prob_top_k < 0:
        raise ConfigError(f"--opd-log-prob-top-k must be >= 0 (0: sampled-token OPD), got {a.opd_log_prob_top_k}.")
    if a.opd_log_prob_top_k > 0 and a.use_opd:
        plugin = "miles.rollout.on_policy_distillation."
        if a.opd_type != "sglang" or cfg.reward.custom_reward_post_process_path != plugin + "post_process_rewards":
            raise ConfigError(f"--opd-log-prob-top-k {a.opd_log_prob_top_k} (top-k OPD) runs through Miles's OPD plugin "
                              f"with a teacher server, as in Miles: use --opd-type sglang --rm-url TEACHER/generate "
                              f"--custom-rm-path {plugin}reward_func --custom-reward-post-process-path "
                              f"{plugin}post_process_rewards, or --opd-log-prob-top-k 0.")
        if a.opd_topk_per_position:
            raise ConfigError("--opd-topk-per-position needs a patched SGLang (token_ids_logprob_positions): drop it; "
                              "top-k OPD then asks for the union of the ids over the response, as stock SGLang takes.")
    if a.opd_teacher_ckpt_step is not None:
        raise ConfigError(f"--opd-teacher-ckpt-step {a.opd_teacher_ckpt_step} picks a Megatron checkpoint step, but "
                          "--opd-teacher-load is a HF directory here: drop --opd-teacher-ckpt-step.")
    if w.update_weight_transfer_mode == "disk-delta" and not w.update_weight_disk_dir:
        raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir DIR (shared by trainer and engines).")
    if w.update_weight_transfer_mode == "p2p" and c.colocate:
        raise ConfigError("--update-weight-transfer-mode p2p sends between separate devices and cannot be used with "
                          "--colocate: drop the flag (colocated runs hand weights over in place).")
    if w.update_weight_transfer_mode == "p2p" and cfg.rollout.rollout_engine == "sglang":
        raise ConfigError(P2P_NEEDS_EMBEDDED)
    if w.update_weight_transfer_mode == "disk-delta" and c.colocate:
        raise ConfigError("--update-weight-transfer-mode disk-delta writes weight deltas for separate engines and cannot be "
                          "used with --colocate: drop the flag (colocated runs hand weights over in place).")
    if w.update_weight_transfer_mode == "tensor" and not c.colocate:
        raise ConfigError("--update-weight-transfer-mode tensor hands weights over on the same device and needs --colocate; "
                          "use broadcast or disk-delta for disaggregated engines.")
    if w.lora_base_cpu_backup:
        _validate_lora_base_cpu_backup(cfg)
    if serves_lora_adapters(cfg.train, cfg.sglang) and cfg.ft.use_fault_tolerance:
        raise ConfigError("--sglang-enable-lora with --lora-rank and --use-fault-tolerance is not supported: an engine "
                          "that returns catches up on the trainer's weights without the LoRA adapter its rollouts name; "
                          "drop --sglang-enable-lora (merged weights) or --use-fault-tolerance.")
    if serves_lora_adapters(cfg.train, cfg.sglang):
        _validate_lora_serving(cfg, fully_async=d.fully_async or d.rollout_function_path == FULLY_ASYNC_PATH)
    if (serves_lora_adapters(cfg.train, cfg.sglang) and cfg.sglang.server_args.get("experts_shared_outer_loras")
            and not cfg.train.experts_shared_outer_loras):       # Miles: the two must agree
        raise ConfigError("--sglang-experts-shared-outer-loras with --sglang-enable-lora serves MoE experts' adapters "
                          "whose outer factors are shared, but the trainer's are per expert; add "
                          "--experts-shared-outer-loras, or drop --sglang-experts-shared-outer-loras.")
    if cfg.reward.group_rm and not cfg.reward.custom_rm_path:
        raise ConfigError("--group-rm needs --custom-rm-path module.function taking a whole group.")
    if cfg.reward.rm_type == "remote_rm" and not cfg.reward.rm_url:
        raise ConfigError("--rm-type remote_rm needs --rm-url URL.")
    if cfg.train.lr < 0 or cfg.train.min_lr < 0:
        flag, v = ("--lr", cfg.train.lr) if cfg.train.lr < 0 else ("--min-lr", cfg.train.min_lr)
        raise ConfigError(f"{flag} must be >= 0, got {v}: pass a learning rate such as {flag} 1e-6.")
    r = cfg.rollout
    if (r.sglang_router_ip is None) != (r.sglang_router_port is None):
        raise ConfigError("--sglang-router-ip and --sglang-router-port name a running router together: pass both or neither.")
    if r.rollout_temperature < 0:
        raise ConfigError(f"--rollout-temperature must be >= 0, got {r.rollout_temperature}.")


def _validate_disk_offload(cfg: MilesConfig) -> None:
    """--offload-train-target disk: it says where the paused trainer goes, so it needs the pause (Miles asserts
    --offload-train too); train_async.py never pauses the trainer. The directory itself is checked by the preflight."""
    given = "--offload-train-target disk"
    if cfg.is_async:
        raise ConfigError(f"{given} with train_async.py: the asynchronous loop trains while the engines generate, so "
                          "the trainer is never paused and nothing would be spilled; drop it, or use train.py.")
    if not cfg.cluster.offloads_train:
        why = "--no-offload-train" if cfg.cluster.offload_train is False else "no --offload-train (nor --colocate)"
        raise ConfigError(f"{given} with {why}: the target says where the paused trainer's state goes while the "
                          "engines generate, and it is never paused; add --offload-train (on by default with "
                          "--colocate), or drop --offload-train-target disk.")


def _validate_lora_base_cpu_backup(cfg: MilesConfig) -> None:
    """--lora-base-cpu-backup: LoRA on the Megatron backend with colocated engines (Miles ignores it otherwise; refused
    here, so it is never accepted and dropped)."""
    if not cfg.train.lora_rank:
        raise ConfigError("--lora-base-cpu-backup without --lora-rank: it keeps the engines' frozen base weights while "
                          "only the LoRA targets change; add --lora-rank R with --target-modules, or drop the flag.")
    if not cfg.cluster.colocate:
        raise ConfigError("--lora-base-cpu-backup without --colocate: it keeps the engines' frozen weights in host memory "
                          "across the colocated memory release (disaggregated engines keep theirs on their GPUs); add "
                          "--colocate or drop the flag.")
    if cfg.train.train_backend != "megatron":
        raise ConfigError(f"--lora-base-cpu-backup with --train-backend {cfg.train.train_backend}: sending only the "
                          "merged LoRA targets is built for the Megatron backend only; add --train-backend megatron or "
                          "drop the flag.")
    if cfg.ft.use_fault_tolerance:
        raise ConfigError("--lora-base-cpu-backup with --use-fault-tolerance is not supported: an engine that returns "
                          "reloads --hf-checkpoint, and the syncs that send only the LoRA targets would not give it the "
                          "trainer's frozen weights; drop one of them.")


def _validate_miles_flags(cfg: MilesConfig) -> None:
    """Miles flags accepted for compatibility whose values this project cannot honour, and their pairings."""
    from miles.config.support import check_backend_only

    check_backend_only(cfg)  # flags of one trainer backend given under the other (miles/config/support.py)
    cfg.train.validate()
    cfg.output.validate()
    a, d = cfg.algo, cfg.data
    if cfg.checkpoint.save_retain_interval is not None and cfg.checkpoint.save_retain_interval <= 0:
        raise ConfigError(f"--save-retain-interval must be a positive number of rollouts, got "
                          f"{cfg.checkpoint.save_retain_interval}.")
    if a.use_opd and a.opd_type is None:
        raise ConfigError("--use-opd needs --opd-type: megatron (the teacher runs in the trainer, --opd-teacher-load) "
                          "or sglang (teacher engines).")
    if a.custom_tis_function_path and not a.use_tis:
        raise ConfigError(f"--custom-tis-function-path {a.custom_tis_function_path} is called only with --use-tis (as in "
                          "Miles): add --use-tis (or use_tis: true in --custom-config-path), or drop it.")
    if d.multimodal_keys is not None:  # images (miles.rollout.multimodal): SFT, and RL through the built-in rollout
        _validate_multimodal(cfg)
    engine_template = cfg.sglang.server_args.get("chat_template")
    if d.chat_template_path and engine_template is not None and engine_template != d.chat_template_path:
        raise ConfigError(f"--chat-template-path {d.chat_template_path} disagrees with --sglang-chat-template "
                          f"{engine_template} (SGLang engines take --chat-template-path's file): drop "
                          "--sglang-chat-template or make them equal.")
    if not a.compute_advantages_and_returns and a.loss_type == "policy_loss":
        raise ConfigError("--disable-compute-advantages-and-returns leaves the policy loss without advantages: use it "
                          "with --loss-type sft_loss or custom_loss, or drop it.")
    ev = cfg.eval
    for name in ("eval_max_response_len", "eval_max_prompt_len", "eval_max_context_len"):
        v = getattr(ev, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}.")
    if cfg.rollout.rollout_max_context_len is not None and cfg.rollout.rollout_max_context_len <= 0:
        raise ConfigError(f"--rollout-max-context-len must be positive, got {cfg.rollout.rollout_max_context_len}.")
    if ev.eval_min_new_tokens is not None and ev.eval_min_new_tokens < 0:
        raise ConfigError(f"--eval-min-new-tokens must be >= 0, got {ev.eval_min_new_tokens}.")


def _validate_multimodal(cfg: MilesConfig) -> None:
    """``--multimodal-keys``: image SFT (``miles.rollout.sft_rollout.generate_rollout``) and RL / evaluation through
    the built-in rollout, whose requests carry the images (``image_data``); one line for what does not take them."""
    import json

    from miles.config.data import MULTIMODAL_SFT_PATH as SFT_PATH
    from miles.config.data import check_multimodal_keys, custom_rollout_path

    a, d = cfg.algo, cfg.data
    check_multimodal_keys(d.multimodal_keys)
    keys = json.dumps(d.multimodal_keys)
    custom = custom_rollout_path(d)
    if custom is not None and custom != SFT_PATH:
        raise ConfigError(f"--multimodal-keys {keys} with --rollout-function-path {custom}: images reach the built-in "
                          f"rollout (--custom-generate-function-path may replace its generate function) and {SFT_PATH} "
                          "only; drop --rollout-function-path.")
    if custom == SFT_PATH and a.loss_type != "sft_loss":
        raise ConfigError(f"--multimodal-keys {keys} with --rollout-function-path {SFT_PATH} needs --loss-type "
                          f"sft_loss (got {a.loss_type}): add --loss-type sft_loss.")
    if not d.apply_chat_template:  # the image rows are read and checked by the chat-template data path
        raise ConfigError(f"--multimodal-keys {keys} needs --apply-chat-template (the image rows are read and "
                          "checked by the chat-template data path): add --apply-chat-template.")
    if a.loss_type != "sft_loss" and a.advantage_estimator == "ppo":
        raise ConfigError(f"--advantage-estimator ppo with --multimodal-keys {keys}: the critic does not take images; "
                          "use --advantage-estimator grpo (or another critic-free estimator).")
    if a.use_opd and a.opd_type == "sglang":
        raise ConfigError(f"--use-opd --opd-type sglang with --multimodal-keys {keys}: the teacher's requests carry "
                          "no images; use --opd-type megatron (the teacher runs in the trainer, with the images).")


def _refuse_empty_paths(cfg: MilesConfig) -> None:
    """``--save ""`` (an unset shell variable) would silently mean "no --save": refuse every empty path/URL flag."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        for f in dataclasses.fields(value):
            if getattr(value, f.name) == "" and (f.name.endswith(PATH_SUFFIXES) or f.name in PATH_FIELDS):
                flag = "--" + f.name.replace("_", "-")
                raise ConfigError(f"{flag} was given an empty string (an unset shell variable?): give a value, or drop "
                                  f"{flag}.")


def _check_url(flag: str, url: str, example: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{flag} {url!r} is not an http(s) URL: give scheme, host and port, e.g. {flag} {example}.")


def _validate_ranges(cfg: MilesConfig) -> None:
    """Numbers argparse accepts by type but no run can use (nan, a zero budget, a probability above 1)."""
    t, r, ev = cfg.train, cfg.rollout, cfg.eval
    for flag, v in (("--lr", t.lr), ("--min-lr", t.min_lr), ("--rollout-temperature", r.rollout_temperature),
                    ("--distributed-timeout-minutes", cfg.cluster.distributed_timeout_minutes),
                    ("--entropy-coef", cfg.algo.entropy_coef), ("--kl-coef", cfg.algo.kl_coef),
                    ("--kl-loss-coef", cfg.algo.kl_loss_coef)):
        if not math.isfinite(v):
            raise ConfigError(f"{flag} must be a finite number, got {v}.")
    if t.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size must be at least 1, got {t.micro_batch_size}.")
    if t.max_tokens_per_gpu is not None and t.max_tokens_per_gpu < 1:
        raise ConfigError(f"--max-tokens-per-gpu must be a positive number of tokens, got {t.max_tokens_per_gpu}.")
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        raise ConfigError("--use-dynamic-batch-size packs micro-batches up to --max-tokens-per-gpu, which is not set: "
                          "add --max-tokens-per-gpu N (e.g. 4096), or drop --use-dynamic-batch-size.")
    if t.lr_warmup_iters < 0:
        raise ConfigError(f"--lr-warmup-iters must be >= 0, got {t.lr_warmup_iters}.")
    if t.lr_decay_iters and t.lr_decay_iters <= t.lr_warmup_iters and t.lr_decay_style != "constant":
        raise ConfigError(f"--lr-decay-iters ({t.lr_decay_iters}) must exceed --lr-warmup-iters ({t.lr_warmup_iters}) "
                          f"with --lr-decay-style {t.lr_decay_style}: raise --lr-decay-iters or lower the warm-up.")
    if t.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (0: no clipping), got {t.clip_grad}.")
    for flag, v in (("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)):
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {v}: e.g. {flag} {0.9 if flag.endswith('1') else 0.95}.")
    if not t.adam_eps > 0:
        raise ConfigError(f"--adam-eps must be > 0, got {t.adam_eps}.")
    if t.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {t.weight_decay}.")
    a = cfg.algo
    for flag, v in (("--eps-clip", a.eps_clip), ("--eps-clip-high", a.eps_clip_high)):
        if v is not None and v < 0:
            raise ConfigError(f"{flag} must be >= 0 (the PPO clip range), got {v}: e.g. {flag} 0.2.")
    if r.rollout_max_response_len is not None and r.rollout_max_response_len < 1:
        raise ConfigError(f"--rollout-max-response-len must be a positive number of tokens, got "
                          f"{r.rollout_max_response_len}; omit it to stop at EOS or the context length.")
    for prefix, temp, top_p, top_k in (("--rollout", r.rollout_temperature, r.rollout_top_p, r.rollout_top_k),
                                       ("--eval", ev.eval_temperature, ev.eval_top_p, ev.eval_top_k)):
        if temp is not None and not math.isfinite(temp):
            raise ConfigError(f"{prefix}-temperature must be a finite number, got {temp}.")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ConfigError(f"{prefix}-top-p must be in (0, 1], got {top_p} (1.0: no nucleus cut).")
        if top_k is not None and (top_k == 0 or top_k < -1):
            raise ConfigError(f"{prefix}-top-k must be -1 (off) or at least 1, got {top_k}.")
    d = cfg.data
    if d.num_epoch is not None and d.num_epoch < 1:
        raise ConfigError(f"--num-epoch must be at least 1, got {d.num_epoch}.")
    if cfg.checkpoint.save_interval < 1:
        raise ConfigError(f"--save-interval must be a positive number of rollouts, got {cfg.checkpoint.save_interval} "
                          "(the last rollout is always saved: a --save-interval above --num-rollout saves only that one).")
    if ev.eval_interval is not None and ev.eval_interval < 0:
        raise ConfigError(f"--eval-interval must be >= 0 (0: no periodic evaluation), got {ev.eval_interval}.")
    if not cfg.cluster.distributed_timeout_minutes > 0:
        raise ConfigError(f"--distributed-timeout-minutes must be > 0, got {cfg.cluster.distributed_timeout_minutes}: "
                          "e.g. --distributed-timeout-minutes 10.")
    if not r.rollout_request_timeout > 0:
        raise ConfigError(f"--rollout-request-timeout must be a positive number of seconds, got "
                          f"{r.rollout_request_timeout}: e.g. --rollout-request-timeout 600.")
    if not cfg.data.custom_generate_function_timeout > 0:  # nan included
        raise ConfigError(f"--custom-generate-function-timeout must be a positive number of seconds, got "
                          f"{cfg.data.custom_generate_function_timeout}: e.g. --custom-generate-function-timeout 3600.")
    if r.engine_max_running_requests < 1:
        raise ConfigError(f"--engine-max-running-requests must be at least 1, got {r.engine_max_running_requests}.")
    if r.sglang_mem_fraction_static is not None and not 0.0 < r.sglang_mem_fraction_static < 1.0:
        raise ConfigError(f"--sglang-mem-fraction-static must be a fraction of GPU memory in (0, 1), got "
                          f"{r.sglang_mem_fraction_static}: e.g. --sglang-mem-fraction-static 0.7.")
    from miles.config.sglang import flag_of

    for name in POSITIVE_SGLANG_SIZES:  # the sizes the embedded engine takes too; SGLang refuses them as well
        v = cfg.sglang.server_args.get(name)
        if v is not None and any(not isinstance(x, int) or x < 1 for x in (v if isinstance(v, list) else [v])):
            raise ConfigError(f"{flag_of(name)} must be at least 1, got {v}.")
    if r.sglang_router_ip is not None and ("/" in r.sglang_router_ip or not r.sglang_router_ip.strip()):
        raise ConfigError(f"--sglang-router-ip {r.sglang_router_ip!r} must be a host name or IP address only (no "
                          "scheme or path): e.g. --sglang-router-ip 10.0.0.1 --sglang-router-port 30000.")
    for flag, port in (("--sglang-router-port", r.sglang_router_port), ("--master-port", cfg.cluster.master_port)):
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"{flag} must be a TCP port in 1..65535, got {port}.")
