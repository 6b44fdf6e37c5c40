"""The gpt-oss family on megatron-core: shape, config, core attention with sinks and sliding windows, and the
HF <-> Megatron names of its weights.

    fields = shape_fields(hf_config)       # ModelShape's fields of a gpt_oss config.json (ValueError: unsupported)
    kw = config_overrides(shape)           # TransformerConfig arguments that differ from the other families
    set_yarn(model, shape)                 # the rotary embedding's inverse frequencies -> YaRN's

What gpt-oss adds to a Qwen3-MoE-like decoder, and which megatron-core block holds it:

- learnable attention sinks (``self_attn.sinks``, one logit per head joined to each query's softmax and dropped
  after it): megatron-core's ``softmax_type="learnable"``, the core attention's ``softmax_offset`` parameter
  [heads / TP] (its unfused ``DotProductAttention`` and transformer-engine's fused attention have it). On the
  local spec the core attention is ``SinkAttention`` (below): a torch path, since megatron-core's unfused one
  builds its sliding-window mask on CUDA only and masks with -10000 instead of -inf.
- sliding-window layers alternating with full ones (config.json's ``layer_types``, a window of ``sliding_window``
  keys, the query's own included, as transformers and SGLang attend): megatron-core's ``window_size``
  (``(sliding_window - 1, 0)``: its left count excludes the query) and ``window_attn_skip_freq`` (a 0/1 list, 1
  per sliding layer).
- q/k/v/o biases, the router's bias and the experts' biases: ``add_bias_linear`` (megatron-core adds the expert
  biases scaled by the routing weight, as transformers does).
- the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, l)``: megatron-core's
  GLU with ``activation_func_clamp_value`` l, ``glu_linear_offset`` 1 and ``quick_gelu`` (alpha 1.702, gpt-oss's).
- top-k over the router logits, softmax over the k chosen: megatron-core's softmax router after top-k.
- YaRN rope (``truncate`` false keeps the correction range unrounded): megatron-core's ``RotaryEmbedding`` with
  the inverse frequencies of its own YaRN helpers; the cos/sin scale ``0.1 ln(factor) + 1`` of transformers
  multiplies q and k, so it enters as its square in the softmax scale.

Weights: the HF experts are fused per layer (``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up interleaved
column by column, ``down_proj`` [E, I, H], their biases), megatron-core's are per expert (``linear_fc1`` = [gate;
up] rows, ``linear_fc2``); ``megatron_to_hf`` gives one expert's slice under ``<fused name>#<expert>`` and
``fuse_experts`` joins the slices of a layer into the HF tensor in the weight stream (slicing and stacking only,
so the round trip is bitwise).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from miles.trainer.megatron.families import Family

FAMILIES = {"gpt_oss": "gpt-oss"}
QUICK_GELU_ALPHA = 1.702               # megatron-core's quick_gelu: x * sigmoid(1.702 x)
_EXPERT = re.compile(r"^(?:decoder\.)?layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_FUSED = {("linear_fc1", "weight"): "gate_up_proj", ("linear_fc1", "bias"): "gate_up_proj_bias",
          ("linear_fc2", "weight"): "down_proj", ("linear_fc2", "bias"): "down_proj_bias"}
_OWN = {  # megatron suffix -> HF suffix, per layer
    "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
}
COLUMN = ("core_attention.softmax_offset",)      # split over TP by heads (convert.partition_dim)


@dataclass(frozen=True)
class GptOssShape:
    sliding_window: int                 # keys a sliding layer attends to, the query's own included
    sliding_layers: tuple[int, ...]     # 1 per sliding-window layer, 0 per full-attention one
    swiglu_limit: float
    yarn: tuple[float, ...] = ()        # (factor, original max positions, beta_fast, beta_slow); () without YaRN
    yarn_truncate: bool = True
    attention_scaling: float = 1.0      # transformers' cos/sin scale (YaRN's mscale)


def own(shape) -> GptOssShape | None:
    """``shape``'s gpt-oss fields (``ModelShape.variant``), None for another family."""
    return shape.variant if isinstance(shape.variant, GptOssShape) else None


def is_gpt_oss_config(c) -> bool:
    return getattr(c, "model_type", None) in FAMILIES


# ------------------------------------------------------------------------------------------- shape
def shape_fields(c) -> dict:
    """``ModelShape``'s fields of a gpt-oss config.json (ValueError, one line, for what is not built)."""
    if getattr(c, "quantization_config", None):
        q = c.quantization_config
        method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", q)
        raise ValueError(f"config.json has quantization_config ({method}): the Megatron backend loads bf16/fp32 "
                         "gpt-oss weights; dequantize the checkpoint first (transformers' from_pretrained with "
                         "Mxfp4Config(dequantize=True), then save_pretrained).")
    if not getattr(c, "attention_bias", True):
        raise ValueError("gpt-oss with attention_bias false is not supported (megatron-core's add_bias_linear gives "
                         "every linear a bias, as gpt-oss has them).")
    alpha = float(getattr(c, "swiglu_alpha", QUICK_GELU_ALPHA))
    if not math.isclose(alpha, QUICK_GELU_ALPHA):
        raise ValueError(f"gpt-oss swiglu_alpha {alpha} is not supported (megatron-core's quick_gelu has alpha "
                         f"{QUICK_GELU_ALPHA}, gpt-oss's).")
    n = int(c.num_hidden_layers)
    types = list(getattr(c, "layer_types", None) or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                     for i in range(n)])
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad or len(types) != n:
        raise ValueError(f"gpt-oss layer_types {bad or types} not supported (sliding_attention / full_attention, one "
                         "per layer).")
    window = int(getattr(c, "sliding_window", None) or 0)
    sliding = tuple(int(t == "sliding_attention") for t in types)
    if any(sliding) and window <= 0:
        raise ValueError("gpt-oss layer_types has sliding_attention layers but sliding_window is not set.")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", None) or 150000.0))
    yarn: tuple[float, ...] = ()
    scaling, truncate = 1.0, True
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        extra = sorted(k for k in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(k) is not None)
        if extra:
            raise ValueError(f"gpt-oss yarn rope parameter(s) {extra} are not supported (gpt-oss has none).")
        factor = float(rope["factor"])
        yarn = (factor, float(rope.get("original_max_position_embeddings") or c.max_position_embeddings),
                float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0))
        truncate = bool(rope.get("truncate", True))
        scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    elif kind != "default":
        raise ValueError(f"gpt-oss rope_type {kind!r} is not supported (yarn or default).")
    heads = int(c.num_attention_heads)
    experts = int(c.num_local_experts)
    return dict(
        model_type=c.model_type, num_layers=n, hidden_size=int(c.hidden_size), ffn_hidden_size=int(c.intermediate_size),
        num_attention_heads=heads, num_query_groups=int(getattr(c, "num_key_value_heads", None) or heads),
        kv_channels=int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads), vocab_size=int(c.vocab_size),
        max_position_embeddings=int(c.max_position_embeddings), rotary_base=theta, norm_epsilon=float(c.rms_norm_eps),
        qk_layernorm=False, qkv_bias=True, tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        num_experts=experts, moe_ffn_hidden_size=int(c.intermediate_size), moe_router_topk=int(c.num_experts_per_tok),
        moe_norm_topk_prob=True, moe_layer_pattern=(1,) * n,
        variant=GptOssShape(sliding_window=window, sliding_layers=sliding, swiglu_limit=float(c.swiglu_limit),
                            yarn=yarn, yarn_truncate=truncate, attention_scaling=scaling))


# ------------------------------------------------------------------------------------------- flags
def check_shape(m, shape) -> None:
    """``--softmax-type``, ``--window-size``, ``--window-attn-skip-freq``, ``--disable-bias-linear`` against
    config.json (gpt-oss) or refused on another family: one line naming the flag, its value and the config's."""
    from miles.config.base import ConfigError
    from miles.trainer.megatron.moe import parse_layer_freq

    if m is None:
        return
    g = own(shape)
    softmax = getattr(m, "softmax_type", None)
    window = getattr(m, "window_size", None)
    skip = getattr(m, "window_attn_skip_freq", None)

    def mismatch(flag: str, value, key: str, cv) -> ConfigError:
        return ConfigError(f"{flag} {value} does not match --hf-checkpoint's config.json ({key} {cv}): fix the flag "
                           "or drop it (the model shape is read from config.json).")

    if g is None:              # a family with sliding windows of its own (Gemma 4) checks the window flags itself
        windowed = getattr(shape.variant, "sliding_window", None) is not None
        for flag, v in (("--softmax-type", softmax if softmax not in (None, "vanilla") else None),
                        ("--window-size", None if windowed else window),
                        ("--window-attn-skip-freq", None if windowed else skip)):
            if v is not None:
                raise mismatch(flag, v, "model_type", f"{shape.model_type}, no attention sinks or sliding windows")
        return
    if softmax is not None and softmax != "learnable":
        raise mismatch("--softmax-type", softmax, "self_attn.sinks", "present (learnable)")
    if window is not None:
        left, right = parse_window(window)
        if (left, right) != (g.sliding_window, 0):
            raise mismatch("--window-size", window, "sliding_window", g.sliding_window)
    if skip is not None:
        freq = parse_layer_freq(skip, "--window-attn-skip-freq")     # N: every N-th layer (1-indexed) is full
        pattern = tuple(int((i + 1) % freq != 0) for i in range(shape.num_layers)) if isinstance(freq, int) else \
            tuple(freq)
        if pattern != g.sliding_layers:
            raise mismatch("--window-attn-skip-freq", skip, "layer_types (1: sliding_attention)", list(g.sliding_layers))
    if m.disable_bias_linear:
        raise mismatch("--disable-bias-linear", "(given)", "attention_bias", True)
    if m.num_layers is not None:
        for flag, given in (("--softmax-type learnable", softmax == "learnable"),
                            (f"--window-size {g.sliding_window},0", window is not None or not any(g.sliding_layers))):
            if not given:
                raise ConfigError(f"{flag.split(' ')[0]} is missing but --hf-checkpoint's config.json is gpt-oss "
                                  f"(attention sinks, sliding_window {g.sliding_window}): add {flag} (with "
                                  "--num-layers the Megatron shape flags must describe the model fully), or drop the "
                                  "shape flags.")


def parse_window(value: str) -> tuple[int, int]:
    """Megatron-LM's ``--window-size 'L,R'`` (as Miles passes it: ``128,0``)."""
    from miles.config.base import ConfigError

    try:
        left, right = (int(v) for v in str(value).strip("()[] ").split(","))
    except ValueError:
        raise ConfigError(f"--window-size {value!r} is not two integers 'LEFT,RIGHT' such as '128,0'.") from None
    return left, right


def check_static(o, shape) -> None:
    """What the gpt-oss build does not run (``o``: ``options.Options``)."""
    from miles.config.base import ConfigError

    if own(shape) is None:
        return
    if o.cp > 1:
        raise ConfigError(f"--context-parallel-size {o.cp} with gpt-oss (attention sinks, sliding windows) is not "
                          "supported by the Megatron backend yet; use tensor, expert and data parallelism.")
    if o.attention_backend in ("unfused", "local"):
        raise ConfigError(f"--attention-backend {o.attention_backend} (megatron-core's DotProductAttention) builds its "
                          "sliding-window mask on CUDA only and masks with -10000: gpt-oss runs on the sink "
                          "attention of --attention-backend auto/flash/fused.")


# ------------------------------------------------------------------------------------------- model
def config_overrides(shape) -> dict:
    """TransformerConfig arguments of gpt-oss (empty for another family)."""
    g = own(shape)
    if g is None:
        return {}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    kw = dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
              activation_func_clamp_value=g.swiglu_limit, bias_activation_fusion=False, softmax_type="learnable",
              softmax_scale=g.attention_scaling ** 2 / math.sqrt(shape.kv_channels))
    if any(g.sliding_layers):
        kw.update(window_size=(g.sliding_window - 1, 0), window_attn_skip_freq=list(g.sliding_layers))
    return kw


def yarn_inv_freq(shape, device: torch.device | None = None) -> torch.Tensor:
    """YaRN's inverse frequencies [kv_channels / 2] from megatron-core's own helpers."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_linear_ramp_mask,
    )

    g = own(shape)
    factor, original, fast, slow = g.yarn
    dim = shape.kv_channels
    extra = 1.0 / (shape.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    inter = extra / factor
    low, high = _yarn_find_correction_range(fast, slow, dim, shape.rotary_base, int(original), g.yarn_truncate)
    mask = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device=device).to(torch.float32)
    return inter * (1 - mask) + extra * mask


def set_yarn(model, shape) -> None:
    """The GPTModel's rotary embedding rotates with YaRN's frequencies (before its first forward)."""
    if own(shape) is None or not own(shape).yarn or getattr(model, "rotary_pos_emb", None) is None:
        return
    rope = model.rotary_pos_emb
    rope.inv_freq = yarn_inv_freq(shape, rope.inv_freq.device)
    rope.forward.cache_clear()


class SinkAttention(torch.nn.Module):
    """Causal core attention with gpt-oss's sinks and sliding window, in torch (CPU and GPU): the scores
    [b, heads, s, s] in fp32, masked to the causal (and, on a sliding layer, the window's) keys, one sink logit
    per head joined to each row's softmax and dropped after it. Same constructor and forward as megatron-core's
    core attention; ``softmax_offset`` [heads / TP] is megatron-core's learnable-softmax parameter (its name and
    checkpoint layout). Rows are causal with right padding (no mask), as ``model.SDPACoreAttention``'s."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import is_layer_window_attention

        self.config = config
        tp = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / config.kv_channels ** 0.5
        window = config.window_size if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                                 max(1, layer_number)) else None
        self.window_left = None if window is None or window[0] < 0 else int(window[0])
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype))
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.heads, dtype=config.params_dtype),
                                 persistent=False)
        else:
            self.softmax_offset = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        from megatron.core import tensor_parallel

        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SinkAttention runs causal rows only (no mask, bias or packing).")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, heads, s, hn]
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale     # [b, h, sq, sk]
        sq, sk = scores.shape[-2:]
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None, :]
        allowed = j <= i
        if self.window_left is not None:
            allowed = allowed & (j >= i - self.window_left)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.softmax_offset is not None:
            sink = self.softmax_offset.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, sq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        p = self.dropout if self.training else 0.0
        if p > 0:
            ctx = tensor_parallel.get_cuda_rng_tracker().fork() if q.device.type == "cuda" else contextlib.nullcontext()
            with ctx:
                probs = torch.nn.functional.dropout(probs, p=p)
        out = torch.matmul(probs.to(v.dtype), v)                                 # [b, h, sq, hn]
        b = query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        """megatron-core's checkpoint layout of ``softmax_offset``: split over TP by heads (as
        ``DotProductAttention`` writes it)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = {"softmax_offset": self.softmax_offset} if isinstance(self.softmax_offset, torch.nn.Parameter) else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


_expert_fc2 = None


def adapt_local_spec(spec) -> None:
    """The local spec's experts with biases: their ``linear_fc2`` returns a copy of its output. megatron-core 0.16's
    expert MLP adds the routing-weighted bias to that output in place, which autograd forbids when the row-parallel
    linear returns its input's view (no TP or EP communication: TP 1 and EP 1)."""
    global _expert_fc2
    if _expert_fc2 is None:
        from megatron.core.tensor_parallel import RowParallelLinear

        class ExpertRowParallelLinear(RowParallelLinear):
            def forward(self, *args, **kwargs):
                out, bias = super().forward(*args, **kwargs)
                return out.clone(), bias

        _expert_fc2 = ExpertRowParallelLinear
    for layer in spec.layer_specs:
        layer.submodules.mlp.submodules.experts.submodules.linear_fc2 = _expert_fc2


# ------------------------------------------------------------------------------------------- names
def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The full megatron tensor of layer parameter ``suffix`` (EP-free expert index) from the HF state dict;
    ``prefix`` is 'model.layers.L.'. None: not a gpt-oss-specific name."""
    if suffix in _OWN:
        return hf[prefix + _OWN[suffix]]
    m = _EXPERT.match("layers.0." + suffix)
    if m is None:
        return None
    e, fc, kind = int(m.group(2)), m.group(3), m.group(4)
    t = hf[prefix + "mlp.experts." + _FUSED[(fc, kind)]][e]
    if fc == "linear_fc2":
        return t.t() if kind == "weight" else t                              # [I, H] -> [H, I]; bias [H]
    if kind == "weight":                                                     # [H, 2I] interleaved -> [gate; up] rows
        return torch.cat([t[:, 0::2].t(), t[:, 1::2].t()], dim=0)
    return torch.cat([t[0::2], t[1::2]], dim=0)


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of a full megatron layer tensor (an expert's: its slice, ``<fused name>#<expert>``)."""
    if suffix in _OWN:
        return [(prefix + _OWN[suffix], full)]
    m = _EXPERT.match("layers.0." + suffix)
    if m is None:
        return None
    e, fc, kind = int(m.group(2)), m.group(3), m.group(4)
    name = f"{prefix}mlp.experts.{_FUSED[(fc, kind)]}#{e}"
    if fc == "linear_fc2":
        return [(name, full.t() if kind == "weight" else full)]
    gate, up = full.chunk(2, dim=0)
    if kind == "weight":                                                     # [gate; up] rows -> [H, 2I] interleaved
        return [(name, torch.stack([gate.t(), up.t()], dim=-1).reshape(gate.shape[1], -1))]
    return [(name, torch.stack([gate, up], dim=-1).reshape(-1))]


def fuse_experts(buckets: Iterator[list[tuple[str, torch.Tensor]]], num_experts: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The weight stream with each layer's expert slices (``<fused name>#<expert>``) joined into the fused HF
    tensor [E, ...], yielded in the bucket where its last slice arrives (a bucket left empty is skipped)."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for bucket in buckets:
        out = []
        for name, t in bucket:
            base, sep, e = name.rpartition("#")
            if not sep:
                out.append((name, t))
                continue
            pending.setdefault(base, {})[int(e)] = t
            if len(pending[base]) == num_experts:
                parts = pending.pop(base)
                out.append((base, torch.stack([parts[i] for i in range(num_experts)])))
        if out:
            yield out
    if pending:
        raise RuntimeError(f"gpt-oss export: expert slices of {sorted(pending)} never completed (a bug).")


# ------------------------------------------------------------------------------------------- family
FAMILY = Family(
    name="gpt-oss", model_types=FAMILIES, shape_fields=shape_fields, config_kwargs=config_overrides,
    core_attention=lambda shape: SinkAttention, adapt_local_spec=adapt_local_spec, after_build=set_yarn,
    hf_to_megatron=lambda suffix, prefix, hf, shape: hf_to_megatron(suffix, prefix, hf),
    megatron_to_hf=lambda suffix, prefix, full, shape: megatron_to_hf(suffix, prefix, full), column=COLUMN,
    export_stream=lambda buckets, shape: fuse_experts(buckets, shape.num_experts), check_flags=check_shape,
    check_static=check_static, linear_biases=True,
    fork_flags=lambda shape: {"activation_func_clamp_value": ("swiglu_limit", own(shape).swiglu_limit)}
    if own(shape) else {})
