"""Megatron-backend flags (``--train-backend megatron``): parallelism, recompute, dropout, attention, and
Megatron's model-shape flags, with Megatron-LM's names and meanings.

Every flag defaults to ``None`` (or ``False`` for switches), meaning "not given": the trainer then uses
Megatron's default for a run on a HF checkpoint (``miles.trainer.megatron.options``), and the model
shape comes from ``--hf-checkpoint``'s ``config.json``; a shape flag that is given must agree with it
(checked when the trainer starts: one line naming the flag, its value and the config's).
With another ``--train-backend`` any of these flags given is refused by name (``validate``).
Values this build does not support are refused by the trainer with one line naming the flag and value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from miles.config.base import ConfigError, flag
from miles.config.specs import known_spec

_INT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers", "context_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "recompute_num_layers", "make_vocab_size_divisible_by", "num_layers",
        "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
        "max_position_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk", "q_lora_rank",
        "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
        "original_max_position_embeddings", "data_pad_size_multiplier", "moe_latent_size",
        "dsv4_hc_mult", "dsv4_hc_sinkhorn_iters", "dsv4_o_groups", "dsv4_o_lora_rank", "dsv4_window_size",
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
_MLA_INT = ("moe_router_num_groups", "moe_router_group_topk", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim")
_SWITCHES = ("sequence_parallel", "use_distributed_optimizer", "accumulate_allreduce_grads_in_fp32",
             "attention_softmax_in_fp32", "group_query_attention", "swiglu", "qk_layernorm", "disable_bias_linear",
             "add_qkv_bias", "untie_embeddings_and_output_weights", "use_rotary_position_embeddings",
             "moe_grouped_gemm", "moe_permute_fusion", "moe_router_enable_expert_bias", "moe_router_pre_softmax",
             "optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
             "multi_latent_attention", "no_position_embedding", "no_rope_fusion",
             "no_gradient_accumulation_fusion", "no_masked_softmax_fusion", "no_bias_dropout_fusion",
             "moe_enable_deepep", "enable_experimental", "allgather_cp", "rematerialize_param_from_master_weight",
             "no_bias_swiglu_fusion", "no_activation_func_clamp_shared_expert", "moe_router_freeze_gate",
             "freeze_e_score_correction_bias")
# YaRN rope (multi-latent attention: DeepSeek-V3, Kimi-K2, JoyAI; miles/trainer/megatron/families/yarn.py): float flags, each
# checked against config.json's rope scaling
_ROPE_FLOATS = ("rotary_scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_HELP = {
    "tensor_model_parallel_size": "Tensor-parallel size (default 1); must divide the trainer ranks.",
    "sequence_parallel": "Sequence parallelism within the TP group (no effect with TP 1).",
    "pipeline_model_parallel_size": "Pipeline-parallel size (default 1; 1F1B schedule, no virtual stages).",
    "context_parallel_size": "Context-parallel size: each sequence split over this many ranks (default 1).",
    "expert_model_parallel_size": "Expert-parallel size (default 1): experts split over this many ranks.",
    "expert_tensor_parallel_size": "Expert tensor-parallel size (only 1 is supported).",
    "num_experts": "MoE: experts per layer; must match config.json's num_experts.",
    "moe_router_topk": "MoE: experts per token; must match config.json's num_experts_per_tok.",
    "moe_ffn_hidden_size": "MoE: expert FFN size; must match config.json's moe_intermediate_size.",
    "moe_shared_expert_intermediate_size": "MoE shared experts' FFN size; must match config.json's "
                                           "moe_intermediate_size x n_shared_experts (Qwen3-MoE: none).",
    # MLA and grouped routing (trainer.md "Multi-latent attention"): each must equal its config.json key
    "moe_router_num_groups": "MoE: config.json's n_group.",
    "moe_latent_size": "Latent MoE (Nemotron-3 Super / Ultra): the routed experts' width; must match config.json's "
                       "moe_latent_size.",
    "moe_router_group_topk": "MoE: config.json's topk_group.",
    "multi_latent_attention": "MLA (GLM-4.7-Flash, DeepSeek-V3), as config.json.",
    "no_position_embedding": "No effect on miles's own layers (rope only); a --custom-model-provider-path provider "
                             "reads it as Megatron-LM's args.add_position_embedding False.",
    "no_rope_fusion": "No effect on miles's own layers (unfused RoPE); a --custom-model-provider-path provider reads "
                      "it as Megatron-LM's args.apply_rope_fusion False.",
    "no_gradient_accumulation_fusion": "No effect on miles's own layers: weight gradients are never accumulated "
                                       "inside the wgrad GEMM here (Megatron-LM's fusion needs APEX or "
                                       "transformer-engine); a --custom-model-provider-path provider reads it as "
                                       "Megatron-LM's args.gradient_accumulation_fusion False.",
    "q_lora_rank": "MLA: config.json's q_lora_rank.",
    "kv_lora_rank": "MLA: config.json's kv_lora_rank.",
    "qk_head_dim": "MLA: config.json's qk_nope_head_dim.",
    "qk_pos_emb_head_dim": "MLA: config.json's qk_rope_head_dim.",
    "v_head_dim": "MLA: config.json's v_head_dim.",
    "mtp_num_layers": "Multi-token prediction: build megatron-core's MTP block of N layers from the checkpoint's MTP "
                      "layers (must equal config.json's num_nextn_predict_layers); trained only with "
                      "--enable-mtp-training.",
    "moe_grouped_gemm": "MoE: grouped GEMM experts (needs transformer-engine: refused where it does not import; "
                        "without the flag SequentialMLP, the same math).",
    "moe_permute_fusion": "MoE: fused token permutation (needs transformer-engine: refused where it does not import).",
    "moe_enable_deepep": "MoE: DeepEP's fused all-to-all, with --moe-token-dispatcher-type flex (needs DeepEP, "
                         "Python package deep_ep: refused where it does not import).",
    "moe_router_enable_expert_bias": "MoE: aux-loss-free expert bias (config.json's e_score_correction_bias; kept "
                                     "fixed, --moe-router-bias-update-rate 0).",
    "moe_router_pre_softmax": "MoE: softmax before top-k (config.json's norm_topk_prob false).",
    "use_distributed_optimizer": "Shard optimizer state over data-parallel ranks (ZeRO-1; default on, as in Miles, "
                                 "except with --expert-model-parallel-size > 1 or LoRA).",
    "optimizer_cpu_offload": "AdamW state and update on CPU for --optimizer-offload-fraction of the parameters "
                             "(copied back each step); not with --use-distributed-optimizer.",
    "overlap_cpu_optimizer_d2h_h2d": "With --optimizer-cpu-offload: a hint (the copies are non-blocking, not "
                                     "overlapped with the CPU update).",
    "use_precision_aware_optimizer": "Accepted: AdamW state and master weights are fp32 (the offloaded copies too).",
    "recompute_num_layers": "Layers per recompute chunk (full recompute).",
    "make_vocab_size_divisible_by": "Pad the vocabulary to a multiple of this x TP (default 128).",
    "hidden_dropout": "Dropout after attention and MLP (default 0.0 for RL; Megatron-LM's own default is 0.1).",
    "attention_dropout": "Dropout on attention probabilities (default 0.0 for RL; Megatron-LM's is 0.1).",
    "original_max_position_embeddings": "YaRN rope: config.json's rope_scaling original_max_position_embeddings.",
    "rotary_scaling_factor": "YaRN rope: config.json's rope_scaling factor (1.0, or not given, without scaling).",
    "beta_fast": "YaRN rope: config.json's rope_scaling beta_fast.",
    "beta_slow": "YaRN rope: config.json's rope_scaling beta_slow.",
    "mscale": "YaRN rope: config.json's rope_scaling mscale.",
    "mscale_all_dim": "YaRN rope: config.json's rope_scaling mscale_all_dim.",
    "no_masked_softmax_fusion": "No effect on miles's own layers: the masked-softmax fusion is never used there "
                                "(SDPA or megatron-core's unfused softmax); a --custom-model-provider-path provider "
                                "reads it as Megatron-LM's args.masked_softmax_fusion False.",
    "no_bias_dropout_fusion": "No effect on values: the fused and unfused bias-dropout-add compute the same sum; a "
                              "--custom-model-provider-path provider reads it as Megatron-LM's "
                              "args.bias_dropout_fusion False.",
    # Miles's GLM-5 / DeepSeek-V3.2 scripts (DeepSeek sparse attention, miles/trainer/megatron/families/dsa.py)
    "enable_experimental": "No effect: Megatron-LM's gate of its experimental features; the ones built here (DeepSeek "
                           "sparse attention) follow config.json.",
    "allgather_cp": "No effect on values: Miles's sequential context-parallel layout for DeepSeek sparse attention "
                    "(each CP rank a contiguous slice); here every CP rank holds Megatron's load-balanced chunks and "
                    "DSA all-gathers its keys over the CP group either way.",
    "data_pad_size_multiplier": "No effect: Miles pads each packed micro-batch to a multiple of N tokens for its "
                                "kernels; micro-batches here are right-padded rows, and padding changes no log-prob.",
    "rematerialize_param_from_master_weight": "No effect on values: Miles rebuilds the bf16 weights from the fp32 "
                                              "master weights after an offload instead of keeping a host copy (a "
                                              "memory saving not made here; the weights are the same).",
    # Miles's Megatron fork (radixark/Megatron-LM, its DeepSeek-V4 and DSA arguments): each must equal what
    # config.json says (miles/trainer/megatron/fork_flags.py), refused on a model without it
    "dsv4_hc_mult": "DeepSeek-V4: hyper-connection streams; must match config.json's hc_mult.",
    "dsv4_hc_sinkhorn_iters": "DeepSeek-V4: Sinkhorn iterations of the hyper-connection mixing; must match "
                              "config.json's hc_sinkhorn_iters.",
    "dsv4_o_groups": "DeepSeek-V4: groups of the output projection; must match config.json's o_groups.",
    "dsv4_o_lora_rank": "DeepSeek-V4: rank of each output group; must match config.json's o_lora_rank.",
    "dsv4_window_size": "DeepSeek-V4: the sliding window of every layer; must match config.json's sliding_window.",
    "dsa_indexer_n_heads": "Lightning indexer (DeepSeek-V4, DeepSeek sparse attention): heads; must match "
                           "config.json's index_n_heads.",
    "dsa_indexer_head_dim": "Lightning indexer: head size; must match config.json's index_head_dim.",
    "dsa_indexer_topk": "Lightning indexer: entries kept per query; must match config.json's index_topk.",
    "no_bias_swiglu_fusion": "No effect on values: the fused and unfused SwiGLU compute the same (the clamped "
                             "SwiGLU of --activation-func-clamp-value is never fused here); a "
                             "--custom-model-provider-path provider reads it as Megatron-LM's "
                             "args.bias_swiglu_fusion False.",
    "no_activation_func_clamp_shared_expert": "Miles's Megatron fork: the shared expert's SwiGLU is not clamped "
                                              "(--activation-func-clamp-value clamps the routed experts only; "
                                              "DeepSeek-V4); the embedded engines serve the model so too.",
    "moe_router_freeze_gate": "MoE: the routers' gate weights are not trained (kept as --hf-checkpoint has them).",
    "freeze_e_score_correction_bias": "No effect: the routers' expert bias (e_score_correction_bias) is never "
                                      "updated here (--moe-router-bias-update-rate 0 only).",
    "decoder_first_pipeline_num_layers": "Pipeline: transformer layers on the first stage (the rest split evenly).",
    "decoder_last_pipeline_num_layers": "Pipeline: transformer layers on the last stage (the rest split evenly).",
    # accepted for Miles's scripts, no effect (miles/config/support.py PARSE_ONLY)
    "accumulate_allreduce_grads_in_fp32": "No effect: gradients are always accumulated and reduced in fp32 here.",
    "attention_softmax_in_fp32": "No effect: the attention softmax always runs in fp32 here.",
    "use_rotary_position_embeddings": "Megatron-LM's older spelling of --position-embedding-type rope; no effect "
                                      "(RoPE is the only position embedding built).",
    "swiglu": "SwiGLU MLP: config.json's hidden_act silu, the only MLP built (required with --num-layers).",
    "disable_bias_linear": "No linear biases: config.json without mlp_bias, the only layout built (required with "
                           "--num-layers).",
    "group_query_attention": "GQA: config.json's num_key_value_heads below num_attention_heads (required then with "
                             "--num-layers).",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron", "--train-backend megatron only (Megatron-LM's names and meanings).")
    for dest in _INT:                # the MLA dims: metavar N keeps each --help entry on one line
        g.add_argument(flag(dest), type=int, default=None, help=_HELP.get(dest, "Model shape; must match config.json."),
                       **({"metavar": "N"} if dest in _MLA_INT else {}))
    for dest in _SWITCHES:           # --use-distributed-optimizer: None when not given (on by default, options.py)
        g.add_argument(flag(dest), action="store_true", default=None if dest == "use_distributed_optimizer" else False,
                       help=_HELP.get(dest, "Model shape; must match config.json."))
    g.add_argument("--optimizer-offload-fraction", type=float, default=None,
                   help="With --optimizer-cpu-offload: the fraction of the parameters (elements, in model order) "
                        "whose AdamW runs on CPU (default 1.0).")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=None,
                   help="With --enable-mtp-training: the MTP loss (mean over its layers) is scaled by this and added "
                        "to the training loss (default 0.2, as Miles).")
    g.add_argument("--enable-mtp-training", action="store_true",
                   help="Train the MTP layers of --mtp-num-layers (their loss is added to the training loss and "
                        "logged as mtp_loss); without it they are loaded and exported unchanged.")
    g.add_argument("--hidden-dropout", type=float, default=None, help=_HELP["hidden_dropout"])
    g.add_argument("--attention-dropout", type=float, default=None, help=_HELP["attention_dropout"])
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="Activation recompute: full layers, or the attention core only (selective).")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="Full recompute: uniform chunks of --recompute-num-layers, or the first N layers (block).")
    g.add_argument("--cp-comm-type", nargs="+", choices=["p2p", "all_gather", "a2a", "a2a+p2p"], default=None,
                   help="Context-parallel attention (one value, or one per layer): all_gather (K/V gathered), p2p "
                        "(Megatron's default; runs all_gather here), a2a (all-to-all over heads); a2a+p2p refused.")
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default=None,
                   help="Core attention: auto/flash: torch SDPA (local spec) or transformer-engine's choice; fused: "
                        "transformer-engine's cuDNN attention (refused where transformer-engine does not import); "
                        "unfused/local: megatron-core's DotProductAttention.")
    g.add_argument("--dsa-attention-backend", choices=["megatron", "tilelang"], default=None,
                   help="DeepSeek sparse attention's kernels (GLM-5, DeepSeek-V3.2): megatron: the unfused torch "
                        "path, what runs without the flag; tilelang (Miles's default, its fused SparseMLA and "
                        "lightning-indexer kernels): refused, naming the tilelang package where it does not import, "
                        "and its kernels are not wired here (miles/config/kernels.py).")
    g.add_argument("--spec", nargs="+", default=None, metavar="MODULE FUNCTION",
                   help="Miles's custom layer spec (e.g. miles_plugins.models.glm5.glm5 get_glm5_spec): checked against "
                        "config.json's model_type and the families built (miles/config/specs.py); the layers are built "
                        "from config.json.")
    g.add_argument("--custom-model-provider-path", default=None, metavar="MODULE.FUNCTION",
                   help="A Megatron model provider, called as Miles calls it (pre_process=, post_process=[, "
                        "vp_stage=][, config=]) -> a megatron-core GPTModel whose parameter names are those of "
                        "--hf-checkpoint's family (docs/trainer.md \"Custom model providers\").")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="Layer spec (default: transformer_engine when it imports on GPU, else local).")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None, help="Must match config.json.")
    g.add_argument("--norm-epsilon", type=float, default=None, help="Must match config.json's rms_norm_eps.")
    g.add_argument("--rotary-base", type=float, default=None, help="Must match config.json's rope_theta.")
    g.add_argument("--rotary-percent", type=float, default=None, help="Only 1.0 is supported.")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="RoPE variant: must match config.json (yarn: rope_scaling of type yarn; Megatron's default "
                        "with --multi-latent-attention, where yarn of factor 1 is plain rope).")
    for dest in _ROPE_FLOATS:
        g.add_argument(flag(dest), type=float, default=None, help=_HELP[dest], metavar="X")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid", "sqrtsoftplus"], default=None,
                   help="MoE router scores (Qwen3-MoE: softmax; GLM-4.7-Flash, DeepSeek-V3: sigmoid; DeepSeek-V4: "
                        "sqrtsoftplus, sqrt(softplus(logits))); must match config.json.")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default=None,
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
                   help="MoE load balancing (Megatron-LM's default aux_loss; no effect with --moe-aux-loss-coeff 0).")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=None,
                   help="MoE aux loss coefficient: 0 only (neither backend adds it to the RL loss).")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default=None,
                   help="MoE token dispatch over the EP group (default: alltoall with --expert-model-parallel-size > "
                        "1, else allgather; Inkling's own MoE runs both, in torch; flex, DeepEP's, is refused).")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="MoE router logits and probabilities in this dtype (default: the activations').")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=None,
                   help="MoE expert-bias update rate (used only with --moe-router-enable-expert-bias).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="MoE routing weight scale; must match config.json's routed_scaling_factor (1 without).")
    g.add_argument("--moe-layer-freq", default=None,
                   help="MoE layer pattern: an int N or a 0/1 list per layer ('[1,1,0]', '([0]*1+[1]*46)'); "
                        "must match config.json.")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default=None,
                   help="MoE token dropping order (no effect: no expert capacity is set, no token is dropped).")
    g.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"], default=None,
                   help="Attention softmax: learnable = gpt-oss's attention sinks (config.json's self_attn.sinks); "
                        "vanilla on the other families.")
    g.add_argument("--window-size", default=None,
                   help="Sliding-window attention 'LEFT,RIGHT' (gpt-oss: config.json's sliding_window,0, e.g. "
                        "'128,0'); the window is config.json's, as transformers and SGLang attend.")
    g.add_argument("--window-attn-skip-freq", default=None,
                   help="Full-attention layers among sliding ones: N (every N-th layer) or a 0/1 list per layer "
                        "(1: sliding); must match config.json's layer_types.")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="Gated attention: each head's output times sigmoid of its gate (Qwen3-Next / Qwen3.5: the gate "
                        "rows of config.json's q_proj); checked against config.json.")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="RMSNorms computing x * (1 + w), weights stored centred on 0 (Qwen3-Next / Qwen3.5's); checked "
                        "against config.json.")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="A sigmoid gate on the MoE shared expert's output (Qwen3-Next / Qwen3.5's "
                        "mlp.shared_expert_gate); checked against config.json.")
    g.add_argument("--experimental-attention-variant", choices=["gated_delta_net", "dsa", "dsv4"], default=None,
                   help="The attention of Miles's Megatron fork: dsv4 (DeepSeek-V4's), dsa (DeepSeek sparse attention: "
                        "DeepSeek-V3.2, GLM-5), gated_delta_net (Qwen3-Next / Qwen3.5); must name config.json's.")
    g.add_argument("--dsv4-compress-ratios", type=int, nargs="+", default=None, metavar="R",
                   help="DeepSeek-V4: per layer 0 (sliding), the CSA rate or the HCA rate; must match config.json's "
                        "layer_types and compress_rates (values past the layers: the checkpoint's MTP layers).")
    g.add_argument("--dsv4-compress-rope-theta", type=float, default=None,
                   help="DeepSeek-V4: rope theta of the compressed layers; must match config.json's "
                        "compress_rope_theta.")
    g.add_argument("--dsv4-n-hash-layers", type=int, default=None, metavar="N",
                   help="DeepSeek-V4: the first N MoE layers route by token id; must match config.json's "
                        "mlp_layer_types (hash_moe).")
    g.add_argument("--activation-func-clamp-value", type=float, default=None, metavar="X",
                   help="Clamped SwiGLU (gate <= X, |up| <= X): DeepSeek-V4 and gpt-oss; must match config.json's "
                        "swiglu_limit.")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None,
                   help="Only rope is supported.")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"], default=None,
                   help="Checkpoint format of --save/--load: torch_dist (Megatron-LM's default) only.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore the RNG states from --load.")
    g.add_argument("--finetune", action="store_true",
                   help="--load the model weights only: rollout 0, fresh optimizer, LR schedule and RNG.")
    g.add_argument("--ckpt-step", type=int, default=None, help="--load iter_<N> instead of the tracker's iteration.")
    g.add_argument("--ref-ckpt-step", type=int, default=None, help="--ref-load iter_<N> instead of the tracker's.")


@dataclass(kw_only=True)
class MegatronConfig:
    tensor_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    context_parallel_size: int | None = None
    expert_model_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None
    use_distributed_optimizer: bool | None = None      # None: not given (Miles's default, on: options.resolve)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    accumulate_allreduce_grads_in_fp32: bool = False
    attention_softmax_in_fp32: bool = False
    hidden_dropout: float | None = None
    attention_dropout: float | None = None
    attention_backend: str | None = None
    dsa_attention_backend: str | None = None           # megatron (torch) only; tilelang refused (kernels.py)
    cp_comm_type: list[str] | None = None
    transformer_impl: str | None = None
    spec: list[str] | None = None                      # --spec MODULE FUNCTION (specs.py: checked, else no effect)
    custom_model_provider_path: str | None = None      # a user's model provider (trainer/megatron/provider.py)
    make_vocab_size_divisible_by: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    group_query_attention: bool = False
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool = False
    normalization: str | None = None
    norm_epsilon: float | None = None
    qk_layernorm: bool = False
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    rotary_base: float | None = None
    rotary_percent: float | None = None
    rope_type: str | None = None
    rotary_scaling_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    no_masked_softmax_fusion: bool = False
    no_bias_dropout_fusion: bool = False
    enable_experimental: bool = False
    allgather_cp: bool = False
    data_pad_size_multiplier: int | None = None
    rematerialize_param_from_master_weight: bool = False
    position_embedding_type: str | None = None
    ckpt_format: str | None = None
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_step: int | None = None
    ref_ckpt_step: int | None = None
    use_rotary_position_embeddings: bool = False
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_latent_size: int | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    multi_latent_attention: bool = False
    no_position_embedding: bool = False
    no_rope_fusion: bool = False
    no_gradient_accumulation_fusion: bool = False
    softmax_type: str | None = None
    window_size: str | None = None
    window_attn_skip_freq: str | None = None
    attention_output_gate: bool = False
    apply_layernorm_1p: bool = False
    moe_shared_expert_gate: bool = False
    # Miles's Megatron fork (DeepSeek-V4, DSA): checked against config.json (miles/trainer/megatron/fork_flags.py)
    experimental_attention_variant: str | None = None
    dsv4_hc_mult: int | None = None
    dsv4_hc_sinkhorn_iters: int | None = None
    dsv4_compress_ratios: list[int] | None = None
    dsv4_compress_rope_theta: float | None = None
    dsv4_o_groups: int | None = None
    dsv4_o_lora_rank: int | None = None
    dsv4_n_hash_layers: int | None = None
    dsv4_window_size: int | None = None
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    activation_func_clamp_value: float | None = None
    no_bias_swiglu_fusion: bool = False
    no_activation_func_clamp_shared_expert: bool = False
    moe_router_freeze_gate: bool = False
    freeze_e_score_correction_bias: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    moe_router_score_function: str | None = None
    moe_router_load_balancing_type: list[str] | None = None
    moe_aux_loss_coeff: list[float] | None = None
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str | None = None
    moe_enable_deepep: bool = False
    moe_router_dtype: str | None = None
    moe_permute_fusion: bool = False
    moe_router_bias_update_rate: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_layer_freq: str | None = None
    moe_router_pre_softmax: bool = False
    moe_token_drop_policy: str | None = None
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float | None = None
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float | None = None      # None: not given (0.2, as Miles: options.resolve)
    enable_mtp_training: bool = False

    def given(self) -> list[str]:
        """The flags of this section that were passed (a value other than None / False)."""
        return [flag(f.name) for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]

    def validate(self, train_backend: str) -> None:
        """Refuse this section's flags under another backend; check values that need no model or world."""
        given = self.given()
        if given and train_backend != "megatron":
            more = f" (and {len(given) - 1} more Megatron flags)" if len(given) > 1 else ""
            raise ConfigError(f"{given[0]}{more} needs --train-backend megatron (got --train-backend "
                              f"{train_backend}); add --train-backend megatron or drop the Megatron flags.")
        for name in _INT:
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{flag(name)} must be positive, got {v}.")
        if self.spec is not None:
            known_spec(self.spec)
        if self.moe_enable_deepep and self.moe_token_dispatcher_type != "flex":
            raise ConfigError(f"--moe-enable-deepep needs --moe-token-dispatcher-type flex (got "
                              f"{self.moe_token_dispatcher_type or 'the default, allgather'}): add it, or drop "
                              "--moe-enable-deepep.")
        if self.ckpt_format not in (None, "torch_dist"):
            raise ConfigError(f"--ckpt-format {self.ckpt_format} is not supported: miles's Megatron backend reads and "
                              "writes torch_dist checkpoints; pass --ckpt-format torch_dist or drop the flag.")
        for name in ("ckpt_step", "ref_ckpt_step"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must be >= 0 (an iteration of an iter_* directory), got "
                                  f"{getattr(self, name)}.")
        f = self.optimizer_offload_fraction
        if f is not None and not (math.isfinite(f) and 0.0 <= f <= 1.0):
            raise ConfigError(f"--optimizer-offload-fraction must be in [0, 1], got {f}.")
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v < 1.0:
                raise ConfigError(f"{flag(name)} must be in [0, 1), got {v}.")
        if self.enable_mtp_training and not self.mtp_num_layers:
            raise ConfigError("--enable-mtp-training needs --mtp-num-layers N (the MTP layers to build and train, "
                              "config.json's num_nextn_predict_layers): add --mtp-num-layers or drop "
                              "--enable-mtp-training.")
        for name in ("dsv4_compress_rope_theta", "activation_func_clamp_value"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{flag(name)} must be a finite number > 0, got {v}.")
        if self.dsv4_n_hash_layers is not None and self.dsv4_n_hash_layers < 0:
            raise ConfigError(f"--dsv4-n-hash-layers must be >= 0, got {self.dsv4_n_hash_layers}.")
        if any(r < 0 for r in self.dsv4_compress_ratios or []):
            raise ConfigError(f"--dsv4-compress-ratios must be >= 0 (0: a sliding layer), got "
                              f"{' '.join(map(str, self.dsv4_compress_ratios))}.")
        for name in _ROPE_FLOATS:
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ConfigError(f"{flag(name)} must be a finite number, got {v}.")
        for name, values in (("moe_aux_loss_coeff", self.moe_aux_loss_coeff or []),
                             ("mtp_loss_scaling_factor", [self.mtp_loss_scaling_factor]),
                             ("moe_router_bias_update_rate", [self.moe_router_bias_update_rate]),
                             ("moe_router_topk_scaling_factor", [self.moe_router_topk_scaling_factor])):
            for v in values:
                if v is not None and not (math.isfinite(v) and v >= 0):
                    raise ConfigError(f"{flag(name)} must be a finite number >= 0, got {v}.")
