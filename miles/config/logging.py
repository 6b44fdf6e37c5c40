"""Run output flags: where metrics and logs go, and Miles's dashboard telemetry (``miles.dashboard``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from miles.config.base import ConfigError

SCRAPE_MODES = ("auto", "router", "direct")


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
    add_dashboard_arguments(parser)


def add_dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of radixark/miles@v0.1.0:miles/dashboard/args.py: names, defaults and meanings."""
    g = parser.add_argument_group("miles dashboard")
    g.add_argument("--use-miles-dashboard", action="store_true", default=False,
                   help="Collect dashboard telemetry (phases per rank, GPU util, engine metrics) under "
                        "{dump-details}/dashboard/. Requires --dump-details. View with `python -m miles.dashboard.serve`.")
    g.add_argument("--dashboard-flush-interval", type=float, default=5.0, help="Collector disk flush cadence (s).")
    g.add_argument("--dashboard-gpu-sample-interval", type=float, default=1.0, help="NVML sampling cadence (s).")
    g.add_argument("--dashboard-sglang-scrape-interval", type=float, default=2.0, help="Engine scrape cadence (s).")
    g.add_argument("--dashboard-sglang-scrape-mode", type=str, choices=list(SCRAPE_MODES), default="auto",
                   help="auto and direct scrape each engine's /metrics; router scrapes {router}/engine_metrics.")
    g.add_argument("--dashboard-sglang-metrics", type=str, default=None,
                   help="Comma-separated override of the scraped SGLang metric whitelist.")


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    """The collector's section (``OutputConfig.dashboard``): where and how often; ``metrics`` is None for the default
    whitelist."""

    dashboard_dir: str
    flush_interval: float
    gpu_sample_interval: float
    scrape_interval: float
    scrape_mode: str
    metrics: tuple[str, ...] | None


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
    use_miles_dashboard: bool = False
    dashboard_flush_interval: float = 5.0
    dashboard_gpu_sample_interval: float = 1.0
    dashboard_sglang_scrape_interval: float = 2.0
    dashboard_sglang_scrape_mode: str = "auto"
    dashboard_sglang_metrics: str | None = None

    def validate(self) -> None:
        """The dashboard flags' own checks (one line each; nothing is rewritten); run by ``validate_config``."""
        for name in ("dashboard_flush_interval", "dashboard_gpu_sample_interval", "dashboard_sglang_scrape_interval"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}: "
                                  f"e.g. --{name.replace('_', '-')} 5.")
        if self.dashboard_sglang_metrics is not None and not self._metric_names():
            raise ConfigError(f"--dashboard-sglang-metrics {self.dashboard_sglang_metrics!r} names no metric: give "
                              "comma-separated names (e.g. sglang_num_running_reqs,sglang_gen_throughput), or drop it "
                              "for the default whitelist.")
        if self.use_miles_dashboard and not self.dump_details:
            raise ConfigError("--use-miles-dashboard: needs --dump-details DIR (the telemetry goes to DIR/dashboard/, as "
                              "in Miles), which is not set: add --dump-details DIR, or drop --use-miles-dashboard.")

    def _metric_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in (self.dashboard_sglang_metrics or "").split(",") if m.strip())

    @property
    def dashboard(self) -> DashboardConfig | None:
        """The collector's settings with --use-miles-dashboard, else None."""
        if not self.use_miles_dashboard or not self.dump_details:
            return None
        return DashboardConfig(dashboard_dir=f"{self.dump_details.rstrip('/')}/dashboard",
                               flush_interval=self.dashboard_flush_interval,
                               gpu_sample_interval=self.dashboard_gpu_sample_interval,
                               scrape_interval=self.dashboard_sglang_scrape_interval,
                               scrape_mode=self.dashboard_sglang_scrape_mode,
                               metrics=self._metric_names() if self.dashboard_sglang_metrics is not None else None)

    @property
    def rollout_dump_path(self) -> str | None:
        """Where each rollout's samples are written: --save-debug-rollout-data, else under --dump-details."""
        if self.save_debug_rollout_data:
            return self.save_debug_rollout_data
        if self.dump_details:
            return f"{self.dump_details}/rollout_data/{{rollout_id}}.jsonl"
        return None
