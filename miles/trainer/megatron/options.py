"""The Megatron flags as the trainer uses them: defaults filled in, the shape flags checked against
``config.json``, and the values this build does not support refused (one line naming flag and value).

    opts = resolve(cfg.megatron, cfg.train)     # Options with every value set
    check_shape(cfg.megatron, shape)            # --num-layers 4 vs config.json's num_hidden_layers 2 -> ConfigError
    check_supported(opts, shape, device, dp_size)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from miles.config.base import ConfigError
from miles.trainer.megatron.model import ModelShape, use_transformer_engine
from miles.utils.logging import get_logger, warn_once

logger = get_logger(__name__)


@dataclass(frozen=True)
class Options:
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    distributed_optimizer: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_backend: str = "auto"
    transformer_impl: str | None = None
    vocab_divisible_by: int = 128
    pipeline_split_flags: tuple[str, ...] = ()
    moe_flags: tuple[str, ...] = ()


def resolve(m, train=None) -> Options:
    """Options from a ``MegatronConfig`` (None: every default); ``--recompute-activations`` (TrainConfig)
    means Megatron's selective recompute when ``--recompute-granularity`` is not given."""
    if m is None:
        return Options()
    granularity = m.recompute_granularity
    if granularity is None and train is not None and getattr(train, "recompute_activations", False):
        granularity = "selective"
    method, num = m.recompute_method, m.recompute_num_layers
    if granularity == "full":
        method, num = method or "uniform", num or 1
    split = tuple(f for f, v in (("--decoder-first-pipeline-num-layers", m.decoder_first_pipeline_num_layers),
                                 ("--decoder-last-pipeline-num-layers", m.decoder_last_pipeline_num_layers))
                  if v is not None)
    moe = tuple(f for f, v in (("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_router_topk),
                               ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size)) if v is not None)
    return Options(
        tp=m.tensor_model_parallel_size or 1, sequence_parallel=m.sequence_parallel,
        pp=m.pipeline_model_parallel_size or 1, cp=m.context_parallel_size or 1,
        ep=m.expert_model_parallel_size or 1, etp=m.expert_tensor_parallel_size or 1,
        distributed_optimizer=m.use_distributed_optimizer, recompute_granularity=granularity,
        recompute_method=method if granularity == "full" else None, recompute_num_layers=num if granularity == "full"
        else None, hidden_dropout=m.hidden_dropout or 0.0, attention_dropout=m.attention_dropout or 0.0,
        attention_backend=m.attention_backend or "auto", transformer_impl=m.transformer_impl,
        vocab_divisible_by=m.make_vocab_size_divisible_by or 128, pipeline_split_flags=split, moe_flags=moe)


def _mismatch(name: str, value, key: str, config_value) -> ConfigError:
    return ConfigError(f"{name} {value} does not match --hf-checkpoint's config.json ({key} {config_value}): fix "
                       f"the flag or drop it (the model shape is read from config.json).")


def check_shape(m, shape: ModelShape) -> None:
    """Each given shape flag equals what config.json says. When ``--num-layers`` is given (a script that
    spells out the architecture, as Miles's model scripts do), the switches are checked too: Megatron
    would build without SwiGLU, RMSNorm, qk-layernorm, ... when they are absent."""
    if m is None:
        return
    values = {
        "--num-layers": (m.num_layers, "num_hidden_layers", shape.num_layers),
        "--hidden-size": (m.hidden_size, "hidden_size", shape.hidden_size),
        "--ffn-hidden-size": (m.ffn_hidden_size, "intermediate_size", shape.ffn_hidden_size),
        "--num-attention-heads": (m.num_attention_heads, "num_attention_heads", shape.num_attention_heads),
        "--kv-channels": (m.kv_channels, "head_dim", shape.kv_channels),
        "--vocab-size": (m.vocab_size, "vocab_size", shape.vocab_size),
        "--max-position-embeddings": (m.max_position_embeddings, "max_position_embeddings",
                                      shape.max_position_embeddings),
    }
    if m.group_query_attention or m.num_query_groups is not None:
        values["--num-query-groups"] = (m.num_query_groups, "num_key_value_heads", shape.num_query_groups)
    for name, (v, key, cv) in values.items():
        if v is not None and int(v) != int(cv):
            raise _mismatch(name, v, key, cv)
    for name, v, key, cv in (("--norm-epsilon", m.norm_epsilon, "rms_norm_eps", shape.norm_epsilon),
                             ("--rotary-base", m.rotary_base, "rope_theta", shape.rotary_base)):
        if v is not None and not math.isclose(float(v), float(cv), rel_tol=1e-6):
            raise _mismatch(name, v, key, cv)
    if m.normalization is not None and m.normalization != "RMSNorm":
        raise _mismatch("--normalization", m.normalization, "normalization", "RMSNorm")
    if m.position_embedding_type not in (None, "rope"):
        raise _mismatch("--position-embedding-type", m.position_embedding_type, "position embedding", "rope")
    if m.rotary_percent is not None and m.rotary_percent != 1.0:
        raise _mismatch("--rotary-percent", m.rotary_percent, "rotary percent", 1.0)
    if m.qk_layernorm and not shape.qk_layernorm:
        raise _mismatch("--qk-layernorm", "(given)", "q_norm/k_norm", "absent")
    if m.add_qkv_bias and not shape.qkv_bias:
        raise _mismatch("--add-qkv-bias", "(given)", "attention bias", "absent")
    if m.untie_embeddings_and_output_weights and shape.tie_embeddings:
        raise _mismatch("--untie-embeddings-and-output-weights", "(given)", "tie_word_embeddings", True)
    if m.num_layers is None:
        return
    gqa = shape.num_query_groups != shape.num_attention_heads
    for name, given, key, cv, needed in (
            ("--swiglu", m.swiglu, "hidden_act", "silu (SwiGLU)", True),
            ("--normalization RMSNorm", m.normalization == "RMSNorm", "normalization", "RMSNorm", True),
            ("--disable-bias-linear", m.disable_bias_linear, "linear biases", "absent", True),
            ("--qk-layernorm", m.qk_layernorm, "q_norm/k_norm", "present", shape.qk_layernorm),
            ("--add-qkv-bias", m.add_qkv_bias, "attention bias", "present", shape.qkv_bias),
            ("--group-query-attention", m.group_query_attention, "num_key_value_heads",
             f"{shape.num_query_groups} < num_attention_heads {shape.num_attention_heads}", gqa),
            ("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights, "tie_word_embeddings",
             False, not shape.tie_embeddings)):
        if needed and not given:
            raise ConfigError(f"{name} is missing but --hf-checkpoint's config.json has {key} {cv}: add {name} "
                              "(with --num-layers the Megatron shape flags must describe the model fully), or "
                              "drop the shape flags.")


def preflight_check(cfg, hf_config: dict | None) -> None:
    """The checks that need no device or world (``miles.run.preflight``, also under ``--dry-run``): the
    architecture is supported, shape flags match config.json, parallelism values are supported."""
    if hf_config is None:
        return
    from transformers import AutoConfig

    d = dict(hf_config)
    try:
        config = AutoConfig.for_model(d.pop("model_type", None), **d)
    except ValueError:                                # an unknown model type: say which types are supported
        config = SimpleNamespace(**hf_config)
    shape = shape_of(config)
    check_shape(cfg.megatron, shape)
    check_static(resolve(cfg.megatron, cfg.train), shape)


def shape_of(hf_config) -> ModelShape:
    try:
        return ModelShape.from_hf_config(hf_config)
    except ValueError as e:
        raise ConfigError(f"--hf-checkpoint: {e}") from e


def check_static(o: Options, shape: ModelShape) -> None:
    """The unsupported values that do not depend on the device or the number of ranks."""
    for name, v in (("--pipeline-model-parallel-size", o.pp), ("--context-parallel-size", o.cp),
                    ("--expert-model-parallel-size", o.ep), ("--expert-tensor-parallel-size", o.etp)):
        if v != 1:
            raise ConfigError(f"{name} {v} is not supported by the Megatron backend yet (1 only); use "
                              "--tensor-model-parallel-size and data parallelism, or drop the flag.")
    if o.pipeline_split_flags:
        raise ConfigError(f"{o.pipeline_split_flags[0]} needs --pipeline-model-parallel-size > 1, which is not "
                          "supported yet: drop it.")
    if o.moe_flags:
        raise ConfigError(f"{o.moe_flags[0]}: MoE models are not supported by the Megatron backend yet "
                          "(Llama, Qwen2 and Qwen3 dense): drop it or use --train-backend fsdp.")
    for what, n in (("num_attention_heads", shape.num_attention_heads), ("num_key_value_heads",
                                                                         shape.num_query_groups),
                    ("intermediate_size", shape.ffn_hidden_size)):
        if n % o.tp:
            raise ConfigError(f"--tensor-model-parallel-size {o.tp} does not divide config.json's {what} {n}; "
                              "choose a TP size that divides the heads, the KV heads and the FFN size.")


def check_supported(o: Options, shape: ModelShape, device: torch.device, dp_size: int) -> None:
    """One line for the first value this build does not run on ``device`` with ``dp_size`` DP ranks."""
    check_static(o, shape)
    te = use_transformer_engine(device) and o.transformer_impl != "local"
    if o.sequence_parallel and (not te or o.tp == 1):
        why = "TP 1" if o.tp == 1 else "the local layer spec (no transformer-engine): its norms do not support it"
        raise ConfigError(f"--sequence-parallel is not supported with {why}; drop --sequence-parallel.")
    if o.transformer_impl == "transformer_engine" and not te:
        warn_once(logger, "--transformer-impl transformer_engine: transformer-engine is unavailable here "
                          f"(device {device.type}); using megatron-core's local layer spec.")
