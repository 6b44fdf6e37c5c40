"""Whether transformers can build a checkpoint's model class here: the packages a class imports while it is built.

    check_buildable(config, auto_cls, path, flag, builder="the FSDP backend builds", alternative="add ...")
    missing_package_error(e, path, flag, config, auto_cls, builder=..., alternative=...)   # the same line
    check_embedded_engine_build(path, why="--rollout-engine embedded")     # the embedded engine's model

One implementation for every part of miles that builds a transformers model class: the FSDP trainer
(``miles.trainer.modeling``: policy, reference, teacher, critic) and the embedded engine's generic transformers path
(``miles.engine.model_runner``: ``serving_class`` is the class it builds). Each passes the auto class it builds with
and its own words (who builds, the other way to run); the preflight (``miles.run.preflight``, which may not import
the engine) and the build itself give the same line. A missing package is a ``ConfigError`` of one line: the flag
and path, the class, the model type, the package and the fix. It lives on this ground floor so that the trainer,
the engine and the run's preflight all reach it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.config.base import ConfigError


def _inkling_vision_scales(config: Any) -> None:
    """transformers' Inkling vision tower plans its scales in ``__init__`` (``plan_out_scales``), importing scipy
    there when the tower has fewer layers than scales: run that planning (small CPU tensors), not the build."""
    from transformers.models.inkling.modeling_inkling import plan_out_scales

    v = config.vision_config
    plan_out_scales(v.temporal_patch_size, v.patch_size, v.num_hidden_layers, v.num_channels)


# transformers model classes whose build imports a package lazily (inside a module's __init__, so importing the
# modeling module does not surface it): class name -> the part of the build that does the import, run by
# ``check_buildable`` at preflight. Found from the trainer's failure (tests/unit/trainer/megatron/test_inkling.py).
BUILD_IMPORTS: dict[str, Callable[[Any], None]] = {
    "InklingForConditionalGeneration": _inkling_vision_scales,    # scipy (vision tower)
    "InklingModel": _inkling_vision_scales,                       # the critic's backbone, same tower
}


def check_buildable(config: Any, auto_cls: Any, path: str | Path, flag: str | None, *, builder: str,
                    alternative: str) -> None:
    """Preflight of ``auto_cls.from_pretrained(path)`` without building the model: the model class's modeling
    module imports (transformers' auto mapping) and the parts of its build that import a package lazily
    (``BUILD_IMPORTS``) run; a missing package is ``missing_package_error``'s line. A config the auto class has no
    class for passes (``from_pretrained`` names it at the build)."""
    try:
        model_cls = auto_cls._model_mapping[type(config)]        # imports the class's modeling module
        probe = BUILD_IMPORTS.get(model_cls.__name__)
        if probe is not None:
            probe(config)
    except ModuleNotFoundError as e:
        raise missing_package_error(e, path, flag, config, auto_cls, builder=builder,
                                    alternative=alternative) from None
    except (KeyError, ValueError):
        return


def missing_package_error(e: ModuleNotFoundError, path: str | Path, flag: str | None, config: Any, auto_cls: Any, *,
                          builder: str, alternative: str) -> ConfigError:
    """One line for a transformers model class that needs a Python package not installed here (transformers'
    Inkling multimodal model: scipy, imported while its vision tower is built): the flag and path, ``builder`` (e.g.
    "the FSDP backend builds"), the class, the package and the fix (install it, or ``alternative``)."""
    package = (e.name or str(e)).split(".")[0]
    try:
        name = auto_cls._model_mapping[type(config)].__name__
    except (KeyError, AttributeError):
        name = f"{auto_cls.__name__}'s class"
    where = f"{flag} {path}" if flag else f"model directory {path}"
    return ConfigError(f"{where}: {builder} this checkpoint with transformers' {name} (model_type "
                       f"{getattr(config, 'model_type', '?')}), which needs the Python package '{package}', not "
                       f"installed; install it (pip install {package}) or {alternative}.")


# ----------------------------------------------------------------------------- the embedded engine's build
ENGINE_ALTERNATIVE = "use --rollout-engine sglang (SGLang installed, on GPU)"


def has_causal_lm(config: Any) -> bool:
    """Whether transformers has a causal-LM class for ``config``'s model type (a registered alias counts); False for
    a multimodal type it builds only as an image-text-to-text model (Kimi-K2.5's ``kimi_k25``, Inkling's released
    ``inkling_mm_model``), which the engine loads as that and serves on text (no image input: ``miles.engine.vlm``
    is Qwen3-VL's)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    mt = getattr(config, "model_type", None)
    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or mt not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def serving_class(config: Any) -> Any:
    """The transformers auto class the embedded engine builds ``config`` with (``ModelRunner``; a VLM it serves with
    images, Qwen3-VL, is built image-text-to-text there, as here: transformers has no causal LM for it): the causal
    LM, or image-text-to-text for a type without one (``has_causal_lm``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if has_causal_lm(config) else AutoModelForImageTextToText


def _engine_builds(why: str) -> str:
    return f"the embedded engine{f' ({why})' if why else ''} builds"


def engine_missing_package_error(e: ModuleNotFoundError, path: str | Path, config: Any, auto_cls: Any, *,
                                 why: str = "") -> ConfigError:
    """The embedded engine's ``missing_package_error`` line for ``--hf-checkpoint``."""
    return missing_package_error(e, path, "--hf-checkpoint", config, auto_cls, builder=_engine_builds(why),
                                 alternative=ENGINE_ALTERNATIVE)


def check_embedded_engine_build(path: str | Path, *, why: str = "") -> None:
    """Preflight of the embedded engine's model build (``ModelRunner`` on ``--hf-checkpoint``) without building it:
    ``check_buildable`` on the class ``serving_class`` picks, so a package that class imports while built
    (Inkling's vision tower: scipy) is the build's line at ``--dry-run``, whichever trainer backend runs. ``why``
    says how the embedded engine was chosen, e.g. "--rollout-engine embedded"."""
    from miles.utils.model_dir import load_config

    config = load_config(path, "--hf-checkpoint", check=False)
    check_buildable(config, serving_class(config), path, "--hf-checkpoint", builder=_engine_builds(why),
                    alternative=ENGINE_ALTERNATIVE)
