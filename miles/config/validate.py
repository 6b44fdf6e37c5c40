"""Cross-section checks. They raise ConfigError naming flag, value and fix; they never rewrite values.

Checks that need the world size (the role plan) live in ``miles.spmd.roles``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.base import ConfigError

if TYPE_CHECKING:
    from miles.config import MilesConfig


def validate_config(cfg: MilesConfig) -> None:
    c, d, a, w = cfg.cluster, cfg.data, cfg.algo, cfg.weights
    if c.debug_train_only and c.debug_rollout_only:
        raise ConfigError("--debug-train-only and --debug-rollout-only exclude each other: pass at most one.")
    if cfg.is_async and c.colocate:
        raise ConfigError("train_async.py does not support --colocate (generation overlaps training, so they "
                          "cannot share GPUs): drop --colocate or use train.py.")
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
    if d.over_sampling_batch_size is not None and d.rollout_batch_size and d.over_sampling_batch_size < d.rollout_batch_size:
        raise ConfigError(f"--over-sampling-batch-size ({d.over_sampling_batch_size}) must be at least "
                          f"--rollout-batch-size ({d.rollout_batch_size}).")
    if a.loss_type == "custom_loss" and not a.custom_loss_function_path:
        raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path module.function.")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1.0:
        raise ConfigError(f"--eps-clip-c must be > 1.0 (dual-clip constant), got {a.eps_clip_c}.")
    if a.use_opd and a.opd_type == "model" and not a.opd_teacher_load:
        raise ConfigError("--use-opd with --opd-type model needs --opd-teacher-load DIR (a HF teacher).")
    if a.use_opd and a.opd_type == "sglang" and not a.opd_teacher_urls:
        raise ConfigError("--use-opd with --opd-type sglang needs --opd-teacher-urls URL [URL ...].")
    if w.update_weight_transfer_mode == "disk-delta" and not w.update_weight_disk_dir:
        raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir DIR (shared by trainer and engines).")
    if w.update_weight_transfer_mode == "tensor" and not c.colocate:
        raise ConfigError("--update-weight-transfer-mode tensor hands weights over on the same device and needs --colocate; "
                          "use broadcast or disk-delta for disaggregated engines.")
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
