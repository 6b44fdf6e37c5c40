"""Run output flags: where metrics and logs go."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("output")
    o.add_argument("--run-name", type=str, default="miles", help="Run name (output dir, W&B).")
    o.add_argument("--output-dir", type=str, default=None, help="Metrics, logs and plots (default outputs/<name>-<time>).")
    o.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases (WANDB_MODE=offline works).")
    o.add_argument("--wandb-project", type=str, default="miles", help="W&B project.")
    o.add_argument("--wandb-group", type=str, default=None, help="W&B group.")
    o.add_argument("--use-tensorboard", action="store_true", default=True, help="Write TensorBoard events (default on).")
    o.add_argument("--no-tensorboard", dest="use_tensorboard", action="store_false", help="No TensorBoard events.")
    o.add_argument("--log-level", type=str, default="INFO", help="Log level on rank 0.")
    o.add_argument("--no-progress", action="store_true", help="No progress bars.")
    o.add_argument("--dry-run", action="store_true", help="Parse, validate, print the role plan and exit.")
    o.add_argument("--save-debug-rollout-data", type=str, default=None,
                   help="Write each rollout's samples as JSONL to this path; {rollout_id} is filled in.")


@dataclass(kw_only=True)
class OutputConfig:
    run_name: str
    output_dir: str | None
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    use_tensorboard: bool
    log_level: str
    no_progress: bool
    dry_run: bool
    save_debug_rollout_data: str | None
