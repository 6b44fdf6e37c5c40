"""DeepSeek sparse attention (DSA) families on megatron-core: DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 / 5.1 / 5.2
(``glm_moe_dsa``), which are DeepSeek-V3's multi-latent attention and MoE (``mla.py``) plus a lightning indexer.

    fields = dsa_fields(hf_config)           # DsaShape (ModelShape.variant): indexer heads, dim, top-k, rope, sharing
    kw = config_kwargs(dsa)                  # TransformerConfig: experimental_attention_variant "dsa", dsa_indexer_*
    adapt_spec(spec, dsa)                    # each MLA layer's core attention: megatron-core's DSAttention
    FAMILY                                   # the registry's hooks (families/__init__.py): mla.py's, plus the above

Model: megatron-core's own blocks (``transformer/experimental_attention_variant/dsa.py``): ``DSAttention`` is the MLA
layer's core attention; its ``DSAIndexer`` scores every key for each query from the hidden states and the q latent
(``relu(q_h . k) * w_h`` summed over the indexer heads, ``w`` = ``weights_proj(x) / sqrt(heads * head_dim)``; the
keys from ``wk`` and a LayerNorm ``k_norm``; rope on the last ``qk_rope_head_dim`` dims of q and k) and keeps the
``index_topk`` best (causal); ``unfused_dsa_fn`` attends over those keys only. What is ours, where megatron-core
has none that runs here:

- ``rotate_activation``: megatron-core rotates q and k of the indexer by a Hadamard transform with the
  ``fast_hadamard_transform`` kernel (CUDA, bf16 only); ``hadamard_rotate`` is the same transform in torch (the
  Sylvester matrix over ``sqrt(dim)``, for a power-of-two ``index_head_dim``) for CPU and fp32, and the kernel runs
  where it imports and the tensor is a CUDA bf16 one. The transform is orthogonal, so the scores are transformers'
  (which leaves it out) up to rounding.
- Linear layers of the indexer: megatron-core's local spec has none (``LocalSpecProvider`` has no ``linear``):
  ``IndexerLinear`` (a replicated ``torch.nn.Linear``), ``IndexerKNorm`` (``torch.nn.LayerNorm`` with transformers'
  and DeepSeek's fixed eps 1e-6, where megatron-core would pass ``layernorm_epsilon``: GLM-5's rms_norm_eps is 1e-5).
- GLM-5.2's shared top-k layers (config.json ``indexer_types`` "shared", transformers' ``prev_topk_indices``):
  megatron-core has no cross-layer sharing. A full layer records its top-k in a holder of its model
  (``TopkHolder``); a shared layer (``SharedTopkAttention``, no indexer weights, as the checkpoint has none) attends
  over the top-k of the most recent full layer.
- Pipeline parallelism: a stage's block spec holds its own layers only, so one core-attention spec serves every layer
  and ``LayerCoreAttention`` picks full or shared when megatron-core builds the layer, from the model-wide layer
  number it passes (the stage's offset included). A shared layer needs its source layer on its own stage
  (``check_static`` refuses a split that starts a stage with a shared layer, and activation recompute with shared
  layers under PP, where 1F1B runs a later micro-batch's forward before this one's backward).

- Context parallelism: megatron-core's ``DSAttention`` has none (its config refuses CP with DSA; the family sets the
  CP size after that check: ``Family.own_context_parallel``). Each CP rank holds Megatron's load-balanced chunks of
  every row (``context_parallel.py``); megatron-core's rotary embeddings (MLA's and the indexer's) give the chunks'
  angles. ``cp_indexer_topk`` is the indexer's forward with its keys all-gathered over the CP group (in sequence
  order, ``context_parallel.gather_sequence``): this rank's queries score every key of the row, causal by position
  in the row, and keep ``min(index_topk, s)`` as positions in the row; ``cp_sparse_attention`` is ``unfused_dsa_fn``
  over the all-gathered keys and values (backward: their gradients reduce-scattered) with that causal mask. The same
  under every ``--cp-comm-type``, and Miles's ``--allgather-cp`` (its sequential layout) gives the same values.
  It gathers the per-head keys and values after the up projections (Miles gathers the compressed latent and the
  rope key, less traffic for many heads per TP rank); the scores are [b, heads, s / cp, s] per rank.

The indexer is not trained: transformers runs it under ``no_grad`` and Miles's GLM-5 attention discards its scores
(radixark/miles@v0.1.0:miles_plugins/models/glm5/glm5.py); megatron-core detaches its inputs and would train it
only through its KL loss (``dsa_indexer_loss_coeff``, 0 here), so its parameters are frozen (``freeze_indexer``) and
megatron-core's loss is not computed (``DSACoreAttention``). Both backends therefore leave the indexer's weights as
the checkpoint has them (no weight decay either).

Indexer rope layouts (weights permuted on load and back on export, exactly): megatron-core's indexer head is
``[nope; rope]`` and rotates the rope dims de-interleaved (it is an MLA config). transformers' is ``[rope; nope]``;
GLM-5 rotates interleaved (``apply_rotary_pos_emb_interleave``) and DeepSeek-V3.2 half-split
(``apply_rotary_pos_emb``). So the rows of ``wq_b`` (per indexer head), ``wk`` and ``k_norm``'s weight and bias are
permuted to ``[nope; rope]`` and, for DeepSeek-V3.2, the rope dims interleaved (``[r0, r_{d/2}, r1, ...]``), whose
de-interleave is the half-split order. A dot product is unchanged by a permutation of both of its sides, and
LayerNorm's mean and variance by any permutation.

Weights (HF ``model.layers.L.self_attn.indexer.``; megatron ``decoder.layers.L.self_attention.core_attention.
indexer.``, every one replicated over TP): ``wq_b`` = ``linear_wq_b``, ``wk`` = ``linear_wk``, ``k_norm`` =
``k_norm`` (weight, bias), ``weights_proj`` = ``linear_weights_proj``. The rest is ``mla.py``'s.

Cost: megatron-core's DSA is unfused: ``unfused_dsa_fn`` materialises the [b, heads, s, s] fp32 scores of each
layer, and the indexer the [s, b, index_heads, s] ones (Miles runs tilelang kernels instead). That is fine at the
sequence lengths of a test; at GLM-5's 16k tokens per GPU it is not.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from miles.config.base import ConfigError
from miles.trainer.megatron.families import Family, mla

FAMILIES = {"deepseek_v32": "DeepSeek-V3.2", "glm_moe_dsa": "GLM-5 / 5.1 / 5.2"}
INDEXER_PREFIX = "self_attention.core_attention.indexer."
_NAMES = {  # megatron suffix (after INDEXER_PREFIX) -> HF suffix (after self_attn.indexer.)
    "linear_wq_b.weight": "wq_b.weight",
    "linear_wk.weight": "wk.weight",
    "k_norm.weight": "k_norm.weight",
    "k_norm.bias": "k_norm.bias",
    "linear_weights_proj.weight": "weights_proj.weight",
}
K_NORM_EPS = 1e-6      # transformers' DeepseekV32Indexer / GLM-5's k_norm, DeepSeek's reference and Miles's (fixed)


@dataclass(frozen=True)
class DsaShape:
    """The indexer's shape, from config.json."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_dim: int                        # qk_rope_head_dim: the indexer's rotated dims
    rope_interleaved: bool               # GLM-5 true (interleaved), DeepSeek-V3.2 false (half-split)
    full_layers: tuple[bool, ...]        # per layer: runs its own indexer (False: GLM-5.2's shared top-k)


def is_dsa_config(c) -> bool:
    return getattr(c, "model_type", None) in FAMILIES


def dsa_fields(c) -> DsaShape:
    """The indexer of a DSA config (ValueError for what is not built)."""
    mt = c.model_type
    heads, dim, topk = int(c.index_n_heads), int(c.index_head_dim), int(c.index_topk)
    rope = int(c.qk_rope_head_dim)
    if not getattr(c, "q_lora_rank", None):
        raise ValueError(f"{mt}: q_lora_rank is not set; the DSA indexer reads the q latent (q_lora_rank).")
    if dim & (dim - 1) or dim <= rope:
        raise ValueError(f"{mt}: index_head_dim {dim} must be a power of two (the indexer's Hadamard transform) "
                         f"larger than qk_rope_head_dim {rope}.")
    if heads < 1 or topk < 1:
        raise ValueError(f"{mt}: index_n_heads {heads} and index_topk {topk} must be positive.")
    n = int(c.num_hidden_layers)
    types = list(getattr(c, "indexer_types", None) or ["full"] * n)[:n]
    if any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ValueError(f"{mt}: indexer_types {types} must be 'full' or 'shared' per layer, the first 'full'.")
    return DsaShape(index_n_heads=heads, index_head_dim=dim, index_topk=topk, rope_dim=rope,
                    rope_interleaved=mt == "glm_moe_dsa", full_layers=tuple(t == "full" for t in types))


def config_kwargs(dsa: DsaShape) -> dict:
    """``TransformerConfig`` arguments of megatron-core's DSA (its KL indexer loss off: the indexer is frozen)."""
    return {"experimental_attention_variant": "dsa", "dsa_indexer_n_heads": dsa.index_n_heads,
            "dsa_indexer_head_dim": dsa.index_head_dim, "dsa_indexer_topk": dsa.index_topk,
            "dsa_indexer_loss_coeff": 0.0, "dsa_indexer_use_sparse_loss": False}


# ------------------------------------------------------------------------------------------- Hadamard
@functools.lru_cache(maxsize=8)
def _hadamard(dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim ** 0.5).to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` times the normalised Sylvester-Hadamard matrix over its last dim (a power of two): what
    ``fast_hadamard_transform.hadamard_transform(x, scale=dim ** -0.5)`` computes, in torch (any device, dtype)."""
    dim = x.shape[-1]
    if dim & (dim - 1):
        raise ValueError(f"hadamard_rotate: last dim {dim} is not a power of two")
    return x @ _hadamard(dim, x.dtype, str(x.device))       # symmetric: H.T == H


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``rotate_activation``: the kernel for a CUDA bf16 tensor where ``fast_hadamard_transform``
    imports, else ``hadamard_rotate``."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        try:
            from fast_hadamard_transform import hadamard_transform
        except ImportError:
            hadamard_transform = None
        if hadamard_transform is not None:
            return hadamard_transform(x, scale=x.shape[-1] ** -0.5)
    return hadamard_rotate(x)


def apply_compat() -> None:
    """megatron-core's indexer calls its module's ``rotate_activation`` (CUDA bf16 kernel only): ours. Idempotent."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    dsa.rotate_activation = rotate_activation


# ------------------------------------------------------------------------------------------- context parallelism
def _cp_positions(local: int, group, device: torch.device) -> tuple[torch.Tensor, int]:
    """The sequence positions [2c] of this CP rank's chunks (``context_parallel.chunk_columns``) and the length."""
    from miles.trainer.megatron.context_parallel import chunk_columns

    total = local * group.size()
    return chunk_columns(total, group.rank(), group.size(), device), total


def _future(q_pos: torch.Tensor, total: int) -> torch.Tensor:
    """[2c, s] true where the key comes after the query (the causal mask by global position)."""
    return torch.arange(total, device=q_pos.device).unsqueeze(0) > q_pos.unsqueeze(1)


def cp_indexer_topk(indexer, x: torch.Tensor, qr: torch.Tensor, group) -> torch.Tensor:
    """megatron-core's ``DSAIndexer.forward_with_scores`` under context parallelism: this rank's queries (its two
    chunks; x [2c, b, hidden], qr [2c, b, q_lora_rank], detached) score the keys of the whole sequence (the
    indexer keys all-gathered), causal by global position; -> [b, 2c, min(topk, s)] key positions in the sequence.
    The rotary angles are the rank's chunks' (megatron-core's rotary embedding selects them for its CP group)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from miles.trainer.megatron.context_parallel import gather_sequence

    cfg = indexer.config
    rope_len = indexer.rotary_pos_emb.get_rotary_seq_len(None, None, x, cfg, None)
    if cfg.rope_type == "rope":
        emb, mscale = indexer.rotary_pos_emb(rope_len, packed_seq=False), 1.0
    else:
        emb, mscale = indexer.rotary_pos_emb(rope_len, packed_seq=False)
    if cfg.sequence_parallel and indexer.pg_collection.tp.size() > 1:
        x = gather_from_sequence_parallel_region(x, group=indexer.pg_collection.tp)
        qr = gather_from_sequence_parallel_region(qr, group=indexer.pg_collection.tp)
    sq, b, _ = x.shape
    heads, dim = indexer.index_n_heads, indexer.index_head_dim
    q = indexer._apply_rope(indexer.linear_wq_b(qr)[0].reshape(sq, b, heads, dim), emb, mscale)
    k = indexer._apply_rope(indexer.k_norm(indexer.linear_wk(x)[0]).reshape(sq, b, 1, dim), emb, mscale)
    q, k = rotate_activation(q), rotate_activation(k.reshape(sq, b, dim))
    weights = indexer.linear_weights_proj(x)[0] * heads ** -0.5 * indexer.softmax_scale
    q_pos, total = _cp_positions(sq, group, x.device)
    scores = indexer._compute_index_scores(q, weights, gather_sequence(k, group))          # [b, 2c, s]
    scores = scores.masked_fill(_future(q_pos, total), float("-inf"))
    return scores.topk(min(indexer.index_topk, total), dim=-1)[1]


def cp_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, topk: torch.Tensor,
                        scale: float, group) -> torch.Tensor:
    """megatron-core's ``unfused_dsa_fn`` under context parallelism: this rank's queries [2c, b, np, hn] attend over
    their ``topk`` [b, 2c, k] (key positions in the sequence) of the keys and values all-gathered over the CP group
    (key [2c, b, np, hn], value [2c, b, np, hnv]; backward: their gradients reduce-scattered), causal by global
    position; the same fp32 scores and softmax -> [2c, b, np * hnv]."""
    from miles.trainer.megatron.context_parallel import gather_sequence

    sq, b, heads, hn = query.shape
    key, value = gather_sequence(key, group), gather_sequence(value, group)
    skv, hnv = key.shape[0], value.shape[3]
    q_pos, _ = _cp_positions(sq, group, query.device)
    scores = torch.bmm(query.permute(1, 2, 0, 3).reshape(b * heads, sq, hn).float(),
                       key.permute(1, 2, 3, 0).reshape(b * heads, hn, skv).float()) * scale
    mask = torch.full((b, sq, skv), float("-inf"), device=query.device).scatter_(-1, topk, 0)
    mask = mask.masked_fill(_future(q_pos, skv), float("-inf"))
    probs = torch.softmax(scores.view(b, heads, sq, skv) + mask.unsqueeze(1), dim=-1, dtype=torch.float32)
    out = torch.bmm(probs.view(b * heads, sq, skv).to(value.dtype),
                    value.permute(1, 2, 0, 3).reshape(b * heads, skv, hnv))
    return out.view(b, heads, sq, hnv).permute(2, 0, 1, 3).reshape(sq, b, heads * hnv)


def _cp_group(config, pg_collection):
    """The CP group of a core attention (None without context parallelism)."""
    if config.context_parallel_size <= 1:
        return None
    if pg_collection is None or getattr(pg_collection, "cp", None) is None:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()
    return pg_collection.cp


def _check_cp_inputs(attention_mask, packed_seq_params) -> None:
    if attention_mask is not None or packed_seq_params is not None:
        raise NotImplementedError("DSA under context parallelism runs causal rows only (no mask or packing).")


# ------------------------------------------------------------------------------------------- modules
class IndexerLinear(torch.nn.Linear):
    """A replicated linear of the indexer (megatron-core's local spec has none): the constructor megatron-core's
    ``DSAIndexer`` calls (``parallel_mode`` "duplicated"), ``(out, None)`` from forward."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: str = "duplicated", **_unused):
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor):
        return super().forward(x), None


class IndexerKNorm:
    """The indexer's key LayerNorm (weight and bias) with eps ``K_NORM_EPS``, whatever eps megatron-core passes."""

    def __new__(cls, config, hidden_size: int, eps: float = K_NORM_EPS, **_unused) -> torch.nn.Module:
        return torch.nn.LayerNorm(hidden_size, eps=K_NORM_EPS, dtype=config.params_dtype)


class TopkHolder(dict):
    """One model's top-k of its full DSA layers in the current forward: layer number -> [b, s, topk] indices.
    ``built``: the full layers this model (this pipeline stage) holds, filled as they are built."""

    def __init__(self):
        super().__init__()
        self.built: set[int] = set()


@functools.cache
def _core_attention_classes():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention, unfused_dsa_fn
    from megatron.core.transformer.module import MegatronModule

    class DSACoreAttention(DSAttention):
        """megatron-core's ``DSAttention`` without its indexer KL loss (coefficient 0: the indexer is frozen, the
        loss would only cost a second [b, heads, s, s] score tensor); records its top-k for shared layers."""

        def __init__(self, *args, topk_holder: TopkHolder | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.topk_holder = topk_holder
            self.cp_group = _cp_group(self.config, self.indexer.pg_collection)
            if topk_holder is not None:
                topk_holder.built.add(self.layer_number)
                find = self.indexer.forward_with_scores

                def recording(*a, **kw):
                    scores, topk = find(*a, **kw)
                    topk_holder[self.layer_number] = topk
                    return scores, topk

                self.indexer.forward_with_scores = recording

        def forward(self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if self.cp_group is not None:        # this rank's query chunks against the whole sequence's keys
                _check_cp_inputs(attention_mask, packed_seq_params)
                topk = cp_indexer_topk(self.indexer, x.detach(), qr.detach(), self.cp_group)
                if self.topk_holder is not None:
                    self.topk_holder[self.layer_number] = topk
                return cp_sparse_attention(query, key, value, topk, self.softmax_scale, self.cp_group)
            args = (query, key, value, attention_mask, x, qr, attn_mask_type, attention_bias, packed_seq_params)
            training, self.training = self.training, False     # megatron-core attaches its loss in training only
            try:
                return super().forward(*args)
            finally:
                self.training = training

    class SharedTopkAttention(MegatronModule):
        """A shared DSA layer (GLM-5.2): the most recent full layer's top-k, megatron-core's sparse attention."""

        def __init__(self, config, submodules=None, layer_number: int = 1, attn_mask_type=None,
                     attention_type: str = "self", attention_dropout=None, softmax_scale: float | None = None,
                     k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str = "p2p",
                     pg_collection=None, topk_holder: TopkHolder | None = None, source_layer: int = 1):
            super().__init__(config=config)
            self.layer_number, self.source_layer, self.topk_holder = layer_number, source_layer, topk_holder
            self.softmax_scale = softmax_scale or (k_channels or config.kv_channels) ** -0.5
            self.cp_group = _cp_group(config, pg_collection)

        def forward(self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            topk = self.topk_holder.get(self.source_layer)
            if topk is None or topk.shape[1] != query.shape[0]:
                raise RuntimeError(f"DSA layer {self.layer_number} shares the top-k of layer {self.source_layer}, "
                                   "which did not run before it in this forward")
            if self.cp_group is not None:
                _check_cp_inputs(attention_mask, packed_seq_params)
                return cp_sparse_attention(query, key, value, topk, self.softmax_scale, self.cp_group)
            return unfused_dsa_fn(query, key, value, topk, self.softmax_scale)

    return DSACoreAttention, SharedTopkAttention


def source_layer(dsa: DsaShape, layer: int) -> int:
    """The full layer (0-based) whose top-k the shared layer ``layer`` (0-based) attends over: the most recent one."""
    return max(i for i in range(layer) if dsa.full_layers[i])


class LayerCoreAttention:
    """The core attention of one DSA layer, picked when megatron-core builds it from the ``layer_number`` it passes
    (model-wide and 1-based: the pipeline stage's offset included): ``DSACoreAttention`` for a full layer,
    ``SharedTopkAttention`` over its source layer's top-k for a shared one. One spec for every layer, so a pipeline
    stage's block spec (its own layers only) needs no per-layer copy."""

    def __new__(cls, config, submodules=None, layer_number: int = 1, *, dsa: DsaShape,
                topk_holder: TopkHolder | None = None, **kwargs) -> torch.nn.Module:
        full, shared = _core_attention_classes()
        i = layer_number - 1
        if dsa.full_layers[i]:
            return full(config, submodules=submodules, layer_number=layer_number, topk_holder=topk_holder, **kwargs)
        source = source_layer(dsa, i) + 1
        if topk_holder is None or source not in topk_holder.built:
            raise ValueError(f"DSA layer {layer_number} shares the top-k of layer {source}, which is not built before "
                             "it in this model (pipeline stage): a stage must start with a full layer")
        return shared(config, layer_number=layer_number, topk_holder=topk_holder, source_layer=source, **kwargs)


def core_attention_spec(dsa: DsaShape, holder: TopkHolder | None):
    """The ``core_attention`` ModuleSpec of every decoder layer (``LayerCoreAttention`` picks full or shared)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=IndexerKNorm, linear_weights_proj=IndexerLinear))
    return ModuleSpec(module=LayerCoreAttention, submodules=DSAttentionSubmodules(indexer=indexer),
                      params={"dsa": dsa, "topk_holder": holder})


def adapt_spec(spec, dsa: DsaShape) -> None:
    """Every layer of the block ``spec`` (a pipeline stage's own layers) or the one layer spec: the DSA core
    attention (``LayerCoreAttention``), one ``TopkHolder`` for the model when a layer is shared. The attention and
    layer specs are copied (a block's layer specs may be one object, the layer spec a module-level one)."""
    holder = TopkHolder() if not all(dsa.full_layers) else None
    core = core_attention_spec(dsa, holder)
    block = getattr(spec, "layer_specs", None)
    for i, layer in enumerate(block if block is not None else [spec]):
        attn = copy.copy(layer.submodules.self_attention)
        attn.submodules = copy.copy(attn.submodules)
        attn.submodules.core_attention = core
        if block is not None:
            layer = block[i] = copy.copy(layer)
            layer.submodules = copy.copy(layer.submodules)
        layer.submodules.self_attention = attn


def freeze_indexer(model: torch.nn.Module) -> None:
    """The indexer's parameters carried without gradients (never trained here, as in transformers)."""
    for name, p in model.named_parameters():
        if ".core_attention.indexer." in name:
            p.requires_grad_(False)


# ------------------------------------------------------------------------------------------- weights
def _perm(dsa: DsaShape) -> torch.Tensor:
    """Megatron's indexer head dims as positions in the HF head: ``meg[j] = hf[perm[j]]``."""
    d, r = dsa.index_head_dim, dsa.rope_dim
    rope = list(range(r))
    if not dsa.rope_interleaved:             # half-split: the de-interleave of [r0, r_{r/2}, r1, ...] is [r0, r1, ...]
        rope = [x for i in range(r // 2) for x in (i, r // 2 + i)]
    return torch.tensor(list(range(r, d)) + rope)


def _permute_rows(t: torch.Tensor, perm: torch.Tensor, dim: int) -> torch.Tensor:
    if t.shape[0] == dim:                    # wk, k_norm: one head
        return t[perm].contiguous()
    return t.reshape(-1, dim, *t.shape[1:])[:, perm].reshape(t.shape).contiguous()   # wq_b: per indexer head


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], dsa: DsaShape) -> torch.Tensor | None:
    """The megatron tensor of an indexer ``suffix`` (per layer) from a HF state dict; None: not an indexer name."""
    if not suffix.startswith(INDEXER_PREFIX):
        return None
    own = suffix[len(INDEXER_PREFIX):]
    t = hf[prefix + "self_attn.indexer." + _NAMES[own]]
    return t if own == "linear_weights_proj.weight" else _permute_rows(t, _perm(dsa), dsa.index_head_dim)


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor,
                   dsa: DsaShape) -> list[tuple[str, torch.Tensor]] | None:
    if not suffix.startswith(INDEXER_PREFIX):
        return None
    own = suffix[len(INDEXER_PREFIX):]
    if own != "linear_weights_proj.weight":
        full = _permute_rows(full, torch.argsort(_perm(dsa)), dsa.index_head_dim)
    return [(prefix + "self_attn.indexer." + _NAMES[own], full)]


# ------------------------------------------------------------------------------------------- flags
def check_static(o, shape, dsa: DsaShape) -> None:
    """The parallel layouts megatron-core's DSA does not run (``o``: ``options.Options``)."""
    if o.pp > 1 and not all(dsa.full_layers):     # a shared layer reads the top-k of an earlier layer of its stage
        from miles.trainer.megatron.pipeline import stage_layer_counts

        start = 0
        for stage, n in enumerate(stage_layer_counts(len(dsa.full_layers), o.pp, o.first_stage_layers,
                                                     o.last_stage_layers)):
            if not dsa.full_layers[start]:
                raise ConfigError(
                    f"--pipeline-model-parallel-size {o.pp}: pipeline stage {stage} would start with decoder layer "
                    f"{start}, a shared DSA layer ({shape.model_type} indexer_types, 0-based) that reads the top-k of layer "
                    f"{source_layer(dsa, start)} on an earlier stage; move the split with "
                    "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers so every stage starts "
                    "with a full layer.")
            start += n
        if o.recompute_granularity:      # 1F1B: a later micro-batch's forward runs before this one's backward
            raise ConfigError(
                f"--recompute-granularity {o.recompute_granularity} with --pipeline-model-parallel-size {o.pp} and "
                f"shared DSA layers ({shape.model_type} indexer_types) is not supported: a recomputed shared layer "
                "would read the top-k of the micro-batch its stage ran last; drop --recompute-granularity / "
                "--recompute-activations or use --pipeline-model-parallel-size 1.")
    if getattr(shape, "mtp_num_layers", 0):
        raise ConfigError(f"--mtp-num-layers {shape.mtp_num_layers} with DeepSeek sparse attention "
                          f"({shape.model_type}) is not supported by the Megatron backend yet: drop it.")


# ------------------------------------------------------------------------------------------- family
class _AsMla:
    """A DSA config read by ``mla``'s readers, which answer only for the model types of their own family."""

    def __init__(self, c):
        self._c = c

    def __getattr__(self, name):
        return "deepseek_v3" if name == "model_type" else getattr(self._c, name)


def _attention_fields(c) -> dict:
    return {**mla.hf_mla_fields(_AsMla(c)), "variant": dsa_fields(c)}


def _config_kwargs(shape) -> dict:
    return mla.config_kwargs(shape) | config_kwargs(shape.variant)


def _prepare(device: torch.device) -> None:
    mla.FAMILY.prepare(device)
    apply_compat()


def _adapt_spec(spec, shape, te: bool) -> None:
    """The MLA layers' DSA core attention, on either layer spec. With transformer-engine the attention is the local
    spec's (megatron-core's TE spec fuses the q latent norm into ``linear_q_up_proj``, so the indexer would read the
    q latent unnormalised; megatron-core itself builds DSA's core attention locally) with our sequence-parallel
    RMSNorms for the latents."""
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from miles.trainer.megatron.model import SequenceParallelNorm

        local = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm", multi_latent_attention=True)
        attn = local.submodules.self_attention
        attn.submodules.q_layernorm = attn.submodules.kv_layernorm = SequenceParallelNorm
        mla.adapt_local_spec(local)
        for layer in getattr(spec, "layer_specs", None) or [spec]:
            layer.submodules.self_attention = attn
    adapt_spec(spec, shape.variant)


def _hf_to_megatron(suffix: str, prefix: str, hf: dict, shape) -> torch.Tensor | None:
    t = hf_to_megatron(suffix, prefix, hf, shape.variant)
    return t if t is not None else mla.hf_to_megatron(suffix, prefix, hf, True)


def _megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor, shape) -> list | None:
    pairs = megatron_to_hf(suffix, prefix, full, shape.variant)
    return pairs if pairs is not None else mla.megatron_to_hf(suffix, prefix, full, True)


def fork_flags(shape) -> dict:
    """The flags of Miles's Megatron fork config.json fixes (``fork_flags.check_fork_flags`` checks them)."""
    d = shape.variant
    if not isinstance(d, DsaShape):
        return {}
    return {"experimental_attention_variant": ("attention", "dsa"),
            "dsa_indexer_n_heads": ("index_n_heads", d.index_n_heads),
            "dsa_indexer_head_dim": ("index_head_dim", d.index_head_dim),
            "dsa_indexer_topk": ("index_topk", d.index_topk)}


def _check_static(o, shape) -> None:
    mla.check_mla_static(o, shape)
    check_static(o, shape, shape.variant)


FAMILY = Family(
    name="dsa", model_types=FAMILIES, attention_fields=_attention_fields, moe_fields=mla.hf_moe_fields,
    rope_types=("default", "yarn"), config_kwargs=_config_kwargs, prepare=_prepare,
    core_attention=lambda shape: mla.mla_core_attention(), adapt_local_spec=mla.adapt_local_spec,
    adapt_spec=_adapt_spec, after_build=lambda model, shape: freeze_indexer(model), own_context_parallel=True,
    hf_to_megatron=_hf_to_megatron, megatron_to_hf=_megatron_to_hf, column=mla.COLUMN, row=mla.ROW,
    glu_fc1=(mla.SHARED_FC1,), exported_buffers=mla.exported_buffers, check_static=_check_static,
    fork_flags=fork_flags)
