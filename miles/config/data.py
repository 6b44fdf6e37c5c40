"""Data, batch-size, reward and evaluation flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


def json_object(value: str) -> dict:
    """A flag value that must be a JSON object (Miles parses these flags with json.loads)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({e.msg})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


LEGACY_EVAL_NAME = "aime"   # Miles's name for a lone --eval-prompt-data PATH


def parse_eval_prompt_data(values: list[str] | None) -> list[tuple[str, str]]:
    """``--eval-prompt-data NAME PATH [NAME PATH ...]`` as (name, path) pairs; a single value is a PATH, named
    ``aime`` (Miles's legacy reading, logged once)."""
    from miles.config.base import ConfigError

    if not values:
        return []
    if len(values) == 1:
        from miles.utils.logging import get_logger, warn_once

        warn_once(get_logger(__name__), f"--eval-prompt-data {values[0]}: only one value, taken as the data of "
                                        f"dataset '{LEGACY_EVAL_NAME}' (Miles's legacy form; pass NAME PATH to name it)")
        values = [LEGACY_EVAL_NAME, values[0]]
    if len(values) % 2:
        raise ConfigError(f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values {values}: "
                          f"e.g. --eval-prompt-data math_eval data/eval.jsonl")
    pairs = [(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    empty = next((f"{n!r} {p!r}" for n, p in pairs if not n.strip() or not p.strip()), None)
    if empty is not None:
        raise ConfigError(f"--eval-prompt-data {empty}: each NAME and PATH must be non-empty, e.g. --eval-prompt-data "
                          "math_eval data/eval.jsonl")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--eval-prompt-data names must be distinct, got {names}")
    return pairs


MULTIMODAL_SFT_PATH = "miles.rollout.sft_rollout.generate_rollout"  # the rollout function that takes --multimodal-keys
# Miles's names of its default rollout function (the built-in RolloutManager here) and of its fully async one
DEFAULT_ROLLOUT_PATHS = ("miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn",
                         "miles.rollout.sglang_rollout.generate_rollout")
FULLY_ASYNC_PATH = "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"


def custom_rollout_path_of(path: str | None) -> str | None:
    """``--rollout-function-path`` ``path`` when it names a function to call, None for Miles's default and fully
    async names (the built-in rollout serves them)."""
    if path is None or path in DEFAULT_ROLLOUT_PATHS or path == FULLY_ASYNC_PATH:
        return None
    return path


def custom_rollout_path(data: DataConfig) -> str | None:
    """The rollout function to call instead of the built-in manager, or None (Miles's defaults, --fully-async)."""
    return custom_rollout_path_of(data.rollout_function_path)


MULTIMODAL_TYPES = ("image", "video", "audio")                     # Miles's media types
MULTIMODAL_SUPPORTED = ("image",)


def check_multimodal_keys(keys: object) -> None:
    """``--multimodal-keys`` is a JSON object of supported media type -> column name (ConfigError otherwise)."""
    from miles.config.base import ConfigError

    if not isinstance(keys, dict) or not keys:
        raise ConfigError(f"--multimodal-keys {json.dumps(keys)}: expected a JSON object of media type to data "
                          "column, e.g. '{\"image\": \"images\"}'.")
    for kind, column in keys.items():
        if kind not in MULTIMODAL_TYPES:
            raise ConfigError(f"--multimodal-keys {json.dumps(keys)}: unknown media type {kind!r}; Miles's types are "
                              f"{', '.join(MULTIMODAL_TYPES)}.")
        if kind not in MULTIMODAL_SUPPORTED:
            raise ConfigError(f"--multimodal-keys {json.dumps(keys)}: {kind} inputs are not supported (images only): "
                              f"drop the {kind!r} entry.")
        if not isinstance(column, str) or not column:
            raise ConfigError(f"--multimodal-keys {json.dumps(keys)}: the column for {kind!r} must be a non-empty "
                              f"string, got {column!r}.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = parser.add_argument_group("data")
    d.add_argument("--prompt-data", type=str, default=None, help="Prompt file: JSONL or Parquet.")
    d.add_argument("--input-key", type=str, default="input", help="Field holding the prompt.")
    d.add_argument("--label-key", type=str, default=None, help="Field holding the label for the reward.")
    d.add_argument("--metadata-key", type=str, default="metadata", help="Field holding per-sample metadata.")
    d.add_argument("--tool-key", type=str, default="tools", help="Field holding tool specs.")
    d.add_argument("--multimodal-keys", type=json_object, default=None,
                   help='JSON map of media type to field, e.g. \'{"image": "images"}\' (images: RL and evaluation '
                        'through the built-in rollout, which sends them to the engines as image_data, and SFT with '
                        'miles.rollout.sft_rollout.generate_rollout; Qwen3-VL on the FSDP or Megatron backend).')
    d.add_argument("--apply-chat-template", action="store_true", help="Apply the tokenizer's chat template (never implied).")
    d.add_argument("--apply-chat-template-kwargs", type=json_object, default={},
                   help='JSON object of extra chat-template arguments, e.g. \'{"enable_thinking": false}\'.')
    d.add_argument("--chat-template-path", type=str, default=None,
                   help="A Jinja chat template file used instead of the --hf-checkpoint tokenizer's own, wherever the "
                        "run templates (--apply-chat-template prompts, SFT conversations and their loss masks, "
                        "evaluation data, plugins' args.chat_template_path) and by SGLang engines (their "
                        "--chat-template). Miles's deprecated value 'autofix' means no file (logged).")
    d.add_argument("--rollout-shuffle", action="store_true", help="Shuffle prompts each epoch.")
    d.add_argument("--rollout-max-prompt-len", type=int, default=None, help="Drop prompts longer than this (tokens).")
    d.add_argument("--rollout-max-prompt-bytes", type=int, default=8 * 1024 * 1024,
                   help="Drop a --prompt-data record (JSONL line, rendered prompt) over this many bytes, unparsed.")
    d.add_argument("--num-epoch", type=int, default=None, help="Epochs over the prompt data (sets --num-rollout).")
    d.add_argument("--num-rollout", type=int, default=None, help="Number of rollouts (required unless --num-epoch).")
    d.add_argument("--rollout-batch-size", type=int, default=None, help="Prompts per rollout (required).")
    d.add_argument("--n-samples-per-prompt", type=int, default=1, help="Samples per prompt (group size).")
    d.add_argument("--global-batch-size", type=int, default=None, help="Samples per optimizer step.")
    d.add_argument("--num-steps-per-rollout", type=int, default=None, help="Optimizer steps per rollout.")
    d.add_argument("--use-dynamic-global-batch-size", action="store_true",
                   help="One optimizer step per rollout over every sample the rollout gives (its loss normalised by "
                        "their number), however many arrive (dynamic sampling filters, aborted samples): Miles's "
                        "meaning, which rounds that count down to a multiple of the DP size (here each DP rank trains "
                        "its share, the shares may differ by a sample). Needs --use-dynamic-batch-size; "
                        "--num-steps-per-rollout 1 and --global-batch-size = rollout samples are all it takes.")
    d.add_argument("--over-sampling-batch-size", type=int, default=None, help="Prompts in flight for dynamic sampling.")
    d.add_argument("--dynamic-sampling-filter-path", type=str, default=None,
                   help="module.function keeping a group. While it keeps fewer than --rollout-batch-size, more groups "
                        "are launched, with a log line of the kept count each 4 x --rollout-batch-size; after one pass "
                        "over the data the rollout fails, naming it (Miles goes on forever).")
    d.add_argument("--custom-generate-function-path", type=str, default=None, help="module.function generating one sample.")
    d.add_argument("--custom-generate-function-timeout", type=float, default=3600.0,
                   help="Seconds one --custom-generate-function-path call may take; then its sample fails, naming this "
                        "flag (miles's own: Miles v0.1.0 does not bound the call).")
    d.add_argument("--rollout-function-path", type=str, default=None,
                   help="module.function generating a whole rollout: fn(args, rollout_id, data_source, evaluation=False).")
    d.add_argument("--fully-async", action="store_true", help="Fully async rollout (train_async.py): keep generating while training.")

    r = parser.add_argument_group("reward")
    r.add_argument("--rm-type", type=str, default=None, help="Built-in reward: exact_match, math, quickstart, remote_rm.")
    r.add_argument("--custom-rm-path", type=str, default=None, help="module.function: async reward per sample (or group).")
    r.add_argument("--group-rm", action="store_true", help="The custom reward takes a whole group.")
    r.add_argument("--rm-url", type=str, default=None, help="Remote reward server URL (with --rm-type remote_rm).")
    r.add_argument("--log-reward-category", type=str, default=None,
                   help="KEY of a dict-valued reward: log error_cat/<value> (the share of a rollout's samples whose "
                        "reward dict has that value under KEY; 'none' without it).")
    r.add_argument("--log-passrate", action="store_true",
                   help="Log pass@k for k = 1, 2, 4, ... up to the group size: passrate/pass@k over each rollout's "
                        "complete groups of --n-samples-per-prompt, eval/<name>-pass@k over each eval dataset's "
                        "groups (a sample passes with reward 1; Miles's unbiased estimator).")
    r.add_argument("--reward-key", type=str, default=None, help="Key to pick from dict-valued rewards.")
    r.add_argument("--rm-timeout", type=float, default=60.0, help="Seconds per --rm-url request (remote_rm).")
    r.add_argument("--rm-max-retries", type=int, default=3, help="Retries of a failed --rm-url request.")
    r.add_argument("--custom-config-path", type=str, default=None,
                   help="YAML mapping (a file, or base64:PAYLOAD): keys naming a flag set that flag (over the command "
                        "line, logged); other keys are read by plugins as args.KEY.")
    r.add_argument("--custom-reward-post-process-path", type=str, default=None,
                   help="module.function(args, samples) -> (raw_rewards, rewards) over a rollout's samples.")

    e = parser.add_argument_group("evaluation")
    e.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, help="NAME PATH [NAME PATH ...] for evaluation; a single PATH is named 'aime' (as in Miles).")
    e.add_argument("--eval-config", type=str, default=None,
                   help="Miles's multi-task evaluation document: a YAML/JSON file (or base64:PAYLOAD) of eval: {defaults: "
                        "{...}, datasets: [{name, path, rm_type, n_samples_per_eval_prompt, temperature, ...}]}; it "
                        "replaces --eval-prompt-data (docs/flags.md: evaluation datasets).")
    e.add_argument("--eval-function-path", type=str, default=None,
                   help="module.function producing the evaluation results instead of the built-in eval (Miles's "
                        "contract): fn(args, rollout_id, data_source, evaluation=True) -> {name: {rewards, truncated, "
                        "samples}} or RolloutFnEvalOutput(data, metrics); logged as eval/<name> (docs/data-and-rewards.md). "
                        "Default: a custom --rollout-function-path (not the SFT one), else the built-in evaluation.")
    e.add_argument("--eval-interval", type=int, default=None, help="Evaluate every N rollouts.")
    e.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Samples per eval prompt.")
    e.add_argument("--eval-max-response-len", type=int, default=None, help="max_new_tokens for evaluation (default: --rollout-max-response-len).")
    e.add_argument("--eval-temperature", type=float, default=None, help="Sampling temperature for evaluation (default: --rollout-temperature).")
    e.add_argument("--eval-top-p", type=float, default=None, help="Nucleus sampling for evaluation (default: --rollout-top-p).")
    e.add_argument("--eval-top-k", type=int, default=None, help="Top-k sampling for evaluation (default: --rollout-top-k).")
    e.add_argument("--eval-min-new-tokens", type=int, default=None, help="min_new_tokens for evaluation.")
    e.add_argument("--eval-max-prompt-len", type=int, default=None,
                   help="Drop eval prompts longer than this (tokens; default: --rollout-max-prompt-len).")
    e.add_argument("--eval-max-context-len", type=int, default=None,
                   help="Eval prompt + response tokens: max_new_tokens is cut to fit (default: --rollout-max-context-len).")
    e.add_argument("--eval-input-key", type=str, default=None, help="Eval prompt field (default: --input-key).")
    e.add_argument("--eval-label-key", type=str, default=None, help="Eval label field (default: --label-key).")
    e.add_argument("--eval-tool-key", type=str, default=None, help="Eval tools field (default: --tool-key).")
    e.add_argument("--skip-eval-before-train", action="store_true", help="No evaluation before the first rollout.")


@dataclass(kw_only=True)
class DataConfig:
    prompt_data: str | None
    input_key: str
    label_key: str | None
    metadata_key: str
    tool_key: str
    multimodal_keys: dict[str, str] | None
    apply_chat_template: bool
    apply_chat_template_kwargs: dict
    chat_template_path: str | None = None
    rollout_shuffle: bool
    rollout_max_prompt_len: int | None
    rollout_max_prompt_bytes: int | None
    num_epoch: int | None
    num_rollout: int | None
    rollout_batch_size: int | None
    n_samples_per_prompt: int
    global_batch_size: int | None
    num_steps_per_rollout: int | None
    use_dynamic_global_batch_size: bool
    over_sampling_batch_size: int | None
    dynamic_sampling_filter_path: str | None
    custom_generate_function_path: str | None
    custom_generate_function_timeout: float
    rollout_function_path: str | None
    fully_async: bool


@dataclass(kw_only=True)
class RewardConfig:
    rm_type: str | None
    custom_rm_path: str | None
    group_rm: bool
    rm_url: str | None
    reward_key: str | None
    rm_timeout: float
    rm_max_retries: int
    custom_config_path: str | None
    custom_reward_post_process_path: str | None
    log_reward_category: str | None = None
    log_passrate: bool = False


@dataclass(kw_only=True)
class EvalConfig:
    eval_prompt_data: list[str] | None
    eval_config: str | None
    eval_function_path: str | None = None
    eval_interval: int | None
    n_samples_per_eval_prompt: int
    eval_max_response_len: int | None
    eval_temperature: float | None
    eval_top_p: float | None
    eval_top_k: int | None
    eval_min_new_tokens: int | None
    eval_max_prompt_len: int | None
    eval_max_context_len: int | None
    eval_input_key: str | None
    eval_label_key: str | None
    eval_tool_key: str | None
    skip_eval_before_train: bool
