"""Run output flags: where metrics and logs go."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("output")
    o.add_argument("--run-name", type=str, default="miles", help="Run name (output dir, W&B).")
    o.add_argument("--output-dir", type=str, default=None, help="Metrics, logs and plots (default outputs/<name>-<time>).")
    o.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases (WANDB_MODE=offline works).")
    o.add_argument("--wandb-project", type=str, default=None, help="W&B project (default: W&B's own).")
    o.add_argument("--wandb-group", type=str, default=None, help="W&B group.")
    o.add_argument("--wandb-team", type=str, default=None, help="W&B entity (team).")
    o.add_argument("--wandb-host", type=str, default=None, help="W&B server URL (self-hosted W&B).")
    o.add_argument("--wandb-key", type=str, default=None, help="W&B API key (default: WANDB_API_KEY / wandb login).")
    o.add_argument("--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false",
                   help="W&B run name is --run-name as given (default: a random 6-character suffix is added).")
    o.add_argument("--use-tensorboard", action="store_true", default=False, help="Write TensorBoard events.")
    o.add_argument("--no-tensorboard", dest="use_tensorboard", action="store_false", help="No TensorBoard events.")
    o.add_argument("--log-level", type=str, default="INFO", help="Log level on rank 0.")
    o.add_argument("--no-progress", action="store_true", help="No progress bars.")
    o.add_argument("--dry-run", action="store_true", help="Parse, validate, print the role plan and exit.")
    o.add_argument("--save-debug-rollout-data", type=str, default=None,
                   help="Write each rollout's samples as JSONL to this path; {rollout_id} is filled in.")
    o.add_argument("--dump-details", type=str, default=None,
                   help="Directory for post-hoc analysis: each rollout's samples go to DIR/rollout_data/{rollout_id}.jsonl "
                        "(unless --save-debug-rollout-data names another path).")


@dataclass(kw_only=True)
class OutputConfig:
    run_name: str
    output_dir: str | None
    use_wandb: bool
    wandb_project: str | None
    wandb_group: str | None
    wandb_team: str | None
    wandb_host: str | None
    wandb_key: str | None
    wandb_random_suffix: bool
    use_tensorboard: bool
    log_level: str
    no_progress: bool
    dry_run: bool
    save_debug_rollout_data: str | None
    dump_details: str | None

    @property
    def rollout_dump_path(self) -> str | None:
        """Where each rollout's samples are written: --save-debug-rollout-data, else under --dump-details."""
        if self.save_debug_rollout_data:
            return self.save_debug_rollout_data
        if self.dump_details:
            return f"{self.dump_details}/rollout_data/{{rollout_id}}.jsonl"
        return None
