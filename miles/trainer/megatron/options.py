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
from miles.trainer.megatron import families, fork_flags, mtp
from miles.trainer.megatron.model import ModelShape, use_transformer_engine
from miles.trainer.megatron.moe import MoeOptions, check_moe_shape, check_moe_static, resolve_moe
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
    distributed_optimizer: bool = True             # as Miles (set_default_megatron_args, Adam)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_backend: str = "auto"
    transformer_impl: str | None = None
    vocab_divisible_by: int = 128
    pipeline_split_flags: tuple[str, ...] = ()
    first_stage_layers: int | None = None          # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None           # --decoder-last-pipeline-num-layers
    moe_flags: tuple[str, ...] = ()
    moe: MoeOptions = MoeOptions()                 # --moe-* flags (moe.py)
    cp_comm_type: str = "p2p"                      # --cp-comm-type (context_parallel.py); Megatron's default
    cp_comm_types: tuple[str, ...] = ()            # as given (one value, or one per layer)
    cpu_offload_fraction: float | None = None      # --optimizer-cpu-offload (cpu_offload.py): the fraction; None: off
    distributed_optimizer_given: bool = False      # --use-distributed-optimizer on the command line
    mtp_num_layers: int = 0                        # --mtp-num-layers (mtp.py); 0: no MTP block
    mtp_training: bool = False                     # --enable-mtp-training
    mtp_loss_scale: float = 0.2                    # --mtp-loss-scaling-factor (Miles's default)
    freeze_router_gate: bool = False               # --moe-router-freeze-gate (fork_flags.py)
    clamp_shared_expert: bool = True               # off: --no-activation-func-clamp-shared-expert (fork_flags.py)


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
    ep = m.expert_model_parallel_size or 1
    distopt = m.use_distributed_optimizer                 # not given: on, as Miles (off with the CPU-offloaded AdamW)
    offload = getattr(m, "optimizer_cpu_offload", False)    # --optimizer-cpu-offload: no ZeRO unless asked for
    fraction = getattr(m, "optimizer_offload_fraction", None)
    distopt = not offload if distopt is None else distopt
    moe = tuple(f for f, v in (("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_router_topk),
                               ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size)) if v is not None)
    return Options(
        tp=m.tensor_model_parallel_size or 1, sequence_parallel=m.sequence_parallel,
        pp=m.pipeline_model_parallel_size or 1, cp=m.context_parallel_size or 1,
        ep=ep, etp=m.expert_tensor_parallel_size or 1,
        distributed_optimizer=distopt, recompute_granularity=granularity,
        recompute_method=method if granularity == "full" else None, recompute_num_layers=num if granularity == "full"
        else None, hidden_dropout=m.hidden_dropout or 0.0, attention_dropout=m.attention_dropout or 0.0,
        attention_backend=m.attention_backend or "auto", transformer_impl=m.transformer_impl,
        vocab_divisible_by=m.make_vocab_size_divisible_by or 128, pipeline_split_flags=split, moe_flags=moe, moe=resolve_moe(m),
        first_stage_layers=m.decoder_first_pipeline_num_layers, last_stage_layers=m.decoder_last_pipeline_num_layers,
        cp_comm_type=(getattr(m, "cp_comm_type", None) or ["p2p"])[0],
        cp_comm_types=tuple(getattr(m, "cp_comm_type", None) or ()),
        cpu_offload_fraction=(1.0 if fraction is None else fraction) if offload else None,
        distributed_optimizer_given=bool(m.use_distributed_optimizer),
        mtp_num_layers=getattr(m, "mtp_num_layers", None) or 0,
        mtp_training=bool(getattr(m, "enable_mtp_training", False)),
        mtp_loss_scale=0.2 if getattr(m, "mtp_loss_scaling_factor", None) is None else float(m.mtp_loss_scaling_factor),
        freeze_router_gate=bool(getattr(m, "moe_router_freeze_gate", False)),
        clamp_shared_expert=not getattr(m, "no_activation_func_clamp_shared_expert", False))


def _mismatch(name: str, value, key: str, config_value) -> ConfigError:
    return ConfigError(f"{name} {value} does not match --hf-checkpoint's config.json ({key} {config_value}): fix "
                       f"the flag or drop it (the model shape is read from config.json).")


def check_shape(m, shape: ModelShape) -> None:
    """Each given shape flag equals what config.json says. When ``--num-layers`` is given (a script that
    spells out the architecture, as Miles's model scripts do), the switches are checked too: Megatron
    would build without SwiGLU, RMSNorm, qk-layernorm, ... when they are absent."""
    if m is None:
        return
    check_moe_shape(m, shape)          # --num-experts, --moe-* against config.json (moe.py)
    fork_flags.check_fork_flags(m, shape)   # Miles's Megatron fork: --dsv4-*, --dsa-indexer-*, ... (fork_flags.py)
    families.check_flags(m, shape)     # each family's flags (MLA dims, YaRN rope, sinks, windows, ...: families/)
    mtp.check_mtp_shape(m, shape)      # --mtp-num-layers vs num_nextn_predict_layers (mtp.py)
    values = {
        "--num-layers": (m.num_layers, "num_hidden_layers", shape.num_layers),
        "--hidden-size": (m.hidden_size, "hidden_size", shape.hidden_size),
        "--ffn-hidden-size": (m.ffn_hidden_size, "intermediate_size", shape.ffn_hidden_size),
        "--num-attention-heads": (m.num_attention_heads, "num_attention_heads", shape.num_attention_heads),
        # multi-latent attention: megatron-core never reads --kv-channels (Miles's Kimi-K2 script passes 64, its
        # DeepSeek-V3 script 128, both for qk_nope_head_dim 128): checked only as standard attention's head_dim
        "--kv-channels": (None if shape.mla else m.kv_channels, "head_dim", shape.kv_channels),
        "--vocab-size": (m.vocab_size, "vocab_size", shape.vocab_size),
        "--max-position-embeddings": (m.max_position_embeddings, "max_position_embeddings",
                                      shape.max_position_embeddings),
    }
    # a checkpoint whose config.json has more rows than the model's vocabulary (Inkling's unpadded_vocab_size <
    # vocab_size: the rows past it are padding): --vocab-size may give either, Miles's Inkling script passes vocab_size
    rows = getattr(shape.variant, "hf_vocab_size", None)
    if rows is not None and rows != shape.vocab_size:
        values["--vocab-size"] = (None if m.vocab_size is not None and int(m.vocab_size) == rows else m.vocab_size,
                                  f"vocab_size {rows}, unpadded_vocab_size", shape.vocab_size)
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
    pe = shape.family.position_embedding
    if m.position_embedding_type not in (None, pe):
        raise _mismatch("--position-embedding-type", m.position_embedding_type, "position embedding", pe)
    if m.swiglu and not shape.family.swiglu:
        raise _mismatch("--swiglu", "(given)", "MLP", f"non-gated ({shape.family.name})")
    if m.rotary_percent is not None and not math.isclose(float(m.rotary_percent), shape.rotary_percent):
        raise _mismatch("--rotary-percent", m.rotary_percent, "partial_rotary_factor", shape.rotary_percent)
    if m.qk_layernorm and not shape.qk_layernorm and "qk_layernorm" not in fork_flags.claimed(shape):
        raise _mismatch("--qk-layernorm", "(given)", "q_norm/k_norm", "absent")
    if m.add_qkv_bias and not shape.qkv_bias and not shape.mla:    # MLA builds no qkv bias (Megatron ignores it)
        raise _mismatch("--add-qkv-bias", "(given)", "attention bias", "absent")
    if m.untie_embeddings_and_output_weights and shape.tie_embeddings:
        raise _mismatch("--untie-embeddings-and-output-weights", "(given)", "tie_word_embeddings", True)
    if m.num_layers is None or shape.family.bridge_only:    # the switches: what a Megatron-LM build would miss
        return
    gqa = shape.num_query_groups != shape.num_attention_heads
    for name, given, key, cv, needed in (
            ("--swiglu", m.swiglu, "hidden_act", "silu (SwiGLU)", shape.family.swiglu),
            ("--normalization RMSNorm", m.normalization == "RMSNorm", "normalization", "RMSNorm", True),
            ("--disable-bias-linear", m.disable_bias_linear, "linear biases", "absent", not shape.family.linear_biases),
            ("--qk-layernorm", m.qk_layernorm, "q_a_layernorm/kv_a_layernorm" if shape.mla else "q_norm/k_norm",
             "present", shape.qk_layernorm),
            ("--add-qkv-bias", m.add_qkv_bias or shape.mla or shape.family.linear_biases, "attention bias", "present",
             shape.qkv_bias),                                 # gpt-oss: every linear's bias (no --disable-bias-linear)
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
    from transformers import AutoConfig, PretrainedConfig

    d = PretrainedConfig._decode_special_floats(dict(hf_config))    # transformers' {"__float__": "Infinity"}
    try:
        config = AutoConfig.for_model(d.pop("model_type", None), **d)
    except ValueError:                                # an unknown model type: say which types are supported
        config = SimpleNamespace(**hf_config)
    shape = shape_of(config)
    from miles.trainer import lora
    from miles.trainer.megatron import vlm

    vlm.check_static(resolve(cfg.megatron, cfg.train), shape,   # Qwen3-VL: one line for what it does not run with
                     lora=lora.LoraSpec.from_config(cfg.train) is not None)
    check_shape(cfg.megatron, shape)
    o = resolve(cfg.megatron, cfg.train)
    check_static(o, shape)
    check_dp(o, max(cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node // (o.tp * o.pp), 1),
             lora=lora.LoraSpec.from_config(cfg.train) is not None)
    check_expert_world(o, cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node)
    check_pipeline_algo(resolve(cfg.megatron, cfg.train), cfg.algo)
    if (spec := lora.LoraSpec.from_config(cfg.train)) is not None:    # --lora-rank: the layouts LoRA runs on
        lora.check_megatron(resolve(cfg.megatron, cfg.train), shape, spec)
        mtp.check_mtp_lora(resolve(cfg.megatron, cfg.train))


def shape_of(hf_config) -> ModelShape:
    try:
        return ModelShape.from_hf_config(hf_config)
    except ValueError as e:
        raise ConfigError(f"--hf-checkpoint: {e}") from e


def check_static(o: Options, shape: ModelShape) -> None:
    """The unsupported values that do not depend on the device or the number of ranks."""
    check_moe_static(o, shape)         # MoE layers, --expert-model/tensor-parallel-size (moe.py)
    shape.family.check_static(o, shape)    # what the family does not run with (MLA under TP without SP, gpt-oss under CP)
    mtp.check_mtp_static(o, shape)     # the MTP block under PP with tied embeddings (mtp.py)
    from miles.trainer.megatron.pipeline import stage_layer_counts

    stage_layer_counts(shape.num_layers, o.pp, o.first_stage_layers, o.last_stage_layers)
    check_context_parallel(o, shape)
    from miles.trainer.megatron import vlm

    vlm.check_static(o, shape)         # Qwen3-VL: PP, CP, MTP (vlm.py)
    for what, n in (("num_attention_heads", shape.num_attention_heads), ("num_key_value_heads",
                                                                         shape.num_query_groups),
                    ("intermediate_size", shape.ffn_hidden_size)):
        if what == "num_key_value_heads" and shape.family.replicated_kv and n and o.tp % n == 0:
            continue                   # fewer KV heads than TP ranks: replicated over TP (kv_replicate.py)
        if n % o.tp:
            kv = " (or, for this family, a multiple of them)" if shape.family.replicated_kv else ""
            raise ConfigError(f"--tensor-model-parallel-size {o.tp} does not divide config.json's {what} {n}; "
                              f"choose a TP size that divides the heads, the KV heads{kv} and the FFN size.")


def check_context_parallel(o: Options, shape: ModelShape) -> None:
    """``--context-parallel-size`` / ``--cp-comm-type`` (``context_parallel.py``): one line for a value or a
    combination this backend does not run."""
    from miles.trainer.megatron.context_parallel import COMM_TYPES

    if len(set(o.cp_comm_types)) > 1:
        raise ConfigError(f"--cp-comm-type {' '.join(o.cp_comm_types)}: one value per layer is accepted only when "
                          "every layer uses the same one; give a single value.")
    if len(o.cp_comm_types) not in (0, 1, shape.num_layers):
        raise ConfigError(f"--cp-comm-type has {len(o.cp_comm_types)} values; give one, or one per layer "
                          f"({shape.num_layers}).")
    if o.cp == 1:                  # as in Megatron, --cp-comm-type has no effect without context parallelism
        return
    if o.cp_comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {o.cp_comm_type} (hierarchical context parallelism) needs "
                          "--hierarchical-context-parallel-sizes, which the Megatron backend does not take; use a2a, "
                          "all_gather or p2p.")
    if shape.family.own_context_parallel:      # its own core attention under CP, whatever these two flags say
        return
    if o.attention_backend in ("unfused", "local"):
        raise ConfigError(f"--attention-backend {o.attention_backend} (megatron-core's DotProductAttention) does not "
                          f"support --context-parallel-size {o.cp}; use --attention-backend auto/flash (torch SDPA).")
    if o.cp_comm_type == "a2a":
        heads, groups = shape.num_attention_heads // o.tp, shape.num_query_groups // o.tp
        if heads % o.cp or groups % o.cp:
            raise ConfigError(f"--cp-comm-type a2a splits the attention heads over the CP ranks: "
                              f"--context-parallel-size {o.cp} does not divide the {heads} attention heads and "
                              f"{groups} KV heads of a TP rank (config.json / TP {o.tp}); use --cp-comm-type "
                              "all_gather or p2p, or a CP size that divides both.")


def check_pipeline_algo(o: Options, algo) -> None:
    """What does not run through the pipeline yet: the PPO critic."""
    if o.pp == 1 or algo is None:
        return
    if algo.loss_type != "sft_loss" and algo.advantage_estimator == "ppo":
        raise ConfigError(f"--advantage-estimator ppo (the PPO critic) with --pipeline-model-parallel-size {o.pp} is "
                          "not supported by the Megatron backend; use --pipeline-model-parallel-size 1 (tensor and "
                          "data parallelism), another estimator (grpo, ...), or --train-backend fsdp.")


def check_dp(o: Options, dp_size: int, lora: bool = False) -> None:
    """The values this build does not run with ``dp_size`` data-parallel ranks (the trainer ranks / (TP x PP)).
    Under LoRA (``lora``) the distributed optimizer is not built (the trainer's AdamW, offloaded or not, holds only the
    small adapters: trainer.py's ``distributed_optimizer``), so the offloaded AdamW with it is no conflict there."""
    if o.cpu_offload_fraction is not None and o.distributed_optimizer_given and dp_size > 1 and not lora:
        raise ConfigError(f"--optimizer-cpu-offload with --use-distributed-optimizer over {dp_size} data-parallel "
                          "ranks is not supported by the Megatron backend (the offloaded AdamW is not sharded over DP; "
                          "with one DP rank there is nothing to shard): drop one of them.")


def check_expert_world(o: Options, trainers: int) -> None:
    """EP x ETP divides a pipeline stage's trainer ranks (megatron-core's expert groups split each stage; otherwise
    its group setup fails on the first rank)."""
    if o.ep * o.etp > 1 and trainers % o.pp == 0 and (trainers // o.pp) % (o.ep * o.etp):
        raise ConfigError(f"--expert-model-parallel-size {o.ep} (x --expert-tensor-parallel-size {o.etp}) does not "
                          f"divide the {trainers // o.pp} trainer ranks of a pipeline stage (--actor-num-nodes x "
                          f"--actor-num-gpus-per-node = {trainers}, --pipeline-model-parallel-size {o.pp}): choose "
                          "an expert-parallel size that divides them, or more trainer ranks.")


def check_supported(o: Options, shape: ModelShape, device: torch.device, dp_size: int, lora: bool = False) -> None:
    """One line for the first value this build does not run on ``device`` with ``dp_size`` DP ranks (``lora``: a
    --lora-rank run)."""
    check_static(o, shape)
    check_dp(o, dp_size, lora=lora)
    te = use_transformer_engine(device) and o.transformer_impl != "local"
    if o.sequence_parallel and o.tp == 1:          # Megatron-LM turns it off; here it is kept and does nothing
        warn_once(logger, "--sequence-parallel has no effect with --tensor-model-parallel-size 1 (no TP group to "
                          "split the sequence over).")
    if o.transformer_impl == "transformer_engine" and not te:
        warn_once(logger, "--transformer-impl transformer_engine: transformer-engine is unavailable here "
                          f"(device {device.type}); using megatron-core's local layer spec.")
