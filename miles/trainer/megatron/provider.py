"""``--custom-model-provider-path``: a user's Megatron model provider in place of the family builder of model.py.

    fn = load_provider(path)                                    # the dotted path, imported (one ConfigError line)
    model = build(fn, path, config=config, pre_process=True, post_process=True)   # its GPTModel, hidden-state forward

The provider is called as Miles calls it (radixark/miles@v0.1.0:miles/backends/megatron_utils/model_provider.py,
``get_model_provider_func``): by keyword, ``pre_process=``, ``post_process=`` and ``vp_stage=`` when its signature
has ``vp_stage``; a provider whose signature also has ``config`` (Megatron-LM's ``model_provider(pre_process,
post_process, vp_stage=None, config=None, pg_collection=None)``) gets the megatron-core ``TransformerConfig`` the
trainer builds from ``--hf-checkpoint``'s config.json and the Megatron flags (model.transformer_config). It must
return a megatron-core ``GPTModel`` (a subclass is fine: the layer spec, the modules, the config are its own)
whose parameter names are those of the checkpoint's family (families/): the weights are loaded from and synced to
the HF checkpoint by that family's converter (convert.py, export.py). Its forward is megatron-core's; the trainer
stops it after the final norm and computes log-probs from those hidden states with the output layer's weight, so an
output layer whose forward was replaced (e.g. a scaled head) is refused rather than silently bypassed.

What is refused, each in one line naming the flag and the value: a path that does not import (a missing dependency
named, e.g. ``transformer_engine``), a provider that raises (where), one that reads Megatron-LM's global arguments
(``megatron.training.get_args()``: Megatron-LM's training package is not part of miles, which parses Miles's flags
itself), a return value that is not a GPTModel, and a checkpoint whose model_type has no converter here (Miles picks
its HF <-> Megatron conversion by ``--model-name`` among its own modules, e.g. megatron_to_hf/inkling.py, which miles
does not have).
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable
from typing import Any

from miles.config.base import ConfigError
from miles.utils.imports import load_function

FLAG = "--custom-model-provider-path"


def load_provider(path: str) -> Callable[..., Any]:
    """The provider function ``path`` names; a module that fails for want of a package names that package."""
    module_name = path.rpartition(".")[0]
    if module_name:
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            ours = module_name == missing or module_name.startswith(missing + ".")
            if missing and not ours:        # the module is there; something it imports is not
                raise ConfigError(f"{FLAG} {path}: module '{module_name}' imports '{missing}', which is not "
                                  f"installed here{_hint(missing)}; install it or use a provider that does not "
                                  "need it.") from None
        except Exception:       # noqa: BLE001 -- load_function below names it in one line
            pass
    return load_function(path, FLAG)


def _hint(missing: str) -> str:
    top = missing.split(".")[0]
    if top == "transformer_engine":
        return (" (transformer-engine, a GPU package: pip install --no-build-isolation 'transformer_engine[pytorch]' "
                "on the GPU nodes)")
    if missing.startswith("megatron.training"):
        return " (Megatron-LM's training package, which megatron-core does not include)"
    return ""


def call_kwargs(fn: Callable[..., Any], *, config: Any, pre_process: bool, post_process: bool,
                vp_stage: int | None = None) -> dict[str, Any]:
    """The keyword arguments ``fn`` is called with (Miles's convention; ``config`` only where it is declared)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    kw: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
    if "vp_stage" in params:
        kw["vp_stage"] = vp_stage
    if "config" in params:
        kw["config"] = config
    return kw


def build(fn: Callable[..., Any], path: str, *, config: Any, pre_process: bool = True, post_process: bool = True,
          vp_stage: int | None = None) -> Any:
    """The provider's model, its forward stopped after the final norm (hidden states [s, b, h])."""
    from megatron.core.models.gpt import GPTModel

    kw = call_kwargs(fn, config=config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    try:
        model = fn(**kw)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{FLAG} {path}: the provider imports '{e.name}', which is not installed here"
                          f"{_hint(e.name or '')}" + (
                              "; miles does not hold Megatron-LM's global arguments: write the provider to take "
                              "`config` (the TransformerConfig miles builds) instead of calling get_args()"
                              if (e.name or "").startswith("megatron.training") else "; install it") + ".") from None
    except ConfigError:
        raise
    except Exception as e:      # noqa: BLE001 -- the user's code: one line naming where, not a traceback
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown location"
        text = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"{FLAG} {path}: calling it with {sorted(kw)} raised {type(e).__name__}: {text} "
                          f"(at {where}); fix the provider.") from None
    if not isinstance(model, GPTModel):
        raise ConfigError(f"{FLAG} {path} returned a {type(model).__name__}, not a megatron-core GPTModel: the "
                          "Megatron backend trains GPTModel-like models (megatron.core.models.gpt.GPTModel or a "
                          "subclass); return one.")
    head = getattr(model, "output_layer", None) if post_process else None
    if head is not None and "forward" in vars(head):
        raise ConfigError(f"{FLAG} {path}: the provider's model replaces its output layer's forward, which miles "
                          "does not run (log-probs come from the final hidden states and the output weight, "
                          "vocabulary-parallel); keep megatron-core's output layer.")
    model.__class__ = _hidden_class(type(model))
    return model


_HIDDEN: dict[type, type] = {}


def _hidden_class(cls: type) -> type:
    """``cls`` whose forward returns the final-norm hidden states (megatron-core's ``_postprocess`` skipped)."""
    if cls not in _HIDDEN:
        def _postprocess(self, hidden_states, *args, **kwargs):
            return hidden_states

        _HIDDEN[cls] = type(cls.__name__, (cls,), {"_postprocess": _postprocess, "__module__": cls.__module__,
                                                   "__doc__": cls.__doc__})
    return _HIDDEN[cls]


def vocab_rows(model: Any, path: str, *, vocab_size: int, tp_size: int, padded: int) -> int:
    """The vocabulary rows of the provider's embedding / output layer (the whole model's): miles's padded size, or
    the provider's own (Miles's providers often build config.json's unpadded ``vocab_size``) when it holds the
    vocabulary and splits evenly over TP; else one line."""
    rows = int(getattr(model, "vocab_size", padded))
    if rows == padded or (rows >= vocab_size and rows % tp_size == 0):
        return rows
    raise ConfigError(f"{FLAG} {path}: its model's vocab_size is {rows}; it must hold config.json's {vocab_size} "
                      f"tokens and split over TP {tp_size} (miles pads to {padded}); build the embedding with that "
                      "size.")


def check_layout(path: str, *, pp: int, mtp_layers: int, vision: bool) -> None:
    """The layouts the provider path does not run on, each refused in one line."""
    if pp > 1:
        raise ConfigError(f"{FLAG} {path} with --pipeline-model-parallel-size {pp} is not supported: the provider's "
                          "model is built whole on each rank; drop the pipeline size (TP, CP, EP and DP are "
                          "unaffected).")
    if mtp_layers:
        raise ConfigError(f"{FLAG} {path} with --mtp-num-layers {mtp_layers} is not supported: drop --mtp-num-layers.")
    if vision:
        raise ConfigError(f"{FLAG} {path} on a vision-language checkpoint is not supported: its vision tower is "
                          "attached by miles's own builder; drop the flag.")


def preflight_check(cfg, hf_config: dict | None) -> None:
    """Under ``--dry-run`` and at start: the provider imports, and ``--hf-checkpoint``'s model_type has a converter
    here (the weights load from and sync to HF names through its family)."""
    mcfg = getattr(cfg, "megatron", None)
    path = getattr(mcfg, "custom_model_provider_path", None) if mcfg is not None else None
    if not path:
        return
    load_provider(path)
    if hf_config is None:
        return
    from miles.trainer.megatron.families import FAMILIES

    mt = hf_config.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"{FLAG} {path}: --hf-checkpoint's model_type {mt!r} has no HF <-> Megatron weight "
                          f"converter here (the families of docs/trainer.md: {', '.join(sorted(FAMILIES))}); the "
                          "provider's weights could not be loaded from the checkpoint nor synced to the engines "
                          "(Miles converts its own models by --model-name in its megatron_to_hf/ modules, which "
                          "miles does not have).")
    check_layout(path, pp=getattr(mcfg, "pipeline_model_parallel_size", None) or 1,
                 mtp_layers=getattr(mcfg, "mtp_num_layers", None) or 0,
                 vision=mt == "qwen3_vl")
