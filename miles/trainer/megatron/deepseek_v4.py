"""The DeepSeek-V4 family (config.json ``model_type: deepseek_v4``) on the Megatron backend: shape, router, names.

    fields = shape_fields(hf_config)        # ModelShape's fields (+ ``dsv4``: Dsv4Shape); ValueError: not built
    model = deepseek_v4_model.build_dsv4_model(shape, config, padded_vocab=V, device=dev)
    load_hf_into(model, hf_state_dict, shape, padded_vocab, tp_rank, tp, ep_rank, ep)
    hf = export_hf(model, shape, groups)    # every tensor under DeepSeek's checkpoint names, full size

Design note: what V4 is, against DeepSeek-V3 (``mla.py``, ``yarn.py``, ``moe.py``), what megatron-core 0.16.1 has
for it, and what is ours (the reference is transformers 5.24's ``models/deepseek_v4``; Miles v0.1.0 trains it with a
patched Megatron-LM and ``--spec miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec``,
radixark/miles@v0.1.0:miles_plugins/models/deepseek_v4/):

 1. Residual: manifold-constrained hyper-connections (mHC). ``hc_mult`` streams [s, b, n, h] instead of one; each
    layer mixes them in and out twice (``hc_attn_*``, ``hc_ffn_*``: a projection of the normalised streams gives
    pre/post weights and a comb matrix projected to doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn steps);
    ``hc_head_*`` collapses them before the final norm. megatron-core: none (its TransformerBlock has one residual)
    -> ours (``deepseek_v4_model.HyperConnection``/``HyperHead``), so the block and layer are ours too.
 2. Attention: not V3's MLA. One shared KV head (K = V, ``head_dim`` 512: ``wkv`` + ``kv_norm``), q LoRA (``wq_a``,
    ``q_norm``, ``wq_b``) plus a weightless per-head RMS norm of q, RoPE on the trailing ``qk_rope_head_dim``
    channels, interleaved pairs (not V3's halves), undone on the output's rope slice; learnable per-head sinks
    (``attn_sink``, gpt-oss style); a sliding window (``sliding_window`` keys, the query's own included) on every
    layer; the grouped low-rank output projection (``wo_a`` block-diagonal over ``o_groups``, then ``wo_b``).
    megatron-core's MLA (separate K/V up-projections) and its core attentions (no sinks with MLA, no compressed
    entries) do not fit -> ours (``Dsv4Attention``), with megatron-core's sequence-parallel mappings.
 3. Compressed attention, by ``layer_types`` (Miles: ``--dsv4-compress-ratios 0 0 4 128``): ``sliding_attention``;
    ``heavily_compressed_attention`` (HCA: one softmax-gated, normalised, rotated entry per ``compress_rates`` window
    of 128 tokens, visible to the queries past its window); ``compressed_sparse_attention`` (CSA: overlapping windows
    of 2 x 4 tokens, and a lightning indexer, a smaller compressor of its own plus ``index_n_heads`` ReLU-scored
    queries, keeping the top ``index_topk`` entries per query). megatron-core's ``experimental_attention_variant/
    dsa.py`` is V3.2's indexer (raw tokens, a LayerNorm'd key, a Hadamard transform), not V4's compressed windows ->
    ours (``Compressor``, ``Indexer``), torch on CPU and GPU (Miles uses tilelang kernels: GPU-only, not here).
 4. Two rotary bases: ``rope_theta`` on sliding layers, ``compress_rope_theta`` with YaRN (``rope_parameters``'
    ``compress``; cos/sin unscaled, ``attention_factor`` 1) on compressed layers, their compressors and indexer.
    V3's yarn.py scales cos/sin and rotates halves -> the inverse frequencies are computed here (``inv_freq``).
 5. MoE on every layer: routing by ``scoring_func`` sqrtsoftplus (``sqrt(softplus(logits))``), top-k over the scores
    plus ``e_score_correction_bias`` (DeepSeek: ``ffn.gate.bias``), weights gathered from the scores, always
    renormalised, times ``routed_scaling_factor``; the first ``mlp_layer_types == hash_moe`` layers (Miles:
    ``--dsv4-n-hash-layers``) pick experts from a frozen token-id table ``tid2eid`` [vocab, k]. megatron-core's
    TopKRouter has softmax and sigmoid only, no hash routing -> ``Dsv4Router`` (a TopKRouter: its gating linear,
    its place in MoELayer); the MoELayer, dispatchers, experts and shared expert are megatron-core's.
 6. Clamped SwiGLU (``swiglu_limit``: gate <= l, |up| <= l) on routed and shared experts: megatron-core's
    ``activation_func_clamp_value`` (its MLP and expert MLPs both clamp). Miles passes
    ``--no-activation-func-clamp-shared-expert`` (its Megatron fork's flag); transformers 5.24 clamps the shared
    expert, and transformers is the parity reference here.
 7. Norm weights, sinks, compressor position biases and the mHC parameters are fp32 in transformers
    (``_keep_in_fp32_modules_strict``); ours compute the same in fp32.
 8. MTP (``num_nextn_predict_layers``): transformers does not build it and ignores the checkpoint's ``mtp.*``; so
    does this build (``--mtp-num-layers`` is refused on V4).

Checkpoint names: DeepSeek's own (``embed.weight``, ``layers.L.attn.wq_a.weight``, ``layers.L.ffn.experts.E.w1``,
``hc_head_fn``, ``head.weight``, ...), or transformers' ``save_pretrained`` spelling of them (``model.`` before the
layers, ``model.embed_tokens``, ``model.hc_head.hc_fn``): both read, DeepSeek's written (``native_name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FAMILIES = {"deepseek_v4": "DeepSeek-V4"}
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@dataclass(frozen=True)
class Dsv4Shape:
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    num_hash_layers: int
    csa_rate: int
    hca_rate: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    swiglu_limit: float
    compress_rope_theta: float
    yarn: tuple[float, ...] = ()     # compressed layers' YaRN: (factor, original max positions, beta_fast, beta_slow)


def is_dsv4_config(c) -> bool:
    return getattr(c, "model_type", None) in FAMILIES


def shape_fields(c) -> dict:
    """``ModelShape``'s fields of a deepseek_v4 config.json, ``dsv4`` holding V4's own (ValueError, one line,
    naming what is not built)."""
    if getattr(c, "quantization_config", None):
        raise ValueError("config.json has quantization_config: the Megatron backend loads bf16/fp32 DeepSeek-V4 "
                         "weights; dequantize the FP8/FP4 checkpoint first.")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"DeepSeek-V4 hidden_act {c.hidden_act!r} is not supported (silu).")
    if getattr(c, "scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ValueError(f"DeepSeek-V4 scoring_func {c.scoring_func!r} is not supported (sqrtsoftplus, V4's).")
    if int(getattr(c, "num_key_value_heads", 1) or 1) != 1:
        raise ValueError(f"DeepSeek-V4 num_key_value_heads {c.num_key_value_heads} is not supported (1: shared KV).")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("DeepSeek-V4 with attention_bias / mlp_bias is not supported (V4 has none).")
    n = int(c.num_hidden_layers)
    types = tuple(c.layer_types[:n])
    mlp = tuple(c.mlp_layer_types[:n])
    hashes = sum(1 for t in mlp if t == "hash_moe")
    if mlp != ("hash_moe",) * hashes + ("moe",) * (n - hashes):
        raise ValueError(f"DeepSeek-V4 mlp_layer_types {list(mlp)}: hash_moe layers first, then moe.")
    rope = c.rope_parameters["compress"]
    kind = rope.get("rope_type", "default")
    yarn: tuple[float, ...] = ()
    if kind == "yarn":
        if float(rope.get("attention_factor", 1.0)) != 1.0 or rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ValueError("DeepSeek-V4 compress rope with attention_factor / mscale is not supported (V4's is 1).")
        yarn = (float(rope["factor"]), float(rope["original_max_position_embeddings"]),
                float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0))
    elif kind != "default":
        raise ValueError(f"DeepSeek-V4 compress rope_type {kind!r} is not supported (yarn or default).")
    if c.rope_parameters["main"].get("rope_type", "default") != "default":
        raise ValueError("DeepSeek-V4 main rope with scaling is not supported (V4's is plain RoPE).")
    heads, head_dim, rates = int(c.num_attention_heads), int(c.head_dim), c.compress_rates
    experts, inter = int(c.n_routed_experts), int(c.moe_intermediate_size)
    g = Dsv4Shape(head_dim=head_dim, rope_head_dim=int(c.qk_rope_head_dim), q_lora_rank=int(c.q_lora_rank),
                  o_groups=int(c.o_groups), o_lora_rank=int(c.o_lora_rank), layer_types=types, num_hash_layers=hashes,
                  csa_rate=int(rates["compressed_sparse_attention"]), hca_rate=int(rates["heavily_compressed_attention"]),
                  hc_mult=int(c.hc_mult), hc_sinkhorn_iters=int(c.hc_sinkhorn_iters), hc_eps=float(c.hc_eps),
                  sliding_window=int(c.sliding_window), index_n_heads=int(c.index_n_heads),
                  index_head_dim=int(c.index_head_dim), index_topk=int(c.index_topk),
                  swiglu_limit=float(c.swiglu_limit), compress_rope_theta=float(rope["rope_theta"]), yarn=yarn)
    return dict(
        model_type=c.model_type, num_layers=n, hidden_size=int(c.hidden_size), ffn_hidden_size=inter,
        num_attention_heads=heads, num_query_groups=1, kv_channels=head_dim, vocab_size=int(c.vocab_size),
        max_position_embeddings=int(c.max_position_embeddings),
        rotary_base=float(c.rope_parameters["main"]["rope_theta"]), norm_epsilon=float(c.rms_norm_eps),
        qk_layernorm=False, qkv_bias=False, tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        num_experts=experts, moe_ffn_hidden_size=inter, moe_router_topk=int(c.num_experts_per_tok),
        moe_norm_topk_prob=True, moe_layer_pattern=(1,) * n,
        moe_shared_ffn_hidden_size=inter * int(getattr(c, "n_shared_experts", 1) or 0),
        moe_score_function="sqrtsoftplus", moe_expert_bias=True,
        moe_topk_scaling=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
        nextn_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0), dsv4=g)


def inv_freq(s, kind: str) -> torch.Tensor:
    """Inverse frequencies [rope_head_dim / 2] of the ``main`` rotary (``rope_theta``) or the ``compress`` one
    (``compress_rope_theta``, YaRN's ramp with megatron-core's helpers, truncated range as transformers has it)."""
    g = s.dsv4
    dim = g.rope_head_dim
    base = s.rotary_base if kind == "main" else g.compress_rope_theta
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if kind == "main" or not g.yarn:
        return extra
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_linear_ramp_mask,
    )

    factor, original, fast, slow = g.yarn
    low, high = _yarn_find_correction_range(fast, slow, dim, base, int(original), True)
    mask = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device=None).to(torch.float32)
    return (extra / factor) * (1 - mask) + extra * mask


# ------------------------------------------------------------------------------------------- router
def sqrtsoftplus_topk(logits: torch.Tensor, topk: int, scaling: float, expert_bias: torch.Tensor | None = None,
                      indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's routing of logits [tokens, E]: scores ``sqrt(softplus(logits))``; experts = top-k of scores +
    ``expert_bias`` (or the given ``indices`` [tokens, k]: hash routing); weights = their scores renormalised, times
    ``scaling``. Returns megatron-core's (probs [tokens, E], routing_map [tokens, E] bool)."""
    scores = torch.nn.functional.softplus(logits).sqrt()
    if indices is None:
        biased = scores if expert_bias is None else scores + expert_bias
        indices = torch.topk(biased, topk, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling
    probs = torch.zeros_like(scores).scatter(1, indices, weights)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


_router_cls = None


def router_class():
    """megatron-core's ``TopKRouter`` with DeepSeek-V4's routing (``sqrtsoftplus_topk``): ``expert_bias`` [E] fp32
    is the checkpoint's ``e_score_correction_bias`` (frozen: no bias update, as Miles's ``--moe-router-bias-update-
    rate 0`` / ``--freeze-e-score-correction-bias``); a hash layer's ``tid2eid`` [vocab, k] picks the experts from
    ``token_ids`` (set by the layer before each forward, in the router's token order)."""
    global _router_cls
    if _router_cls is not None:
        return _router_cls
    from megatron.core.transformer.moe.router import TopKRouter

    class Dsv4Router(TopKRouter):
        token_ids = None
        is_hash = False

        def __init__(self, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            del self.expert_bias
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))

        def set_hash(self, is_hash: bool, vocab_size: int) -> None:
            self.is_hash = is_hash
            if is_hash:
                del self.expert_bias
                self.expert_bias = None
                self.register_buffer("tid2eid", torch.zeros(vocab_size, self.topk, dtype=torch.long))

        def routing(self, logits: torch.Tensor, padding_mask=None):
            logits = logits.view(-1, self.config.num_moe_experts)
            indices = None
            if self.is_hash:
                if self.token_ids is None or self.token_ids.numel() != logits.shape[0]:
                    raise RuntimeError("DeepSeek-V4 hash router: token ids of this forward were not set (a bug)")
                indices = self.tid2eid[self.token_ids.to(self.tid2eid.device)]
            return sqrtsoftplus_topk(logits, self.topk, self.config.moe_router_topk_scaling_factor or 1.0,
                                     self.expert_bias, indices)

    _router_cls = Dsv4Router
    return Dsv4Router


# ------------------------------------------------------------------------------------------- names
_ATTN = r"(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b|compressor\.(?:wkv|wgate|norm)|indexer\.(?:wq_b|weights_proj|" \
        r"compressor\.(?:wkv|wgate|norm)))\.weight|attn_sink|compressor\.ape|indexer\.compressor\.ape"
_LAYER = {  # megatron suffix (after decoder.layers.L.) -> DeepSeek suffix (after layers.L.)
    "input_layernorm.weight": "attn_norm.weight", "pre_mlp_layernorm.weight": "ffn_norm.weight",
    "hc_attn.fn": "hc_attn_fn", "hc_attn.base": "hc_attn_base", "hc_attn.scale": "hc_attn_scale",
    "hc_ffn.fn": "hc_ffn_fn", "hc_ffn.base": "hc_ffn_base", "hc_ffn.scale": "hc_ffn_scale",
    "mlp.router.weight": "ffn.gate.weight", "mlp.router.expert_bias": "ffn.gate.bias",
    "mlp.router.tid2eid": "ffn.gate.tid2eid", "self_attention.kv_norm.weight": "attn.norm.weight",
    "mlp.shared_experts.linear_fc2.weight": "ffn.shared_experts.w2.weight",
}
_TOP = {"embedding.word_embeddings.weight": "embed.weight", "output_layer.weight": "head.weight",
        "decoder.final_layernorm.weight": "norm.weight", "hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base",
        "hc_head.scale": "hc_head_scale"}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
# TP split dim of a megatron name's suffix (None: replicated); the experts are whole on each TP rank (ETP 1)
_TP_DIM = {"self_attention.wq_b.weight": 0, "self_attention.wo_a.weight": 0, "self_attention.wo_b.weight": 1,
           "self_attention.attn_sink": 0, "mlp.shared_experts.linear_fc1.weight": 0,
           "mlp.shared_experts.linear_fc2.weight": 1}


def native_name(name: str) -> str:
    """DeepSeek's checkpoint name of a name as DeepSeek or transformers' ``save_pretrained`` writes it."""
    name = name.replace("model.embed_tokens.weight", "embed.weight").replace("model.hc_head.hc_", "hc_head_")
    return name[len("model."):] if name.startswith("model.") else name


def _split(name: str) -> tuple[int | None, str]:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def megatron_to_hf(name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """DeepSeek names and tensors of a full (TP-gathered, EP-free: global expert index) megatron tensor."""
    layer, rest = _split(name)
    if layer is None:
        if rest not in _TOP:
            raise KeyError(f"DeepSeek-V4: no checkpoint name for {name}")
        return [(_TOP[rest], full)]
    p = f"layers.{layer}."
    if rest in _LAYER:
        return [(p + _LAYER[rest], full)]
    if rest.startswith("self_attention."):
        return [(p + "attn." + rest[len("self_attention."):], full)]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        w1, w3 = full.chunk(2, dim=0)
        return [(p + "ffn.shared_experts.w1.weight", w1), (p + "ffn.shared_experts.w3.weight", w3)]
    m = _EXPERT.match(rest) or _TE_EXPERT.match(rest)
    if m is None:
        raise KeyError(f"DeepSeek-V4: no checkpoint name for {name}")
    e, fc = (int(m.group(1)), m.group(2)) if m.re is _EXPERT else (int(m.group(2)), m.group(1))
    if fc == "linear_fc2":
        return [(f"{p}ffn.experts.{e}.w2.weight", full)]
    w1, w3 = full.chunk(2, dim=0)
    return [(f"{p}ffn.experts.{e}.w1.weight", w1), (f"{p}ffn.experts.{e}.w3.weight", w3)]


def hf_to_megatron(name: str, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor of ``name`` (EP-free) from the DeepSeek-named state dict ``hf``."""
    layer, rest = _split(name)
    if layer is None:
        return hf[_TOP[rest]]
    p = f"layers.{layer}."
    if rest in _LAYER:
        return hf[p + _LAYER[rest]]
    if rest.startswith("self_attention."):
        return hf[p + "attn." + rest[len("self_attention."):]]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return torch.cat([hf[p + "ffn.shared_experts.w1.weight"], hf[p + "ffn.shared_experts.w3.weight"]])
    m = _EXPERT.match(rest) or _TE_EXPERT.match(rest)
    if m is None:
        raise KeyError(f"DeepSeek-V4: no checkpoint tensor for {name}")
    e, fc = (int(m.group(1)), m.group(2)) if m.re is _EXPERT else (int(m.group(2)), m.group(1))
    if fc == "linear_fc2":
        return hf[f"{p}ffn.experts.{e}.w2.weight"]
    return torch.cat([hf[f"{p}ffn.experts.{e}.w1.weight"], hf[f"{p}ffn.experts.{e}.w3.weight"]])


def tp_dim(name: str) -> int | None:
    layer, rest = _split(name)
    if layer is None:
        return 0 if rest in ("embedding.word_embeddings.weight", "output_layer.weight") else None
    return _TP_DIM.get(rest)


def _is_glu(name: str) -> bool:
    return name.endswith("mlp.shared_experts.linear_fc1.weight")


def _shard(name: str, full: torch.Tensor, dim: int, tp: int) -> list[torch.Tensor]:
    """TP shards of a full tensor; a SwiGLU fc1 [gate; up] gives each rank [its gate rows; its up rows]."""
    if not _is_glu(name):
        return list(full.chunk(tp, dim=dim))
    gate, up = full.chunk(2, dim=0)
    return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]


def _unshard(name: str, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    if not _is_glu(name):
        return torch.cat(parts, dim=dim)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def global_name(name: str, ep_rank: int, num_local: int) -> str:
    layer, rest = _split(name)
    m = _EXPERT.match(rest)
    if m is not None:
        return f"decoder.layers.{layer}.mlp.experts.local_experts.{ep_rank * num_local + int(m.group(1))}." \
               f"{m.group(2)}.weight"
    m = _TE_EXPERT.match(rest)
    if m is not None:
        return f"decoder.layers.{layer}.mlp.experts.{m.group(1)}.weight{ep_rank * num_local + int(m.group(2))}"
    return name


def _state(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (the router's ``expert_bias``, ``tid2eid``) by megatron name."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}


@torch.no_grad()
def load_hf_into(model, hf: dict[str, torch.Tensor], padded_vocab: int, tp_rank: int, tp: int, ep_rank: int = 0,
                 ep: int = 1) -> None:
    """Copy the DeepSeek-named checkpoint ``hf`` (any of its spellings: ``native_name``) into this rank's shards."""
    hf = {native_name(k): v for k, v in hf.items()}
    num_local = model.shape.num_experts // ep
    for name, t in _state(model).items():
        full = hf_to_megatron(global_name(name, ep_rank, num_local), hf)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") and full.shape[0] < padded_vocab:
            full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])])
        dim = tp_dim(name)
        if dim is not None and tp > 1:
            full = _shard(name, full, dim, tp)[tp_rank]
        if tuple(full.shape) != tuple(t.shape):
            raise ValueError(f"DeepSeek-V4 checkpoint: {name} has shape {tuple(full.shape)}, the model "
                             f"{tuple(t.shape)} (config.json and the weights disagree)")
        t.copy_(full.to(t.dtype))


@torch.no_grad()
def export_hf(model, vocab_size: int, tp_group=None, ep_group=None) -> dict[str, torch.Tensor]:
    """Every tensor of the model, full size, under DeepSeek's checkpoint names (collective over TP and EP: every
    rank of both gets all of them)."""
    import torch.distributed as dist

    tp = tp_group.size() if tp_group is not None else 1
    ep = ep_group.size() if ep_group is not None else 1
    ep_rank = ep_group.rank() if ep_group is not None else 0
    num_local = model.shape.num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for name, t in _state(model).items():
        t = t.detach()
        dim = tp_dim(name)
        if dim is not None and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = _unshard(name, parts, dim)
        names = [global_name(name, ep_rank, num_local)]
        tensors = [t]
        if ep > 1 and (_EXPERT.match(_split(name)[1]) or _TE_EXPERT.match(_split(name)[1])):
            tensors = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(tensors, t.contiguous(), group=ep_group)
            names = [global_name(name, r, num_local) for r in range(ep)]
        for n, full in zip(names, tensors):
            if n in ("embedding.word_embeddings.weight", "output_layer.weight"):
                full = full[:vocab_size]
            out.update((k, v.clone()) for k, v in megatron_to_hf(n, full))
    return out
