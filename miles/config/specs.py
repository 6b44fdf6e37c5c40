"""Miles's ``--spec <module> <function>`` values: which HF model family each stands for.

Miles's recorded commands name a custom Megatron layer spec of its own plugins with ``--spec`` (GLM-5's DeepSeek
sparse attention, DeepSeek-V4's, Qwen3.5's and Qwen3-Next's gated DeltaNet layers). Here the Megatron backend builds
the layers from ``--hf-checkpoint``'s config.json (its ``model_type``), so a spec only says which family the command
trains: it is checked against config.json and the families the backend builds, and changes nothing else.

    check_spec(["miles_plugins.models.glm5.glm5", "get_glm5_spec"], "glm_moe_dsa", built={...})

One row per spec in ``SPECS``: the spec as Miles writes it -> (the family's name, the config.json model types it
trains). A helper that builds a family adds or adjusts its row; nothing else needs to change.

Miles's own model providers (``--custom-model-provider-path``) of a family the Megatron backend builds are read the
same way (``PROVIDERS``, ``known_provider``): the path names the family, whose builder runs in its place
(Miles's Inkling provider is transformer-engine-only; ``trainer/megatron/provider.py`` imports any other path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from miles.config.base import ConfigError


@dataclass(frozen=True)
class Spec:
    family: str                      # the family's name, as people say it
    model_types: tuple[str, ...]     # config.json model_type values it trains


# radixark/miles@v0.1.0:miles_plugins/models/... (the values its recorded commands pass)
SPECS: dict[str, Spec] = {
    "miles_plugins.models.glm5.glm5 get_glm5_spec": Spec("GLM-5 / DeepSeek-V3.2 (DeepSeek sparse attention)",
                                                         ("glm_moe_dsa", "deepseek_v32")),
    "miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec": Spec("DeepSeek-V4", ("deepseek_v4",)),
    "miles_plugins.models.qwen3_5 get_qwen3_5_spec": Spec("Qwen3.5 / Qwen3.6 (gated DeltaNet)",
                                                          ("qwen3_5", "qwen3_5_moe", "qwen3_5_text",
                                                           "qwen3_5_moe_text")),
    "miles_plugins.models.qwen3_next get_qwen3_next_spec": Spec("Qwen3-Next (gated DeltaNet)", ("qwen3_next",)),
}


# radixark/miles@v0.1.0:miles_plugins/models/... (the --custom-model-provider-path values its recorded commands pass)
PROVIDERS: dict[str, Spec] = {
    "miles_plugins.models.inkling.model.inkling_model_provider": Spec("Inkling", ("inkling_mm_model", "inkling_text")),
}


def known_provider(path: str | None) -> Spec | None:
    """The ``PROVIDERS`` row of a ``--custom-model-provider-path`` value, None for a path that is imported."""
    return PROVIDERS.get(path) if path else None


def check_provider(path: str, model_type: str | None, built: Mapping[str, str]) -> None:
    """A ``PROVIDERS`` path against config.json's ``model_type`` and the families built (one ``ConfigError``
    line naming the flag, the value and the fix)."""
    spec = PROVIDERS[path]
    _check_family(f"--custom-model-provider-path {path}", f"Miles's {spec.family} model provider", spec, model_type,
                  built, drop="drop the flag", unbuilt_fix="drop the flag")


def _check_family(given: str, what: str, spec: Spec, model_type: str | None, built: Mapping[str, str], *,
                  drop: str, unbuilt_fix: str) -> None:
    """A ``SPECS`` / ``PROVIDERS`` row (``given``: the flag and its value, ``what``: what that value is) against
    config.json's ``model_type`` and the families built: one ``ConfigError`` line."""
    if model_type not in spec.model_types:
        raise ConfigError(f"{given} is {what} (config.json model_type {' or '.join(spec.model_types)}), but "
                          f"--hf-checkpoint's config.json has model_type {model_type}: point --hf-checkpoint at a "
                          f"{spec.family} checkpoint, or {drop}.")
    if model_type not in built:
        raise ConfigError(f"{given}: {spec.family} (model_type {model_type}) is not built by the Megatron backend "
                          f"yet (it builds: {', '.join(sorted(built))}); {unbuilt_fix}.")


def spec_key(values: list[str] | tuple[str, ...]) -> str:
    """``--spec``'s values as one string, the key of ``SPECS`` (a ``module.function`` single value is read as the
    pair ``module function``)."""
    parts = [v for v in values if v]
    if len(parts) == 1 and "." in parts[0]:
        module, _, function = parts[0].rpartition(".")
        parts = [module, function]
    return " ".join(parts)


def known_spec(values: list[str] | tuple[str, ...]) -> Spec:
    """The ``SPECS`` row of ``--spec``'s values, or one ``ConfigError`` line for a spec miles does not know (checked
    when the flags are parsed)."""
    key = spec_key(values)
    spec = SPECS.get(key)
    if spec is None:
        known = "; ".join(SPECS)
        raise ConfigError(f"--spec {key}: not a layer spec miles knows (it builds the layers from --hf-checkpoint's "
                          f"config.json model_type; the specs of Miles's recorded commands are: {known}); drop --spec.")
    return spec


def check_spec(values: list[str] | None, model_type: str | None, built: Mapping[str, str]) -> None:
    """``--spec`` against ``SPECS``, config.json's ``model_type`` and the families the backend builds
    (``built``: model_type -> name). One ``ConfigError`` line naming the flag, the value and the fix."""
    if not values:
        return
    spec = known_spec(values)
    _check_family(f"--spec {spec_key(values)}", f"{spec.family}'s layer spec", spec, model_type, built,
                  drop="drop --spec", unbuilt_fix="train one of those families")


def flag_docs() -> list[str]:
    """The docs/flags.md section for ``SPECS`` (tools/gen_flag_docs.py)."""
    lines = ["## `--spec` values", "",
             "Miles's custom layer specs: each stands for a family; config.json's model_type must be one of its types "
             "and the family must be built by the Megatron backend (which builds the layers from config.json). "
             "Any other value is refused.", "", "| `--spec` | family | config.json model_type |", "|---|---|---|"]
    lines += [f"| `{key}` | {s.family} | {', '.join(s.model_types)} |" for key, s in SPECS.items()]
    lines += ["", "## `--custom-model-provider-path` values of Miles's own models", "",
              "Miles's providers of a family the Megatron backend builds: the path names the family, built from "
              "config.json in place of Miles's module (config.json's model_type must be one of its types); any other "
              "path is imported and called (docs/trainer.md \"Custom model providers\").", "",
              "| `--custom-model-provider-path` | family | config.json model_type |", "|---|---|---|"]
    lines += [f"| `{key}` | {s.family} | {', '.join(s.model_types)} |" for key, s in PROVIDERS.items()]
    return lines + [""]
