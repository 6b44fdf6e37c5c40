"""The DeepSeek-V4 family (config.json ``model_type: deepseek_v4``) on the Megatron backend: shape, router, names.

    FAMILY                                  # its hooks (families/__init__.py): shape, config, own model, names
    fields = shape_fields(hf_config)        # ModelShape's fields (``variant``: Dsv4Shape); ValueError: not built
    model = dsv4_model.build_dsv4_model(shape, config, padded_vocab=V, device=dev)   # via model.build_gpt_model

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
    its place in MoELayer); the MoELayer, dispatchers, experts and shared expert are megatron-core's. Routing replay
    (R3 / R2): ``Dsv4Router.routing`` asks megatron-core's ``router_replay`` for the experts of every layer, hash
    layers included (the replayed experts replace the table's pick), the weights from the current scores.
 6. Clamped SwiGLU (``swiglu_limit``: gate <= l, |up| <= l) on routed and shared experts: megatron-core's
    ``activation_func_clamp_value`` (its MLP and expert MLPs both clamp), as transformers 5.24 (the parity
    reference) clamps both. The shared-expert clamp question: Miles passes ``--no-activation-func-clamp-shared-expert``
    (its Megatron fork's flag: the shared expert unclamped), as SGLang's V4 serves it; with that flag the trainer's
    shared experts and the embedded engine's are unclamped (``fork_flags.py``).
 7. Norm weights, sinks, compressor position biases and the mHC parameters are fp32 in transformers
    (``_keep_in_fp32_modules_strict``); ours compute the same in fp32.
 8. MTP (``num_nextn_predict_layers``): transformers does not build it and ignores the checkpoint's ``mtp.*``; so
    does this build (``--mtp-num-layers`` is refused on V4).

Names. Read: DeepSeek's checkpoint names (``embed.weight``, ``layers.L.attn.wq_a.weight``, per-expert
``layers.L.ffn.experts.E.w1/w2/w3``, ``hc_head_fn``, ``head.weight``, with or without ``model.``: transformers'
``save_pretrained`` writes that spelling) or transformers' own module names (fused experts
``mlp.experts.gate_up_proj`` [E, 2I, H] = [w1; w3] per expert, ``down_proj`` [E, H, I]). ``megatron_to_hf`` gives
transformers' module names (LoRA's PEFT adapters name those modules); the exported stream (weight sync,
``--save-hf``: ``export_stream``) DeepSeek's checkpoint names without ``model.``, experts one by one: the names of
V4's checkpoints, which SGLang and the embedded engine load and the FSDP backend exports (transformers' load-time
conversion reverted, ``miles.weight_sync.hf_layout``), so ``--save-hf`` holds a DeepSeek-named checkpoint's key set.
The trainer then spells each name as ``--hf-checkpoint`` does (``hf_layout.checkpoint_spelling``: a ``save_pretrained``
directory's ``model.layers.L.attn.*`` kept); a checkpoint holding transformers' fused experts gets its experts back
one by one (transformers loads either).
megatron names: ``decoder.layers.L.self_attention.<DeepSeek's attn name>``, ``hc_attn.fn`` ..., megatron-core's
``mlp.router``/``mlp.experts``/``mlp.shared_experts`` (fc1 = [w1; w3]).

Flags: Miles's V4 scripts spell the model out in its Megatron fork's arguments (``--experimental-attention-variant
dsv4``, ``--dsv4-*``, ``--dsa-indexer-*``, ``--activation-func-clamp-value``, and the MLA / YaRN flags read as that fork
reads them for V4): ``fork_flags`` lists config.json's value of each, ``fork_flags.py`` checks them.

Refused (one line each, ``check_static``): pipeline and context parallelism, a TP size not dividing ``o_groups``, MTP
layers, transformer-engine's layer spec (the attention is ours; megatron-core's experts may still be TE's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from miles.config.base import ConfigError
from miles.trainer.megatron.families import Family

MODEL_TYPES = {"deepseek_v4": "DeepSeek-V4"}
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
    return getattr(c, "model_type", None) in MODEL_TYPES


def shape_fields(c) -> dict:
    """``ModelShape``'s fields of a deepseek_v4 config.json, ``variant`` holding V4's own (``Dsv4Shape``) (ValueError, one line,
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
    # num_query_groups = heads: megatron-core's config sees multi-head attention (its TP checks); V4's one KV head is
    # replicated on every TP rank by our attention
    return dict(
        model_type=c.model_type, num_layers=n, hidden_size=int(c.hidden_size), ffn_hidden_size=inter,
        num_attention_heads=heads, num_query_groups=heads, kv_channels=head_dim, vocab_size=int(c.vocab_size),
        max_position_embeddings=int(c.max_position_embeddings),
        rotary_base=float(c.rope_parameters["main"]["rope_theta"]), norm_epsilon=float(c.rms_norm_eps),
        qk_layernorm=False, qkv_bias=False, tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        num_experts=experts, moe_ffn_hidden_size=inter, moe_router_topk=int(c.num_experts_per_tok),
        moe_norm_topk_prob=True, moe_layer_pattern=(1,) * n,
        moe_shared_ffn_hidden_size=inter * int(getattr(c, "n_shared_experts", 1) or 0),
        moe_score_function="sqrtsoftplus", moe_expert_bias=True,
        moe_topk_scaling=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
        nextn_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0), variant=g)


def inv_freq(s, kind: str) -> torch.Tensor:
    """Inverse frequencies [rope_head_dim / 2] of the ``main`` rotary (``rope_theta``) or the ``compress`` one
    (``compress_rope_theta``, YaRN's ramp with megatron-core's helpers, truncated range as transformers has it)."""
    g = s.variant
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

        replays_routing = True      # routing() asks router_replay (miles.trainer.routing_replay: R3 / R2)

        def routing(self, logits: torch.Tensor, padding_mask=None):
            logits = logits.view(-1, self.config.num_moe_experts)
            indices = None
            if self.is_hash:
                if self.token_ids is None or self.token_ids.numel() != logits.shape[0]:
                    raise RuntimeError("DeepSeek-V4 hash router: token ids of this forward were not set (a bug)")
                indices = self.tid2eid[self.token_ids.to(self.tid2eid.device)]
            if self.router_replay is not None:   # routing replay: the replayed experts of every layer, hash ones too
                indices = self._replayed(logits, indices)
            return sqrtsoftplus_topk(logits, self.topk, self.config.moe_router_topk_scaling_factor or 1.0,
                                     self.expert_bias, indices)

        def _replayed(self, logits: torch.Tensor, hashed: torch.Tensor | None) -> torch.Tensor:
            """The experts ``router_replay`` gives (megatron-core's ``get_replay_topk`` protocol: the scores it
            selects on and this router's own choice, the hash table's or the top-k of the biased scores)."""
            scores = torch.nn.functional.softplus(logits).sqrt()
            if self.expert_bias is not None and hashed is None:
                scores = scores + self.expert_bias

            def own(s, k, num_groups=None, group_topk=None):
                idx = hashed if hashed is not None else torch.topk(s, k, dim=-1, sorted=False).indices
                return s.gather(1, idx), idx
            return self.router_replay.get_replay_topk(scores, self.topk, None, None, own)[1]

    _router_cls = Dsv4Router
    return Dsv4Router


# ------------------------------------------------------------------------------------------- names
# megatron suffix -> (transformers' name: what is exported, DeepSeek's checkpoint name: also read), per layer
_ATTN = {"wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "wq_b.weight": "q_b_proj.weight",
         "wkv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
         "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
         "compressor.wkv.weight": "compressor.kv_proj.weight", "compressor.wgate.weight": "compressor.gate_proj.weight",
         "compressor.ape": "compressor.position_bias", "compressor.norm.weight": "compressor.kv_norm.weight",
         "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
         "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
         "indexer.compressor.ape": "compressor.indexer.position_bias",
         "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
         "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
         "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight"}
_LAYER = {**{f"self_attention.{k}": (f"self_attn.{v}", f"attn.{'norm.weight' if k == 'kv_norm.weight' else k}")
             for k, v in _ATTN.items()},
          "input_layernorm.weight": ("input_layernorm.weight", "attn_norm.weight"),
          "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", "ffn_norm.weight"),
          **{f"hc_{x}.{k}": (f"{x}_hc.{k}", f"hc_{x}_{k}") for x in ("attn", "ffn") for k in ("fn", "base", "scale")},
          "mlp.router.weight": ("mlp.gate.weight", "ffn.gate.weight"),
          "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
          "mlp.router.tid2eid": ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
          "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight")}
_TOP = {"embedding.word_embeddings.weight": ("model.embed_tokens.weight", "embed.weight"),
        "output_layer.weight": ("lm_head.weight", "head.weight"),
        "decoder.final_layernorm.weight": ("model.norm.weight", "norm.weight"),
        **{f"hc_head.{k}": (f"model.hc_head.hc_{k}", f"hc_head_{k}") for k in ("fn", "base", "scale")}}
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
_SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
COLUMN = ("self_attention.wq_b.weight", "self_attention.wo_a.weight", "self_attention.attn_sink", _SHARED_FC1)
ROW = ("self_attention.wo_b.weight", "mlp.shared_experts.linear_fc2.weight")


def _get(hf: dict[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """The first of ``names`` (transformers' spelling, then DeepSeek's, with or without ``model.``) in ``hf``."""
    for n in names:
        for k in (n, "model." + n):
            if k in hf:
                return hf[k]
    raise KeyError(f"--hf-checkpoint has no tensor {names[-1]} (nor {names[0]}): not a DeepSeek-V4 checkpoint of "
                   "this config.json")


def _expert(suffix: str) -> tuple[int, str] | None:
    m = _EXPERT.match(suffix)
    if m is None:
        return None
    return (int(m.group(1)), m.group(2)) if m.group(1) is not None else (int(m.group(4)), m.group(3))


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], shape) -> torch.Tensor | None:
    """The full megatron tensor of ``prefix + suffix`` (``prefix`` 'model.layers.L.', or '' with a name outside the
    layers) from the checkpoint (EP-free expert index), under transformers' names (fused experts) or DeepSeek's;
    None: not a V4 name."""
    if not prefix:
        return _get(hf, _TOP[suffix]) if suffix in _TOP else None
    native = "layers." + prefix.rstrip(".").rsplit(".", 1)[1] + "."
    if suffix in _LAYER:
        mod, nat = _LAYER[suffix]
        return _get(hf, (prefix + mod, native + nat))
    if suffix == _SHARED_FC1:
        if prefix + "mlp.shared_experts.gate_proj.weight" in hf:
            return torch.cat([hf[prefix + "mlp.shared_experts.gate_proj.weight"],
                              hf[prefix + "mlp.shared_experts.up_proj.weight"]])
        return torch.cat([_get(hf, (native + "ffn.shared_experts.w1.weight",)),
                          _get(hf, (native + "ffn.shared_experts.w3.weight",))])
    if (ex := _expert(suffix)) is None:
        return None
    e, fc = ex
    fused = prefix + ("mlp.experts.gate_up_proj" if fc == "linear_fc1" else "mlp.experts.down_proj")
    if fused in hf:                                   # transformers' fused experts: [E, 2I, H] ([gate; up]), [E, H, I]
        return hf[fused][e]
    if fc == "linear_fc2":
        return _get(hf, (f"{native}ffn.experts.{e}.w2.weight",))
    return torch.cat([_get(hf, (f"{native}ffn.experts.{e}.w1.weight",)),
                      _get(hf, (f"{native}ffn.experts.{e}.w3.weight",))])


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor, shape) -> list[tuple[str, torch.Tensor]] | None:
    """transformers' module names and tensors (LoRA's PEFT adapters name these modules); an expert's under
    ``<fused name>#<expert>``. ``export_stream`` gives the weight stream DeepSeek's checkpoint names."""
    if not prefix:
        if suffix not in _TOP:
            return None
        if suffix in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[:shape.vocab_size]
        return [(_TOP[suffix][0], full)]
    if suffix in _LAYER:
        return [(prefix + _LAYER[suffix][0], full)]
    if suffix == _SHARED_FC1:
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.shared_experts.gate_proj.weight", gate), (prefix + "mlp.shared_experts.up_proj.weight",
                                                                         up)]
    if (ex := _expert(suffix)) is None:
        return None
    e, fc = ex
    return [(f"{prefix}mlp.experts.{'gate_up_proj' if fc == 'linear_fc1' else 'down_proj'}#{e}", full)]


# transformers' name -> DeepSeek's checkpoint name (what ``export_stream`` sends), outside the layers and per layer
_CKPT_TOP = dict(_TOP.values())
_CKPT_LAYER = {**dict(_LAYER.values()), "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
               "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """DeepSeek's checkpoint names and tensors of one tensor ``megatron_to_hf`` gives: ``layers.L.attn.wq_a.weight``,
    ``embed.weight``, ``hc_head_fn``, ...; an expert's ``gate_up_proj#e`` [2I, H] as ``layers.L.ffn.experts.e.w1`` /
    ``w3`` (its halves: views), ``down_proj#e`` as ``w2``."""
    if name in _CKPT_TOP:
        return [(_CKPT_TOP[name], t)]
    m = _HF_LAYER.match(name)
    if m is None:
        raise KeyError(f"DeepSeek-V4 export: no checkpoint name for {name} (a bug)")
    native, rest = f"layers.{m.group(1)}.", m.group(2)
    base, sep, e = rest.partition("#")
    if not sep:
        return [(native + _CKPT_LAYER[rest], t)]
    experts = f"{native}ffn.experts.{e}."
    if base == "mlp.experts.down_proj":
        return [(experts + "w2.weight", t)]
    w1, w3 = t.chunk(2, dim=0)
    return [(experts + "w1.weight", w1), (experts + "w3.weight", w3)]


def export_stream(buckets, shape):
    """The weight stream (weight sync, ``--save-hf``) under DeepSeek's checkpoint names, experts one by one, as
    DeepSeek-V4's checkpoints hold them, SGLang and the embedded engine load them and the FSDP backend exports them
    (``miles.weight_sync.hf_layout``: transformers' load-time conversion reverted): ``--save-hf`` writes the
    checkpoint's key set."""
    for bucket in buckets:
        yield [pair for name, t in bucket for pair in checkpoint_tensors(name, t)]


def exported_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each router's ``expert_bias`` (``ffn.gate.bias``) and each hash router's ``tid2eid`` (int64: never cast)."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith((".mlp.router.expert_bias", ".mlp.router.tid2eid"))]


# ------------------------------------------------------------------------------------------- model and flags
def config_kwargs(shape) -> dict:
    """TransformerConfig arguments: the clamped SwiGLU, the routing scale and the shared expert (megatron-core's
    router validation needs a score function it knows: ``Dsv4Router`` computes sqrtsoftplus whatever it says)."""
    if shape.variant is None or not isinstance(shape.variant, Dsv4Shape):
        return {}
    return dict(activation_func_clamp_value=shape.variant.swiglu_limit, bias_activation_fusion=False,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=False,
                moe_router_pre_softmax=False, moe_router_topk_scaling_factor=shape.moe_topk_scaling,
                moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size or None)


def build_model(shape, config, *, padded_vocab: int, device: torch.device, pre_process: bool = True,
                post_process: bool = True, **_):
    """The family's ``build_model`` hook: ``dsv4_model.HiddenDsv4Model`` (one pipeline stage only: PP is refused;
    its attention is its own, so the core attention ``model.build_gpt_model`` offers is not used)."""
    from miles.trainer.megatron.families import dsv4_model

    if not (pre_process and post_process):
        raise ValueError("DeepSeek-V4 is built whole on each rank (pipeline parallelism is refused)")

    return dsv4_model.build_dsv4_model(shape, config, padded_vocab=padded_vocab, device=device)


def check_static(o, shape) -> None:
    """What the V4 build does not run (``o``: ``options.Options``)."""
    for flag, value, bad in (("--pipeline-model-parallel-size", o.pp, o.pp > 1),
                             ("--context-parallel-size", o.cp, o.cp > 1)):
        if bad:
            raise ConfigError(f"{flag} {value} with DeepSeek-V4 is not supported by the Megatron backend (its "
                              "hyper-connection decoder is built whole on each rank); use tensor, expert and data "
                              "parallelism.")
    g = shape.variant
    if g.o_groups % o.tp:
        raise ConfigError(f"--tensor-model-parallel-size {o.tp} does not divide config.json's o_groups {g.o_groups} "
                          "(DeepSeek-V4's output projection is split over TP by head group); choose a TP size that "
                          "divides it.")
    if shape.mtp_num_layers:
        raise ConfigError(f"--mtp-num-layers {shape.mtp_num_layers} with DeepSeek-V4 is not supported (transformers "
                          "builds no V4 MTP layers to check them against); drop it.")


def compress_ratios(g: Dsv4Shape) -> tuple[int, ...]:
    """Miles's ``--dsv4-compress-ratios`` of ``layer_types``: 0 (sliding), the CSA rate or the HCA rate per layer."""
    rate = {"sliding_attention": 0, "compressed_sparse_attention": g.csa_rate,
            "heavily_compressed_attention": g.hca_rate}
    return tuple(rate[t] for t in g.layer_types)


def fork_flags(shape) -> dict:
    """The flags of Miles's Megatron fork config.json fixes (``fork_flags.check_fork_flags`` checks them): V4's own
    (radixark/miles@v0.1.0:scripts/models/deepseek-v4-flash.py), and the MLA and YaRN flags as that fork reads them
    for V4: ``--q-lora-rank`` q_lora_rank, ``--kv-lora-rank`` / ``--qk-head-dim`` / ``--v-head-dim`` the shared KV
    head's size (head_dim), ``--qk-pos-emb-head-dim`` qk_rope_head_dim, ``--qk-layernorm`` its q/kv norms, the YaRN
    flags the compressed layers' rope (``rope_parameters['compress']``; the sliding layers' is plain)."""
    g = shape.variant
    if not isinstance(g, Dsv4Shape):
        return {}
    out = {"experimental_attention_variant": ("attention", "dsv4"), "dsv4_hc_mult": ("hc_mult", g.hc_mult),
           "dsv4_hc_sinkhorn_iters": ("hc_sinkhorn_iters", g.hc_sinkhorn_iters),
           "dsv4_compress_ratios": ("layer_types / compress_rates", compress_ratios(g)),
           "dsv4_compress_rope_theta": ("compress_rope_theta", g.compress_rope_theta),
           "dsv4_o_groups": ("o_groups", g.o_groups), "dsv4_o_lora_rank": ("o_lora_rank", g.o_lora_rank),
           "dsv4_n_hash_layers": ("mlp_layer_types hash_moe layers", g.num_hash_layers),
           "dsv4_window_size": ("sliding_window", g.sliding_window),
           "dsa_indexer_n_heads": ("index_n_heads", g.index_n_heads),
           "dsa_indexer_head_dim": ("index_head_dim", g.index_head_dim),
           "dsa_indexer_topk": ("index_topk", g.index_topk),
           "activation_func_clamp_value": ("swiglu_limit", g.swiglu_limit),
           "multi_latent_attention": ("attention", True), "qk_layernorm": ("q_norm / kv_norm", True),
           "q_lora_rank": ("q_lora_rank", g.q_lora_rank), "kv_lora_rank": ("head_dim", g.head_dim),
           "qk_head_dim": ("head_dim", g.head_dim), "qk_pos_emb_head_dim": ("qk_rope_head_dim", g.rope_head_dim),
           "v_head_dim": ("head_dim", g.head_dim),
           "rope_type": ("rope_parameters compress rope_type", "yarn" if g.yarn else "rope"),
           "rotary_scaling_factor": ("rope_parameters compress factor", g.yarn[0] if g.yarn else 1.0)}
    if g.yarn:
        out.update(original_max_position_embeddings=("rope_parameters compress original_max_position_embeddings",
                                                     g.yarn[1]),
                   beta_fast=("rope_parameters compress beta_fast", g.yarn[2]),
                   beta_slow=("rope_parameters compress beta_slow", g.yarn[3]))
    return out


def check_flags(m, shape) -> None:
    """What ``fork_flags`` does not cover: YaRN's mscale, which V4's compressed rope does not have."""
    if m is None or not isinstance(shape.variant, Dsv4Shape):
        return
    for name, v in (("--mscale", m.mscale), ("--mscale-all-dim", m.mscale_all_dim)):
        if v is not None:
            raise ConfigError(f"{name} {v:g} is given but DeepSeek-V4's compressed rope has no mscale (config.json's "
                              "rope_parameters compress attention_factor is 1): drop the flag.")


FAMILY = Family(
    name="deepseek_v4", model_types=MODEL_TYPES, shape_fields=shape_fields, config_kwargs=config_kwargs,
    build_model=build_model, hf_to_megatron=hf_to_megatron, megatron_to_hf=megatron_to_hf, hooks_name_top=True,
    column=COLUMN, row=ROW,
    glu_fc1=(_SHARED_FC1,), exported_buffers=exported_buffers, export_stream=export_stream, check_flags=check_flags,
    check_static=check_static, fork_flags=fork_flags)
