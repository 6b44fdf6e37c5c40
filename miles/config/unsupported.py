"""Miles flags for features this project does not have: each refused by name in one line saying what to use.

They are not parser flags (so they never show up as accepted in ``--help``); ``refuse_unknown`` looks
them up before the Megatron family and the did-you-mean hint.
"""

from __future__ import annotations

_LORA = ("LoRA is not supported (miles trains every parameter): drop the LoRA flags to fine-tune the full model.")
_REPLAY = ("routing replay is not supported (the engines do not return MoE routing decisions): drop it; "
           "--use-tis corrects the rollout/training mismatch instead.")
_DASHBOARD = ("the Miles dashboard is not supported: drop the dashboard flags; metrics go to OUTPUT_DIR/metrics.jsonl, "
              "and to TensorBoard / W&B with --use-tensorboard / --use-wandb.")

# Miles v0.1.0 miles/utils/arguments.py add_lora_arguments, the replay flags of add_algo_arguments, and
# miles/dashboard/args.py add_dashboard_arguments.
UNSUPPORTED: dict[str, str] = {
    **{f: _LORA for f in (
        "--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-type", "--target-modules", "--exclude-modules",
        "--lora-adapter-path", "--lora-sync-from-tensor", "--lora-base-cpu-backup", "--lora-train-only",
        "--experts-shared-outer-loras", "--multi-lora-n-adapters", "--multi-lora-adapter", "--multi-lora-idle-poll-s",
        "--multi-lora-http-server-path", "--multi-lora-backend-path", "--multi-lora-api-port",
        "--multi-lora-disable-service-mode", "--multi-lora-max-adapter-global-batch-size",
        "--multi-lora-max-coalesce-wait-s", "--multi-lora-max-empty-wait-s")},
    **{f: _REPLAY for f in (
        "--use-routing-replay", "--use-rollout-routing-replay", "--use-indexer-replay", "--use-rollout-indexer-replay")},
    **{f: _DASHBOARD for f in (
        "--use-miles-dashboard", "--dashboard-flush-interval", "--dashboard-gpu-sample-interval",
        "--dashboard-sglang-scrape-interval", "--dashboard-sglang-scrape-mode", "--dashboard-sglang-metrics",
        "--dashboard-forward-prometheus")},
}


def unsupported_message(flag: str) -> str | None:
    """The one-line refusal of a Miles flag this project does not implement, or None."""
    why = UNSUPPORTED.get(flag)
    return f"{flag}: {why}" if why else None
