"""``--custom-model-provider-path``: a user's Megatron model provider in place of the family builder of model.py.

    fn = load_provider(path)                                    # the dotted path, imported (one ConfigError line)
    model = build(fn, path, config=config, pre_process=True, post_process=True)   # its GPTModel, hidden-state forward
    model, rows = build_for_trainer(trainer, path, shape, config, hf_checkpoint)  # the trainer's: args set, checks

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

Megatron-LM's global arguments, which Miles's providers read (``from megatron.training import get_args``), are
the run's flags (``megatron_namespace``: every field of the trainer's config sections under its Miles / Megatron-LM
name, overridden by what miles resolves, ``resolved_values``: the parallel sizes, ``padded_vocab_size``, the model
shape from config.json, the ``--no-*`` switches under Megatron-LM's names), set before the provider is called
(``set_megatron_args``; ``load_provider`` installs the module before importing the provider's): through Megatron-LM's own
``megatron.training.global_vars.set_args`` where Megatron-LM is installed, else on a stand-in module
``megatron.training`` holding ``get_args`` / ``global_vars.set_args`` only (megatron-core does not include
Megatron-LM's training package).

Miles's own provider of a family built here (``miles.config.specs.PROVIDERS``: its Inkling provider) is not imported:
the path names the family, checked against config.json, and the trainer builds that family's model
(``families/``) in its place, as a ``--spec`` value names a family.

What is refused, each in one line naming the flag and the value: a path that does not import (a missing dependency
named, e.g. ``transformer_engine``), a provider that raises (where: e.g. an argument Megatron-LM has and miles does
not parse), a return value that is not a GPTModel, and a checkpoint whose model_type has no converter here (Miles
picks its HF <-> Megatron conversion by ``--model-name`` among its own modules, e.g. megatron_to_hf/inkling.py, which
miles does not have).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from miles.config import specs
from miles.config.base import ConfigError
from miles.utils.imports import load_function
from miles.utils.logging import get_logger

FLAG = "--custom-model-provider-path"
logger = get_logger(__name__)


def load_provider(path: str) -> Callable[..., Any]:
    """The provider function ``path`` names; a module that fails for want of a package names that package."""
    _training_package()                 # a module importing megatron.training at its top imports
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


def megatron_namespace(sections: list[Any], values: dict[str, Any]) -> types.SimpleNamespace:
    """Megatron-LM's ``args`` as a provider reads them: every field of ``sections`` (config dataclasses; a later one
    wins), then ``values`` (``resolved_values``: what miles resolved, which a given flag agrees with)."""
    ns: dict[str, Any] = {}
    for section in sections:
        if section is not None and dataclasses.is_dataclass(section):
            ns.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
    return types.SimpleNamespace(**(ns | values))


# Megatron-LM's switches stored under another name (``--no-x`` -> ``args.y = False``): Megatron-LM's dest -> ours
_NEGATED = {"masked_softmax_fusion": "no_masked_softmax_fusion", "bias_swiglu_fusion": "no_bias_swiglu_fusion",
            "bias_dropout_fusion": "no_bias_dropout_fusion", "apply_rope_fusion": "no_rope_fusion",
            "gradient_accumulation_fusion": "no_gradient_accumulation_fusion",
            "add_bias_linear": "disable_bias_linear", "add_position_embedding": "no_position_embedding"}


def resolved_values(shape: Any, opts: Any, flags: Any, *, hf_checkpoint: str, padded_vocab: int, bf16: bool,
                    sequence_parallel: bool) -> dict[str, Any]:
    """What Megatron-LM's args hold that miles resolves itself: the parallel sizes (options.Options), the model shape
    from config.json (model.ModelShape) under Megatron-LM's names, the checkpoint and dtype, and the ``--no-*``
    switches of ``flags`` (the Megatron section) under Megatron-LM's names (``--no-rope-fusion``:
    ``apply_rope_fusion False``)."""
    values = {dest: not bool(getattr(flags, ours, False)) for dest, ours in _NEGATED.items()}
    values.update(
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp, context_parallel_size=opts.cp,
        expert_model_parallel_size=opts.ep, expert_tensor_parallel_size=opts.etp, sequence_parallel=sequence_parallel,
        hf_checkpoint=hf_checkpoint, bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        padded_vocab_size=padded_vocab, vocab_size=shape.vocab_size, num_layers=shape.num_layers,
        hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads, kv_channels=shape.kv_channels,
        max_position_embeddings=shape.max_position_embeddings, norm_epsilon=shape.norm_epsilon,
        rotary_base=shape.rotary_base, qk_layernorm=shape.qk_layernorm, add_qkv_bias=shape.qkv_bias,
        untie_embeddings_and_output_weights=not shape.tie_embeddings, normalization="RMSNorm", swiglu=True,
        variable_seq_lengths=True, make_vocab_size_divisible_by=opts.vocab_divisible_by,
        recompute_granularity=opts.recompute_granularity, recompute_method=opts.recompute_method,
        recompute_num_layers=opts.recompute_num_layers, hidden_dropout=opts.hidden_dropout,
        attention_dropout=opts.attention_dropout)
    if shape.num_experts:
        values.update(num_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                      moe_router_topk=shape.moe_router_topk)
    return values


def set_megatron_args(args: Any) -> None:
    """``megatron.training.get_args()`` returns ``args`` from now on in this process (Megatron-LM's own global where
    it is installed, else the stand-in module described above)."""
    _training_package().set_args(args)


def _training_package() -> types.ModuleType:
    """Megatron-LM's ``megatron.training.global_vars`` where it is installed, else the stand-in's."""
    try:
        from megatron.training import global_vars
    except ImportError:
        global_vars = _stand_in_training_package()
    return global_vars


def _stand_in_training_package() -> types.ModuleType:
    """``megatron.training`` with ``get_args`` and ``global_vars.{get_args,set_args}``, registered in sys.modules."""
    import megatron

    existing = sys.modules.get("megatron.training.global_vars")
    if existing is not None:
        return existing
    global_vars = types.ModuleType("megatron.training.global_vars", "miles's stand-in: Megatron-LM's global args only")
    state: dict[str, Any] = {"args": None}

    def get_args() -> Any:
        if state["args"] is None:
            raise RuntimeError("args is not initialized.")
        return state["args"]

    def set_args(args: Any) -> None:
        state["args"] = args

    global_vars.get_args, global_vars.set_args = get_args, set_args
    training = types.ModuleType("megatron.training", "miles's stand-in for Megatron-LM's training package: get_args")
    training.get_args, training.global_vars = get_args, global_vars
    sys.modules["megatron.training"], sys.modules["megatron.training.global_vars"] = training, global_vars
    megatron.training = training
    return global_vars


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
        with _sequence_parallel_torch_norms(bool(getattr(config, "sequence_parallel", False))):
            model = fn(**kw)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{FLAG} {path}: the provider imports '{e.name}', which is not installed here"
                          f"{_hint(e.name or '')}; install it.") from None
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


@contextlib.contextmanager
def _sequence_parallel_torch_norms(enabled: bool) -> Iterator[None]:
    """Under ``--sequence-parallel``, while the provider builds: megatron-core's torch RMSNorm wrapper (its local
    spec's norms without transformer-engine or apex, which refuses sequence parallelism) builds
    ``model.SequenceParallelNorm``, as miles's own builder swaps it in (``model._sequence_parallel_norms``: the same
    torch RMSNorm, its gradient summed over TP). Other norms are left to the wrapper."""
    if not enabled:
        yield
        return
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from miles.trainer.megatron.model import SequenceParallelNorm

    original = WrappedTorchNorm.__dict__["__new__"]

    def new(cls, config, hidden_size: int, eps: float = 1e-5, *args, **kwargs):
        if config.normalization != "RMSNorm":
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        return SequenceParallelNorm(config, hidden_size, eps)

    WrappedTorchNorm.__new__ = staticmethod(new)
    try:
        yield
    finally:
        WrappedTorchNorm.__new__ = original


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


def check_callable(fn: Callable[..., Any], path: str) -> None:
    """The provider takes the keyword arguments Miles calls it with (``call_kwargs``): one line otherwise, before
    the job starts."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):      # a builtin or C callable: no signature to check, called as it is
        return
    kw = call_kwargs(fn, config=None, pre_process=True, post_process=True)
    try:
        sig.bind(**kw)
    except TypeError as e:
        raise ConfigError(f"{FLAG} {path}: it cannot be called as Miles calls a model provider ({', '.join(sorted(kw))} "
                          f"by keyword, plus vp_stage and config where declared): {e}; fix the provider's "
                          "signature.") from None


def preflight_check(cfg, hf_config: dict | None) -> None:
    """Under ``--dry-run`` and at start: the provider imports, and ``--hf-checkpoint``'s model_type has a converter
    here (the weights load from and sync to HF names through its family)."""
    mcfg = getattr(cfg, "megatron", None)
    path = getattr(mcfg, "custom_model_provider_path", None) if mcfg is not None else None
    if not path:
        return
    if specs.known_provider(path) is not None:      # Miles's own provider of a family built here: not imported
        if hf_config is not None:
            from miles.trainer.megatron.families import FAMILIES

            specs.check_provider(path, hf_config.get("model_type"), FAMILIES)
        return
    check_callable(load_provider(path), path)
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


def build_for_trainer(trainer: Any, path: str, shape: Any, config: Any, hf_checkpoint: str) -> tuple[Any, int]:
    """The provider's model for this rank of ``trainer`` (a ``MegatronTrainer``; this pipeline stage, on its device)
    and its vocabulary rows (``vocab_rows``): Megatron-LM's args set from the trainer's flags, the family's
    megatron-core patches applied, the provider called."""
    o = trainer.opts
    check_layout(path, pp=o.pp, mtp_layers=shape.mtp_num_layers, vision=shape.vision)
    shape.family.prepare(trainer.device)
    set_megatron_args(megatron_namespace(                  # what get_args() returns to the provider
        [trainer.cfg, trainer.algo, trainer.ckpt, trainer.megatron_cfg],
        resolved_values(shape, o, trainer.megatron_cfg, hf_checkpoint=hf_checkpoint, padded_vocab=trainer.padded_vocab,
                        bf16=trainer.bf16, sequence_parallel=trainer._sequence_parallel)))
    # in the dtype miles's own build uses (config.params_dtype: fp32 masters under the bf16 recipe, whose compute
    # copies optim.MasterWeights makes), whatever get_args().params_dtype (Megatron-LM's bf16) led the provider to
    model = build(load_provider(path), path, config=config, pre_process=trainer.stage.is_first,
                  post_process=trainer.stage.is_last).to(trainer.device, dtype=config.params_dtype)
    rows = vocab_rows(model, path, vocab_size=shape.vocab_size, tp_size=trainer.groups.tp_size,
                      padded=trainer.padded_vocab)
    if trainer.trainer_rank == 0:
        logger.info("%s %s: a %s (layer 0's core attention: %s), weights by the %s converter", FLAG, path,
                    type(model).__name__, _core_attention(model), shape.family.name)
    return model, rows


def _core_attention(model: Any) -> str:
    """The class name of the first decoder layer's core attention (what a provider's layer spec chose), or "none"."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    attn = getattr(getattr(layers[0], "self_attention", None), "core_attention", None) if len(layers) else None
    return type(attn).__name__ if attn is not None else "none"
