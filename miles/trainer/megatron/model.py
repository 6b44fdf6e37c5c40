"""GPTModel from a HF ``config.json``, and its layer spec: what every family shares (the families, each one module
with its hooks, are ``families/``: Llama, Qwen2/3, Qwen3-MoE, Qwen3-VL; multi-latent attention; gpt-oss;
Gemma 4; Nemotron-H, which builds megatron-core's MambaModel through its ``build_model`` hook).

    shape = ModelShape.from_hf_config(hf_config)          # the Megatron view of the HF architecture
    model = build_gpt_model(shape, tp_size=2, device=dev) # megatron-core GPTModel, returns hidden states

A family's own layer spec (``Family.local_spec``) is used when it gives one; else the transformer-engine layer spec
when ``transformer_engine`` imports (and the device is a GPU), the local spec otherwise, with torch SDPA as its core attention (``SDPACoreAttention``) unless
megatron-core's unfused one is asked for. ``HiddenGPTModel`` is a GPTModel whose forward stops after the final
norm: log-probs are computed from those hidden states, vocabulary-parallel (``miles.trainer.logprobs``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from miles.trainer.megatron import mtp
from miles.trainer.megatron.families import FAMILIES, Family, family_of, nearest_family
from miles.trainer.megatron.moe import hf_moe_fields


@dataclass(frozen=True)
class ModelShape:
    """What megatron-core needs to know about a HF decoder-only architecture."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_epsilon: float
    qk_layernorm: bool
    qkv_bias: bool
    tie_embeddings: bool
    num_experts: int = 0                      # MoE layers (moe.py); 0: a dense model
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True
    moe_layer_pattern: tuple[int, ...] = ()   # 1 per MoE layer, 0 per dense one
    moe_shared_ffn_hidden_size: int = 0       # DeepSeek-style MoE (families/mla.py): shared experts' FFN size (0: none)
    moe_score_function: str = "softmax"       # router scores: softmax (Qwen3-MoE), sigmoid (DeepSeek-V3), sqrtsoftplus (V4)
    moe_expert_bias: bool = False             # e_score_correction_bias
    moe_topk_scaling: float = 1.0             # routed_scaling_factor
    moe_num_groups: int = 0                   # n_group (0: no grouped routing)
    moe_group_topk: int = 0                   # topk_group
    q_lora_rank: int = 0                      # multi-latent attention (families/mla.py); 0: no q LoRA (q_proj)
    kv_lora_rank: int = 0                     # 0: standard attention
    qk_head_dim: int = 0                      # qk_nope_head_dim
    qk_pos_emb_head_dim: int = 0              # qk_rope_head_dim
    v_head_dim: int = 0
    yarn: tuple[float, ...] = ()              # MLA yarn rope: (factor, original max positions, beta_fast, beta_slow,
    #                                           mscale, mscale_all_dim); () without rope scaling
    nextn_layers: int = 0                     # config.json's num_nextn_predict_layers (the checkpoint's MTP layers)
    mtp_num_layers: int = 0                   # MTP layers built (--mtp-num-layers, mtp.py); 0: none
    vision: bool = False                      # a vision-language model (Qwen3-VL, vlm.py): the shape is its text model's
    final_logit_softcapping: float = 0.0      # the log-prob head caps the logits c * tanh(z / c) (0: none)
    rotary_percent: float = 1.0               # the part of each head rope rotates (partial_rotary_factor; Qwen3-Next)
    variant: object = None                    # the family's own fields (a frozen dataclass of its module, e.g.
    #                                           gpt_oss.GptOssShape), None for a family without any

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def family(self) -> Family:
        """The family that builds this shape (``families/``)."""
        return family_of(self.model_type)

    @classmethod
    def from_hf_config(cls, c) -> ModelShape:
        mt = getattr(c, "model_type", None)
        if mt not in FAMILIES:
            raise ValueError(f"--train-backend megatron does not build model_type {mt!r}; the nearest family it "
                             f"builds is {nearest_family(mt)} (all: {sorted(FAMILIES)}); use "
                             "--train-backend fsdp for other architectures.")
        fam = family_of(mt)
        if fam.shape_fields is not None:         # a family that reads its config.json itself
            return cls(**fam.shape_fields(c))
        vision = mt == "qwen3_vl"
        if vision:                    # Qwen3-VL (vlm.py): the text model's shape; tied embeddings are the top config's
            from miles.trainer.megatron.vlm import is_vlm_config

            if not is_vlm_config(c):
                raise ValueError("a qwen3_vl config.json without vision_config / image_token_id")
            tie = bool(getattr(c, "tie_word_embeddings", False))
            c = c.text_config
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"--train-backend megatron: hidden_act {c.hidden_act!r} is not supported (silu only).")
        rope = getattr(c, "rope_parameters", None) or {}
        scaling = getattr(c, "rope_scaling", None)
        if rope.get("rope_type", "default") not in fam.rope_types or (
                scaling and scaling.get("rope_type", "default") not in (*fam.rope_types, None)):
            raise ValueError(f"--train-backend megatron: rope scaling {rope or scaling} is not supported.")
        if getattr(c, "use_sliding_window", False):
            raise ValueError("--train-backend megatron: sliding-window attention is not supported.")
        if getattr(c, "mlp_bias", False):
            raise ValueError("--train-backend megatron: mlp_bias is not supported.")
        theta = rope.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or int(c.hidden_size) // heads
        fields = dict(kv_channels=int(head_dim), qk_layernorm=False, qkv_bias=bool(getattr(c, "attention_bias", False)))
        fields.update(fam.attention_fields(c))       # e.g. Qwen3's q/k norms; MLA: kv_channels = qk_nope_head_dim
        moe_fields = (fam.moe_fields or hf_moe_fields)(c)
        return cls(model_type=mt, num_layers=int(c.num_hidden_layers), hidden_size=int(c.hidden_size),
                   ffn_hidden_size=int(c.intermediate_size), num_attention_heads=heads,
                   num_query_groups=int(getattr(c, "num_key_value_heads", None) or heads),
                   vocab_size=int(c.vocab_size), max_position_embeddings=int(c.max_position_embeddings),
                   rotary_base=float(theta), norm_epsilon=float(c.rms_norm_eps),
                   tie_embeddings=tie if vision else bool(getattr(c, "tie_word_embeddings", False)),
                   nextn_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0), vision=vision, **fields,
                   **moe_fields)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Vocabulary rows after padding to a multiple of ``divisible_by * tp_size`` (as Megatron does)."""
    mult = max(divisible_by, 1) * tp_size
    return -(-vocab_size // mult) * mult


def use_transformer_engine(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(shape: ModelShape, *, tp_size: int, device: torch.device, params_dtype=torch.float32,
                       bf16: bool = False, recompute: str | None = None, recompute_method: str | None = None,
                       recompute_num_layers: int | None = None, attention_softmax_in_fp32: bool = True,
                       hidden_dropout: float = 0.0, attention_dropout: float = 0.0, sequence_parallel: bool = False,
                       pp_size: int = 1, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                       moe: dict | None = None, cp_size: int = 1, cp_comm_type: str = "p2p",
                       mtp_loss_scale: float = 0.2, deterministic: bool = False):
    """megatron-core's TransformerConfig of ``shape``; ``deterministic``: --deterministic-mode (megatron-core's
    ``deterministic_mode``, which keeps its layers off kernels without a deterministic implementation)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    on_gpu = device.type == "cuda"
    kw = {}
    if recompute:
        kw.update(recompute_granularity=recompute, recompute_method=recompute_method,
                  recompute_num_layers=recompute_num_layers)
    kw.update(moe or {})           # MoE layers and expert parallelism (moe.config_kwargs)
    kw.update(shape.family.config_kwargs(shape))    # what the family adds (families/): MLA, its router, sinks, ...
    if shape.mtp_num_layers:       # the MTP block (mtp.py)
        kw.update(mtp_num_layers=shape.mtp_num_layers, mtp_loss_scaling_factor=mtp_loss_scale)
    cp_kw = {"context_parallel_size": cp_size, "cp_comm_type": cp_comm_type} if cp_size > 1 else {}
    if not shape.family.own_context_parallel:   # context_parallel.py (the value megatron-core hands the core attention)
        kw.update(cp_kw)
    if pp_size > 1:                # megatron-core asks for pipeline_dtype; pipeline.py's schedule does not read it
        kw.update(pipeline_model_parallel_size=pp_size, pipeline_dtype=torch.float32,
                  num_layers_in_first_pipeline_stage=first_stage_layers,
                  num_layers_in_last_pipeline_stage=last_stage_layers)
    config = (MLATransformerConfig if shape.mla else TransformerConfig)(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon,
        qk_layernorm=shape.qk_layernorm, add_qkv_bias=shape.qkv_bias, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
        tensor_model_parallel_size=tp_size, sequence_parallel=sequence_parallel, params_dtype=params_dtype,
        bf16=bf16, use_cpu_initialization=True, perform_initialization=False,
        attention_softmax_in_fp32=attention_softmax_in_fp32, bias_dropout_fusion=on_gpu, masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, deterministic_mode=deterministic,
        **({"activation_func": F.silu, "gated_linear_unit": True, "add_bias_linear": False,
            "bias_activation_fusion": on_gpu} | kw))
    if shape.family.own_context_parallel:       # past megatron-core's refusal of CP for the attention it names
        for name, value in cp_kw.items():
            setattr(config, name, value)
    return config


def no_math_sdpa(q: torch.Tensor):
    """On a GPU in bf16/fp16: SDPA may use flash attention, then cuDNN's, then the memory-efficient kernel, never
    the math fallback that materialises the [b, heads, s, s] scores (no kernel fits: SDPA raises, naming why)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                       set_priority=True)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float, scale: float) -> torch.Tensor:
    """Causal SDPA over [b, heads, s, hn] (grouped K/V heads allowed) without the math fallback on GPU. Multi-latent
    attention's value head dim differs from the query/key one, which no fused GPU kernel takes: the narrower side
    is zero-padded to the wider (zero columns add nothing to q.k, and the padded output columns are dropped), so
    the result is exact."""
    dq, dv = q.shape[-1], v.shape[-1]
    pad = q.device.type == "cuda" and dq != dv
    if pad and dv < dq:
        v = torch.nn.functional.pad(v, (0, dq - dv))
    elif pad:
        q, k = (torch.nn.functional.pad(t, (0, dv - dq)) for t in (q, k))
    with no_math_sdpa(q):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                               enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :dv] if pad else out


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention on ``torch.nn.functional.scaled_dot_product_attention`` (flash or memory-efficient
    kernels on GPU), in place of megatron-core's unfused ``DotProductAttention`` in the local layer spec, which
    materialises the [b, heads, s, s] scores of every layer. Same constructor and forward as megatron-core's
    core attention; rows are causal with right padding (no mask). Attention dropout draws inside megatron-core's
    tensor-parallel RNG stream, as ``DotProductAttention`` does. With context parallelism the local query chunks
    attend over the whole sequence (``context_parallel.attention``, by ``--cp-comm-type``)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / config.kv_channels ** 0.5
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        self.cp_comm_type = cp_comm_type or "p2p"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        from megatron.core import tensor_parallel

        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention runs causal rows only (no mask, bias or packing).")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, heads, s, hn]
        p = self.dropout if self.training else 0.0
        ctx = tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with ctx:
            if self.cp_group is not None:           # this rank's two chunks against the whole sequence
                from miles.trainer.megatron import context_parallel

                out = context_parallel.attention(q, k, v, comm=self.cp_comm_type, group=self.cp_group,
                                                 scale=self.softmax_scale, dropout_p=p)
            else:
                out = causal_sdpa(q, k, v, dropout_p=p, scale=self.softmax_scale)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


class SequenceParallelNorm:
    """megatron-core's torch norm of the local spec (``WrappedTorchNorm``, which refuses ``sequence_parallel``)
    for ``--sequence-parallel``: the same ``torch.nn.RMSNorm``, its weight marked ``sequence_parallel`` so that
    ``parallel.finish_grads`` sums its gradient over TP (each TP rank normalises its part of the sequence)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> torch.nn.Module:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _swap_norms(obj, old, new, seen: set[int]):
    """``obj`` (a layer/block spec, nested dataclasses and lists) with every reference to ``old`` replaced by ``new``."""
    import dataclasses

    if obj is old:
        return new
    if isinstance(obj, list):
        return [_swap_norms(o, old, new, seen) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and id(obj) not in seen:
        seen.add(id(obj))
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _swap_norms(getattr(obj, f.name), old, new, seen))
    return obj


@contextlib.contextmanager
def _sequence_parallel_norms(config, spec):
    """Under ``--sequence-parallel``: the spec's megatron-core torch norms (the local spec without apex; a family's
    local spec beside transformer-engine) and, without TE / apex, the block's final norm are ``SequenceParallelNorm``
    while the model is built."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not config.sequence_parallel:
        yield spec
        return
    block = transformer_block.LayerNormImpl is WrappedTorchNorm     # else TE's / apex's final norm (SP-aware)
    if block:
        transformer_block.LayerNormImpl = SequenceParallelNorm
    try:
        yield _swap_norms(spec, WrappedTorchNorm, SequenceParallelNorm, set())
    finally:
        if block:
            transformer_block.LayerNormImpl = WrappedTorchNorm


def build_gpt_model(shape: ModelShape, config, *, padded_vocab: int, device: torch.device,
                    core_attention: str = "sdpa", pre_process: bool = True, post_process: bool = True,
                    mtp_training: bool = False, hf_config=None):
    """A HiddenGPTModel on ``device`` (weights uninitialised: load them with ``convert.load_hf_into``).
    With ``shape.mtp_num_layers`` it holds megatron-core's MTP block (``mtp.py``; on the last pipeline stage, with a
    copy of the embedding), run and trained only with ``mtp_training``, else frozen.
    ``core_attention`` (local spec only): "sdpa" (``SDPACoreAttention``) or "unfused" (megatron-core's).
    ``pre_process``/``post_process``: this pipeline stage holds the embedding / the final norm and output layer.
    A vision-language ``shape`` (``shape.vision``) gets ``hf_config``'s vision tower, M-RoPE and deepstack (vlm.py)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    fam = shape.family
    fam.prepare(device)
    te = use_transformer_engine(device)
    core = (fam.core_attention(shape) or SDPACoreAttention) if core_attention == "sdpa" else None
    if fam.build_model is not None:         # a family with its own model (Nemotron-H: megatron-core's MambaModel;
        #                                     DeepSeek-V4: its hyper-connection decoder)
        if core is None:
            from megatron.core.transformer.dot_product_attention import DotProductAttention as core
        return fam.build_model(shape, config, padded_vocab=padded_vocab, device=device, core_attention=core,
                               pre_process=pre_process, post_process=post_process)
    own = fam.local_spec(shape, core)          # the family's own layer spec (local blocks, on every device)
    if fam.block_spec is not None:  # the family's own per-layer block spec (e.g. Qwen3-Next's hybrid layers)
        spec = own = fam.block_spec(config, shape, core)
    elif own is not None:
        spec = own
    elif shape.num_experts:         # MoE or dense MLP per layer (moe.py)
        from miles.trainer.megatron.moe import decoder_block_spec

        spec = decoder_block_spec(config, shape, te=te, core_attention=core)
    elif te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_layernorm,
                                                          multi_latent_attention=shape.mla)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_layernorm, normalization="RMSNorm",
                                        multi_latent_attention=shape.mla)
        if core is not None:
            spec.submodules.self_attention.submodules.core_attention = core
    if not te and own is None:
        fam.adapt_local_spec(spec)  # the family's blocks in the local spec
    fam.adapt_spec(spec, shape, te)     # ... and on either spec (DSA's core attention)

    class HiddenGPTModel(GPTModel):
        """GPTModel whose forward returns the final-norm hidden states [s, b, h] (no output layer); with MTP
        training and ``labels`` given, the MTP block runs and its loss is attached to them (``mtp.attach_loss``)."""

        mtp_training = False
        mtp_loss_value = None
        _mrope_freqs = None            # a VLM forward's M-RoPE angles [s, b, 1, dim] (vlm.forward)

        def _preprocess(self, *args, **kwargs):
            out = super()._preprocess(*args, **kwargs)
            if self._mrope_freqs is None:
                return out
            return (out[0], self._mrope_freqs, *out[2:])

        def _postprocess(self, hidden_states, input_ids=None, position_ids=None, labels=None, rotary_pos_emb=None,
                         rotary_pos_cos=None, rotary_pos_sin=None, mtp_in_postprocess=None, loss_mask=None,
                         decoder_input=None, attention_mask=None, **kwargs):
            if not (mtp_in_postprocess and self.mtp_training and labels is not None):
                return hidden_states
            run = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                       rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin)
            return mtp.attach_loss(self, hidden_states, run, labels, loss_mask, shape.vocab_size)

    mtp_spec = None
    with _sequence_parallel_norms(config, spec) as spec:
        if shape.mtp_num_layers and post_process:     # the last pipeline stage holds the block (mtp.py)
            mtp_spec = mtp.block_spec(config, spec, te=use_transformer_engine(device))
        if mtp_spec is not None:
            from megatron.core.transformer import transformer_block
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            if fam.adapt_mtp_spec is not None:       # the family's MTP layer (e.g. its norms)
                mtp_spec = fam.adapt_mtp_spec(mtp_spec)
            if transformer_block.LayerNormImpl is SequenceParallelNorm:     # its norms as the decoder's
                mtp_spec = _swap_norms(mtp_spec, WrappedTorchNorm, SequenceParallelNorm, set())
        model = HiddenGPTModel(config, spec, mtp_block_spec=mtp_spec, vocab_size=padded_vocab,
                               max_sequence_length=shape.max_position_embeddings, position_embedding_type="rope",
                               rotary_base=int(shape.rotary_base), rotary_percent=shape.rotary_percent,
                               share_embeddings_and_output_weights=shape.tie_embeddings, parallel_output=True,
                               pre_process=pre_process, post_process=post_process)
    fam.after_build(model, shape)
    if shape.mtp_num_layers:
        model.mtp_training = mtp_training
        if not mtp_training:
            mtp.freeze(model)
    if shape.vision:
        from miles.trainer.megatron import vlm

        if hf_config is None:
            raise ValueError("build_gpt_model: a vision-language shape needs its hf_config (the vision tower's)")
        vlm.attach_vision(model, hf_config, sequence_parallel=bool(config.sequence_parallel))
    return model.to(device)


def output_weight(model) -> torch.Tensor:
    """This rank's vocabulary shard of the output projection [V/tp, h] (the embedding when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
