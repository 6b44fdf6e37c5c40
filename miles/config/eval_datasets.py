"""The evaluation datasets of a run: one typed ``EvalDatasetSpec`` each, from ``--eval-config`` or ``--eval-prompt-data``.

    specs = resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)   # [] without either flag; ConfigError if bad

``--eval-config PATH`` (or ``base64:<payload>``) is Miles's multi-task document (``radixark/miles@v0.1.0:miles/utils/eval_config.py``
and ``_resolve_eval_datasets``)::

    eval:                                  # or the same mapping at the root
      defaults: {temperature: 0.6, max_response_len: 24576, ...}
      datasets:                            # a list of mappings with a name, or a mapping keyed by name
        - {name: gpqa, path: /data/gpqa.jsonl, rm_type: gpqa, n_samples_per_eval_prompt: 2}

It wins over ``--eval-prompt-data`` (as in Miles; both given is logged). Each value is Miles's first of: the
dataset's key, ``eval.defaults`` (only for the keys Miles reads there: ``DEFAULTS_KEYS``), the ``--eval-*`` flag,
the rollout/data flag. Keys Miles takes per dataset only (``rm_type``, ``stop``, ``stop_token_ids``,
``min_new_tokens``, ``custom_generate_function_path``, ``metadata_overrides``) fall back to miles's eval
behaviour: the sample's own ``rm_type`` / ``--rm-type``, ``--rollout-stop``, ``--rollout-stop-token-ids``,
``--eval-min-new-tokens``, ``--custom-generate-function-path``; Miles ignores them under ``eval.defaults``,
so miles logs that they are ignored there. ``eval.delegate`` (a list of external evaluation environments, each
with a ``name``) is for the ``--eval-function-path`` plugin, which reads the document at ``args.eval_config`` itself
(Miles's experimental ``eval_delegate_rollout``); without a function that evaluates (``--eval-function-path``, or a
custom ``--rollout-function-path`` by Miles's default: ``evaluating_function``) it is refused.

Nothing here rewrites a parsed value; a bad document is one ``ConfigError`` line naming ``--eval-config``,
the dataset and the fix (``validate_config`` runs this, so ``--dry-run`` reports it).
"""

from __future__ import annotations

import binascii
import dataclasses
import math
import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from miles.config.base import ConfigError
from miles.config.data import DEFAULT_ROLLOUT_PATHS, FULLY_ASYNC_PATH, parse_eval_prompt_data
from miles.utils.file_arg_utils import resolve_file_arg
from miles.utils.logging import get_logger, warn_once

if TYPE_CHECKING:
    from miles.config.data import DataConfig, EvalConfig
    from miles.config.rollout import RolloutConfig

logger = get_logger(__name__)
FLAG = "--eval-config"
DELEGATE_PLUGIN = "examples.experimental.eval.eval_delegate_rollout.generate_rollout"
# Miles's names of its default eval rollout: naming one selects the built-in evaluation, as leaving the flag unset
DEFAULT_EVAL_PATHS = DEFAULT_ROLLOUT_PATHS


def custom_eval_function(ev: EvalConfig) -> str | None:
    """``--eval-function-path`` when it names a function to call; None when unset or one of Miles's default names."""
    path = getattr(ev, "eval_function_path", None)
    return None if path is None or path in DEFAULT_EVAL_PATHS else path


def evaluating_function(ev: EvalConfig, data: DataConfig) -> str | None:
    """The function that evaluates, or None for the built-in evaluation: ``--eval-function-path``, else (Miles's
    default) a custom ``--rollout-function-path``, but not miles's SFT rollout (training data only; Miles's asserts
    ``not evaluation``) nor Miles's default / fully async names."""
    from miles.config.data import MULTIMODAL_SFT_PATH as SFT_PATH

    path = custom_eval_function(ev)
    if path is not None or getattr(ev, "eval_function_path", None) is not None:  # a default name: the built-in
        return path
    rollout = data.rollout_function_path
    if rollout is None or data.fully_async or rollout in (*DEFAULT_EVAL_PATHS, SFT_PATH, FULLY_ASYNC_PATH):
        return None
    return rollout

# key -> the config fields (section, attribute) Miles falls back to, in order (its DATASET_*_SPECS arg_attrs)
FALLBACKS: dict[str, tuple[tuple[str, str], ...]] = {
    "n_samples_per_eval_prompt": (("eval", "n_samples_per_eval_prompt"), ("data", "n_samples_per_prompt")),
    "temperature": (("eval", "eval_temperature"), ("rollout", "rollout_temperature")),
    "top_p": (("eval", "eval_top_p"), ("rollout", "rollout_top_p")),
    "top_k": (("eval", "eval_top_k"), ("rollout", "rollout_top_k")),
    "max_response_len": (("eval", "eval_max_response_len"), ("rollout", "rollout_max_response_len")),
    "input_key": (("eval", "eval_input_key"), ("data", "input_key")),
    "label_key": (("eval", "eval_label_key"), ("data", "label_key")),
    "tool_key": (("eval", "eval_tool_key"), ("data", "tool_key")),
    "metadata_key": (("data", "metadata_key"),),
    # per dataset only in Miles; miles's eval behaviour otherwise
    "stop": (("rollout", "rollout_stop"),),
    "stop_token_ids": (("rollout", "rollout_stop_token_ids"),),
    "min_new_tokens": (("eval", "eval_min_new_tokens"),),
    "custom_generate_function_path": (("data", "custom_generate_function_path"),),
}
DEFAULTS_KEYS = ("n_samples_per_eval_prompt", "temperature", "top_p", "top_k", "max_response_len", "input_key",
                 "label_key", "tool_key", "metadata_key")


@dataclass(frozen=True)
class EvalDatasetSpec:
    """One evaluation dataset, every value resolved (Miles's ``EvalDatasetConfig``)."""

    name: str
    path: str
    rm_type: str | None = None          # None: the sample's metadata rm_type, else --rm-type / --custom-rm-path
    input_key: str = "input"
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = "metadata"
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    custom_generate_function_path: str | None = None
    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def inject_metadata(self, metadata: Any) -> dict[str, Any]:
        """A sample's metadata with ``rm_type`` and ``metadata_overrides`` set over it (as Miles)."""
        out = dict(metadata) if isinstance(metadata, dict) else {}
        if self.rm_type is not None:
            out["rm_type"] = self.rm_type
        out.update(self.metadata_overrides)
        return out

    def sampling_params(self, skip_special_tokens: bool) -> dict[str, Any]:
        """SGLang ``sampling_params`` of this dataset's requests."""
        params: dict[str, Any] = {"max_new_tokens": self.max_response_len, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k, "skip_special_tokens": skip_special_tokens}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_new_tokens is not None:
            params["min_new_tokens"] = self.min_new_tokens
        return params


_FIELDS = {f.name for f in dataclasses.fields(EvalDatasetSpec)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# key -> (check, what it must be); None values are "not set" and skip the check
_CHECKS: dict[str, tuple[Any, str]] = {
    "name": (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string"),
    "path": (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty file path"),
    "rm_type": (lambda v: isinstance(v, str) and v != "", "a reward name (as --rm-type)"),
    "input_key": (lambda v: isinstance(v, str) and v != "", "a column name"),
    "label_key": (lambda v: isinstance(v, str), "a column name"),
    "tool_key": (lambda v: isinstance(v, str), "a column name"),
    "metadata_key": (lambda v: isinstance(v, str), "a column name"),
    "n_samples_per_eval_prompt": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 (off) or an integer >= 1"),
    "max_response_len": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "stop": (lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v), "a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v), "a list of token ids"),
    "min_new_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "custom_generate_function_path": (lambda v: isinstance(v, str) and "." in v, "a module.function path"),
    "metadata_overrides": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
                           "a mapping of metadata key to value"),
}
assert set(_CHECKS) == _FIELDS


def read_document(value: str) -> Any:
    """The ``--eval-config`` document: a YAML/JSON file, or ``base64:<payload>`` (Miles's ``resolve_file_arg``)."""
    try:
        return yaml.safe_load(resolve_file_arg(value))
    except (OSError, UnicodeDecodeError, binascii.Error, ValueError, yaml.YAMLError) as e:
        first = (str(e).splitlines() or [""])[0]
        where = "base64:..." if value.startswith("base64:") else repr(value)
        raise ConfigError(f"{FLAG} {where}: cannot read it as YAML/JSON ({type(e).__name__}: {first}); pass a "
                          "readable file (or base64:<payload>) holding eval: {datasets: [{name, path}, ...]}.") from None


def _dataset_list(raw: Any) -> list[dict[str, Any]]:
    """Miles's ``ensure_dataset_list``: a list of mappings with a ``name``, or a mapping keyed by name."""
    if raw is None:
        return []
    if isinstance(raw, dict):
        out = []
        for name, entry in raw.items():
            if entry is not None and not isinstance(entry, dict):
                raise ConfigError(f"{FLAG}: eval.datasets.{name} must be a mapping of keys (path, rm_type, ...), "
                                  f"got {type(entry).__name__}.")
            out.append({"name": name, **(entry or {})})
        return out
    if isinstance(raw, list):
        out = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, dict):
                raise ConfigError(f"{FLAG}: eval.datasets[{i}] must be a mapping with name and path, got "
                                  f"{type(entry).__name__} {entry!r}.")
            if "name" not in entry:
                raise ConfigError(f"{FLAG}: eval.datasets[{i}] has no name: add `name: NAME` (its metrics are "
                                  "eval/NAME).")
            out.append(dict(entry))
        return out
    raise ConfigError(f"{FLAG}: eval.datasets must be a list of datasets ({{name, path, ...}}) or a mapping keyed by "
                      f"name, got {type(raw).__name__}.")


def _check_delegate(delegate: Any, eval_function: str | None) -> None:
    """``eval.delegate``: read by the ``--eval-function-path`` plugin (Miles's eval_delegate_rollout reads the document
    at ``args.eval_config`` itself); without one nothing would read it, so it is refused."""
    if eval_function is None:
        raise ConfigError(f"{FLAG}: eval.delegate is read by an --eval-function-path plugin (Miles's "
                          f"{DELEGATE_PLUGIN}), and none is given (nor a --rollout-function-path that evaluates): add "
                          f"--eval-function-path {DELEGATE_PLUGIN}, or drop the delegate section (the datasets under "
                          "eval.datasets run as usual).")
    if not isinstance(delegate, list) or not all(isinstance(e, dict) and str(e.get("name") or "").strip()
                                                 for e in delegate):
        raise ConfigError(f"{FLAG}: eval.delegate must be a list of environments, each a mapping with a name "
                          f"(e.g. [{{name: skills, url: http://host:9050/evaluate, datasets: [...]}}]), got {reprlib.repr(delegate)}.")


def _eval_mapping(value: str, eval_function: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(defaults, raw dataset entries) of the document."""
    doc = read_document(value)
    if not isinstance(doc, dict):
        raise ConfigError(f"{FLAG} {value if not value.startswith('base64:') else 'base64:...'}: the document must be "
                          f"a mapping (eval: {{defaults, datasets}}), got {type(doc).__name__}.")
    ev = doc.get("eval", doc)
    if not isinstance(ev, dict):
        raise ConfigError(f"{FLAG}: `eval` must be a mapping with datasets (and defaults), got {type(ev).__name__}.")
    if ev.get("delegate"):
        _check_delegate(ev["delegate"], eval_function)
    unknown = sorted(set(ev) - {"defaults", "datasets", "delegate"})
    if unknown:
        raise ConfigError(f"{FLAG}: unknown key(s) {', '.join(unknown)} under eval; it takes defaults and datasets.")
    defaults = ev.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{FLAG}: eval.defaults must be a mapping (temperature, max_response_len, ...), got "
                          f"{type(defaults).__name__}.")
    datasets = _dataset_list(ev.get("datasets"))
    if not datasets:
        raise ConfigError(f"{FLAG}: no datasets under eval.datasets; add at least one {{name: NAME, path: FILE}}.")
    return defaults, datasets


def _check(key: str, value: Any, where: str) -> None:
    check, what = _CHECKS[key]
    if value is not None and not check(value):
        raise ConfigError(f"{FLAG}: {where} {key} must be {what}, got {value!r}.")


def _fallback(key: str, sections: dict[str, Any]) -> Any:
    for section, attr in FALLBACKS.get(key, ()):
        value = getattr(sections[section], attr)
        if value is not None:
            return value
    return None


def resolve_eval_datasets(ev: EvalConfig, data: DataConfig, rollout: RolloutConfig) -> list[EvalDatasetSpec]:
    """Every evaluation dataset of the run, resolved in Miles's order (see the module docstring)."""
    sections = {"eval": ev, "data": data, "rollout": rollout}
    if ev.eval_config is None:
        raw = [{"name": n, "path": p} for n, p in parse_eval_prompt_data(ev.eval_prompt_data)]
        defaults: dict[str, Any] = {}
    else:
        if ev.eval_config.strip() == "":
            raise ConfigError(f"{FLAG} is an empty string: pass a YAML/JSON file (or base64:<payload>), or drop it.")
        defaults, raw = _eval_mapping(ev.eval_config, evaluating_function(ev, data))
        if ev.eval_prompt_data:
            # the document is resolved by the parse, the dry run and the start: warn once
            warn_once(logger, f"{FLAG} is given: it replaces --eval-prompt-data {' '.join(ev.eval_prompt_data)} "
                              "(as in Miles)")
    for key, value in defaults.items():
        if key in DEFAULTS_KEYS:
            _check(key, value, "eval.defaults")
        elif key in _FIELDS - {"name", "path"}:
            warn_once(logger, f"{FLAG}: eval.defaults.{key} is ignored (Miles reads only {', '.join(DEFAULTS_KEYS)} "
                              "there): set it on each dataset")
        else:
            raise ConfigError(f"{FLAG}: unknown key {key!r} in eval.defaults; it takes {', '.join(DEFAULTS_KEYS)}.")
    specs: list[EvalDatasetSpec] = []
    for entry in raw:  # --eval-prompt-data's names and paths are checked by parse_eval_prompt_data / validation
        name = entry.get("name")
        if ev.eval_config is not None:
            _check("name", name, "dataset")
        where = f"dataset {name!r}:"
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise ConfigError(f"{FLAG}: {where} unknown key(s) {', '.join(map(str, unknown))}; a dataset takes "
                              f"{', '.join(sorted(_FIELDS))}.")
        if not entry.get("path"):
            raise ConfigError(f"{FLAG}: {where} no path: add `path: FILE` (JSONL or Parquet prompts).")
        values: dict[str, Any] = {}
        for key in sorted(_FIELDS):
            if key in entry and entry[key] is not None:
                value = entry[key]
                if ev.eval_config is not None:  # a flag's value is checked by its own parser/validation
                    _check(key, value, where)
            elif key in DEFAULTS_KEYS and defaults.get(key) is not None:
                value = defaults[key]
            else:
                value = _fallback(key, sections)
            if value is not None:
                values[key] = list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
        specs.append(EvalDatasetSpec(**values))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{FLAG}: dataset name(s) {', '.join(dup)} appear more than once; names must be distinct "
                          "(the metrics are eval/NAME).")
    return specs


def flag_docs() -> list[str]:
    """The docs/flags.md text under the evaluation table."""
    return [
        "### Evaluation datasets (`--eval-config`)",
        "",
        "`--eval-config PATH` (or `base64:<payload>`) is Miles's multi-task evaluation document, YAML or JSON:",
        "",
        "```yaml",
        "eval:                                   # or the same mapping at the root",
        "  defaults: {temperature: 0.6, max_response_len: 16384}",
        "  datasets:                             # a list with `name`, or a mapping keyed by name",
        "    - {name: aime, path: /data/aime.jsonl, rm_type: deepscaler, n_samples_per_eval_prompt: 16}",
        "    - {name: gpqa, path: /data/gpqa.jsonl, rm_type: gpqa, temperature: 0.3, stop: [\"</s>\"]}",
        "```",
        "",
        f"A dataset takes {', '.join(f'`{k}`' for k in sorted(_FIELDS))}. It replaces `--eval-prompt-data`",
        "(as in Miles; both given is logged). Each value is, in Miles's order: the dataset's key, then `eval.defaults`",
        f"(for {', '.join(f'`{k}`' for k in DEFAULTS_KEYS)} only: Miles ignores other keys there, and miles logs",
        "that it does), then the `--eval-*` flag, then the rollout/data flag (`--eval-temperature`, then",
        "`--rollout-temperature`; `--n-samples-per-eval-prompt`; `--eval-input-key`, then `--input-key`; ...).",
        "Without a value: `rm_type` is the sample's own `metadata.rm_type`, else `--rm-type` (`--custom-rm-path`",
        "scores every sample when given, as in Miles); `stop` / `stop_token_ids` are `--rollout-stop` /",
        "`--rollout-stop-token-ids`; `min_new_tokens` is `--eval-min-new-tokens`; `custom_generate_function_path` is",
        "`--custom-generate-function-path`. `rm_type` and `metadata_overrides` are set in each sample's metadata.",
        "`--eval-prompt-data NAME PATH ...` gives the same specs from the flags alone. Metrics are Miles's `eval/<name>`",
        "(mean reward, a failed sample counted 0), `eval/<name>-truncated_ratio`, `eval/<name>-none_reward_ratio` and",
        "`eval/<name>/...` (`num_samples` = prompts x the dataset's `n_samples_per_eval_prompt`).",
        "",
        "Refused in one line naming `--eval-config`, the dataset and the fix, at parse time (so `--dry-run` reports",
        "it): an unreadable file or base64 payload, a document that is not a mapping, no datasets, a dataset",
        "without `name` or `path`, an unknown key, a value of the wrong type or range, duplicate names, and",
        "`eval.delegate` without a function that evaluates (`--eval-function-path`, or a custom",
        "`--rollout-function-path` by Miles's default), or one that is not a list of mappings with a `name`. With",
        "`--eval-function-path` (e.g. Miles's `examples.experimental.eval.eval_delegate_rollout.generate_rollout`),",
        "`eval.delegate` is that plugin's: it reads the document at `args.eval_config` itself, as in Miles.",
        "The dry run also checks that each dataset's file exists, its `rm_type` is a",
        "known reward and its `custom_generate_function_path` imports. OmegaConf interpolation (`${...}`) is not",
        "resolved: the document is read as plain YAML.",
    ]
