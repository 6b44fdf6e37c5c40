"""Miles's ``miles.utils.eval_config``: the per-dataset evaluation settings of ``--eval-config``, for plugins.

    DATASET_RUNTIME_SPECS["temperature"]  # {"dataset_keys": (...), "default_keys": (...), "arg_attrs": (...)}
    _apply_dataset_field_overrides(args, dataset_cfg, defaults, specs)   # fills dataset_cfg in place
    build_eval_dataset_configs(args, raw_datasets, defaults) -> [EvalDatasetConfig, ...]

Each value is Miles's first of: the dataset's key, ``eval.defaults``, the args attributes in order (the
``--eval-*`` flag, then the rollout/data flag). The fallback order is this project's one table,
:data:`miles.config.eval_datasets.FALLBACKS`, which the run's own ``--eval-config`` resolution uses;
``EvalDatasetConfig`` is its :class:`~miles.config.eval_datasets.EvalDatasetSpec`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.config.eval_datasets import DEFAULTS_KEYS, FALLBACKS, EvalDatasetSpec, _dataset_list

__all__ = ["DATASET_RUNTIME_SPECS", "DATASET_SAMPLE_SPECS", "EvalDatasetConfig", "build_eval_dataset_configs",
           "ensure_dataset_list", "pick_from_args"]

EvalDatasetConfig = EvalDatasetSpec
_MISSING = object()
_SAMPLE_KEYS = ("input_key", "label_key", "tool_key", "metadata_key")


def _spec(key: str) -> dict[str, tuple[str, ...]]:
    return {"dataset_keys": (key,), "default_keys": (key,), "arg_attrs": tuple(attr for _, attr in FALLBACKS[key])}


DATASET_RUNTIME_SPECS: dict[str, dict[str, tuple[str, ...]]] = {
    k: _spec(k) for k in DEFAULTS_KEYS if k not in _SAMPLE_KEYS}
DATASET_SAMPLE_SPECS: dict[str, dict[str, tuple[str, ...]]] = {k: _spec(k) for k in _SAMPLE_KEYS}


def pick_from_args(args: Any, attrs: tuple[str, ...]) -> Any:
    """The first of ``args``'s attributes ``attrs`` that is set (not None), else None."""
    for attr in attrs:
        value = getattr(args, attr, None)
        if value is not None:
            return value
    return None


def _pick(data: dict[str, Any], keys: tuple[str, ...] | None) -> Any:
    return next((data[k] for k in keys or () if k in data), _MISSING)


def _apply_dataset_field_overrides(args: Any, dataset_cfg: dict[str, Any], defaults: dict[str, Any],
                                   spec_names: dict[str, Any]) -> None:
    """Set each field of ``spec_names`` in ``dataset_cfg``: its own key, else ``defaults``, else the args."""
    for name, spec in spec_names.items():
        value = _pick(dataset_cfg, spec["dataset_keys"])
        if value is _MISSING:
            value = _pick(defaults or {}, spec["default_keys"])
        dataset_cfg[name] = pick_from_args(args, spec["arg_attrs"]) if value is _MISSING else value


def ensure_dataset_list(config: Any) -> list[dict[str, Any]]:
    """A list of dataset mappings (each with a name) from a list or a mapping keyed by name."""
    return _dataset_list(config)


def build_eval_dataset_configs(args: Any, raw_config: Iterable[dict[str, Any]],
                               defaults: dict[str, Any]) -> list[EvalDatasetSpec]:
    """The datasets with every runtime and sample field resolved (unset ones keep the spec's defaults)."""
    out = []
    for cfg in raw_config:
        entry = dict(cfg or {})
        _apply_dataset_field_overrides(args, entry, defaults, {**DATASET_RUNTIME_SPECS, **DATASET_SAMPLE_SPECS})
        out.append(EvalDatasetSpec(**{k: v for k, v in entry.items() if v is not None}))
    return out
