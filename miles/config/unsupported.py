"""Miles flags (and Megatron-LM flags Miles's scripts pass) for features this project does not have: each refused by
name in one line saying what to use.

They are not parser flags (so they never show up as accepted in ``--help``); ``refuse_unknown`` looks
them up before the Megatron family and the did-you-mean hint.
"""

from __future__ import annotations

_LORA = ("this LoRA feature is not supported (miles trains one LoRA adapter, --lora-rank/--lora-alpha/--lora-dropout/"
         "--target-modules/--exclude-modules, and syncs merged weights to the engines): drop the flag.")
_REPLAY = ("indexer replay (DeepSeek sparse attention's top-k) is not supported: drop it; MoE routing replay is "
           "--use-rollout-routing-replay (R3) or --use-routing-replay (R2).")
_FORWARD_PROMETHEUS = ("it pushes the dashboard's gauges to Miles's --use-prometheus collector, which miles does not "
                       "have: drop it; the telemetry of --use-miles-dashboard is under DUMP_DETAILS/dashboard/ "
                       "(`python -m miles.dashboard.serve --dump-details DUMP_DETAILS`).")
_EVAL_FLEET = ("Miles's dedicated eval engine fleet (--eval-num-gpus > 0: its own engines and router, fed HF snapshots) "
               "is not part of miles: drop it; evaluation runs on the rollout engines every --eval-interval rollouts, "
               "with the --eval-* sampling flags and the engines' --sglang-* settings.")
EVAL_SGLANG_PREFIX = "--eval-sglang-"

# radixark/miles@v0.1.0:miles/utils/arguments.py add_lora_arguments, the replay flags of add_algo_arguments, the
# eval fleet flags of its eval arguments, and radixark/miles@v0.1.0:miles/dashboard/args.py's --dashboard-forward-prometheus.
# Megatron-LM's FP8 training flags (Miles's DeepSeek-V4 scripts: --fp8-format e4m3 --fp8-recipe blockwise and a
# transformer-engine precision config); a reason of their own rather than the generic Megatron-LM refusal
_FP8_TRAINING = ("FP8 training (transformer-engine's FP8 GEMMs in the trainer) is not built by the Megatron backend: it "
                 "trains in bf16 (--bf16, on GPU) or fp32; drop the flag (FP8 serving is the engines' --sglang-* "
                 "flags).")
UNSUPPORTED: dict[str, str] = {
    **{f: _FP8_TRAINING for f in ("--fp8-format", "--fp8-recipe", "--te-precision-config-file")},
    **{f: _LORA for f in (
        "--lora-adapter-path", "--lora-sync-from-tensor", "--lora-train-only",
        "--multi-lora-n-adapters", "--multi-lora-adapter", "--multi-lora-idle-poll-s",
        "--multi-lora-http-server-path", "--multi-lora-backend-path", "--multi-lora-api-port",
        "--multi-lora-disable-service-mode", "--multi-lora-max-adapter-global-batch-size",
        "--multi-lora-max-coalesce-wait-s", "--multi-lora-max-empty-wait-s")},
    **{f: _REPLAY for f in (
        "--use-indexer-replay", "--use-rollout-indexer-replay")},
    "--dashboard-forward-prometheus": _FORWARD_PROMETHEUS,
    **{f: _EVAL_FLEET for f in (
        "--eval-num-gpus", "--eval-num-gpus-per-engine", "--eval-hf-dir", "--eval-max-in-flight",
        "--eval-overflow-policy", "--eval-keep-snapshots")},
}


def unsupported_message(flag: str) -> str | None:
    """The one-line refusal of a Miles flag this project does not implement, or None. ``--eval-sglang-<flag>``
    (Miles's per-flag override of ``--sglang-<flag>`` for the eval fleet) is refused when ``<flag>`` is an
    SGLang ServerArgs flag; another spelling gets the usual did-you-mean."""
    why = UNSUPPORTED.get(flag)
    negated = flag.startswith("--no-")
    body = "--" + flag.removeprefix("--no-") if negated else flag
    if why is None and body.startswith(EVAL_SGLANG_PREFIX):
        from miles.config.sglang import is_server_flag

        stem = body.removeprefix(EVAL_SGLANG_PREFIX)
        if is_server_flag(stem, negated=negated):
            why = (f"it overrides --sglang-{stem} for Miles's dedicated eval engine fleet (--eval-num-gpus > 0), which "
                   f"is not part of miles: drop it; evaluation runs on the rollout engines, which take --sglang-{stem}.")
    return f"{flag}: {why}" if why else None
