"""The Gemma 4 family on megatron-core: shape, config, layer spec and the HF <-> Megatron names of its text decoder.

    fields = shape_fields(hf_config)     # ModelShape's fields of a gemma4 / gemma4_text config.json (ValueError: not built)
    kw = config_kwargs(shape)            # TransformerConfig arguments of Gemma 4
    spec = layer_spec(shape, core)       # megatron-core's local layer spec with Gemma 4's blocks
    after_build(model, shape)            # embedding scale, the sliding layers' RoPE frequencies

What transformers 5.24's ``models/gemma4`` holds, which part Miles trains, and what builds each part here.
Miles v0.1.0 records two Gemma 4 commands (radixark/miles@v0.1.0:scripts/run_gemma_4_31b.py, dense, and
radixark/miles@v0.1.0:scripts/run_gemma_4_26b_a4b.py, MoE), both on the multimodal checkpoints
(``Gemma4ForConditionalGeneration``) through Megatron-Bridge's Gemma4VLBridge, training the language model only
(radixark/miles@v0.1.0:docs/models/gemma/gemma-4.md: "the RL recipe simply trains the language stack"); there is
no Gemma entry under radixark/miles@v0.1.0:miles_plugins. Built here: the text decoder of the dense checkpoints and
of 26B-A4B's, whose MoE block is ``gemma4_moe.py``'s.

- Text decoder (``Gemma4TextModel``; under ``model.language_model.*`` in a multimodal checkpoint, ``model.*`` in a
  ``Gemma4ForCausalLM`` one): megatron-core's ``GPTModel`` with the local layer spec, blocks swapped as below.
- GeGLU ``down(gelu_tanh(gate x) * up x)``: megatron-core's ``MLP`` with ``gated_linear_unit`` and a tanh GELU
  ``activation_func`` (no bias-activation fusion: megatron-core fuses only its own functions).
- RMSNorm ``x * rsqrt(mean x^2 + eps) * w`` in fp32: Gemma 4's norms scale by ``w`` (transformers starts them at
  one), not Gemma 2/3's ``(1 + w)``, so megatron-core's torch ``RMSNorm`` holds the checkpoint's weights as they are.
- Sandwich norms (``post_attention_layernorm`` on the attention output and ``post_feedforward_layernorm`` on the
  MLP output, before each residual add; ``input_layernorm`` / ``pre_feedforward_layernorm`` as usual): megatron-core
  has no post-sublayer norm, so the output projections are ``PostNormRowParallelLinear`` (below): megatron-core's
  ``RowParallelLinear`` followed by an RMSNorm on its (TP-reduced) output, its weight ``linear_proj.post_norm`` /
  ``linear_fc2.post_norm``.
- ``layer_scalar`` (a buffer per layer multiplying the layer's output, residual included): ``Gemma4Layer``, a
  megatron-core ``TransformerLayer`` with that buffer (checkpointed and exported, never trained, as in transformers).
- q/k norms over each head before RoPE: megatron-core's ``qk_layernorm``. The value norm (RMS without weight) and
  the attention scale 1 (no 1/sqrt(d): q and k are normalised): ``Gemma4Attention`` (below) and ``softmax_scale`` 1.
- Sliding and full layers (``layer_types``; 31B: 5 sliding then 1 full): megatron-core's ``window_size``
  ``(sliding_window - 1, 0)`` and ``window_attn_skip_freq`` (1 per sliding layer). The full layers differ in more
  than the window, and megatron-core's layers share one config: ``Gemma4Attention`` (a megatron-core
  ``SelfAttention``) builds a full layer from the config with ``kv_channels = global_head_dim`` and
  ``num_query_groups = num_global_key_value_heads``; with ``attention_k_eq_v`` a full layer has no ``v_proj``: its
  ``linear_qkv`` holds q and k per group and the value is the raw key (before k's norm and RoPE), as transformers
  computes it. A full layer with fewer KV heads than TP ranks (26B-A4B: 2 at Miles's TP 4; ``kv_replicated``) has
  one group per TP rank: ``linear_q`` (q, split over TP by heads) and ``linear_kv`` (every KV head's [k; v] rows,
  replicated; each rank uses its heads' KV head, the gradient is summed over TP: the shared ``kv_replicate.py``,
  which Nemotron-H's attention uses too). Sliding layers
  rotate with the GPTModel's RoPE (theta ``sliding_attention.rope_theta``, whole head); full layers with their own
  frequencies: transformers' "proportional" RoPE (theta 1e6, ``partial_rotary_factor`` 0.25: the first quarter of
  the frequencies of the full head size, the rest zero, so only those dims rotate, paired i with i + d/2 as
  megatron-core's non-interleaved RoPE pairs them).
- Core attention: torch SDPA with a causal band mask on sliding layers (``WindowSDPAttention``, CPU and GPU), or
  megatron-core's unfused ``DotProductAttention`` (``--attention-backend unfused``, Miles's recorded value; its
  sliding-window mask is built on CUDA, so on CPU ``prepare`` gives it the same mask on the CPU).
- Attention logit softcapping: not in Gemma 4 (transformers' Gemma4TextAttention passes none; Gemma 2 had it).
- Embedding scaled by sqrt(hidden_size) in the weight's dtype: ``after_build``'s forward hook on the embedding.
- Final logit softcapping ``c * tanh(z / c)`` (``final_logit_softcapping``, 30 in 31B): on the log-prob head of both
  backends (``miles.trainer.logprobs``, ``softcap``), elementwise, so the vocabulary-parallel head takes it as is.
- Tied embeddings (``tie_word_embeddings``, no ``lm_head.weight`` in the checkpoint): megatron-core's shared
  embedding and output weight.
- Refused in one line (``shape_fields``): per-layer embeddings (``hidden_size_per_layer_input``), KV sharing
  (``num_kv_shared_layers``), the double-wide MLP (the E2B/E4B checkpoints' parts), bidirectional attention.
- The MoE block (``enable_moe_block``, 26B-A4B: the dense MLP and 128 experts side by side, each with its own pre-
  and post-norms, Gemma's router): ``gemma4_moe.py``, megatron-core's ``MoELayer`` as the layer's ``mlp``
  (``Gemma4Layer`` builds it with the layer's process groups).
- Vision tower (``model.vision_tower.*``, ``model.embed_vision.*``) and audio tower: not in the Megatron model.
  Training is text-only, as Miles's recipes are; the engines keep the towers they loaded (the weight sync sends
  the language model's tensors under their checkpoint names).

``--qkv-format bshd`` (Miles's recorded Gemma 4 commands pass it): in Megatron-LM the layout of the attention's
input, [b, s, h, d] padded batches against thd's packed [t, h, d] rows with cu_seqlens. The Megatron backend here
runs every micro-batch as right-padded [b, s] rows (megatron-core's [s, b, h] activations, causal attention over
each row, no packing), which is bshd, so the flag is accepted with the same math (``miles/config/support.py``).

Weights (``hf_to_megatron`` / ``megatron_to_hf``, suffixes under ``model.layers.L.`` / ``decoder.layers.L.``):
``linear_qkv`` per query group [q heads; k; v] (full K=V layers: [q heads; k]), ``linear_fc1`` [gate; up],
``pre_mlp_layernorm`` = ``pre_feedforward_layernorm``, the post norms, ``layer_scalar``; ``linear_q`` = ``q_proj``,
``linear_kv`` per KV head [k; v] ([k] with K=V); the MoE block's: ``gemma4_moe.py``. Slicing and stacking only, so
the round trip is bitwise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from miles.trainer.megatron import kv_replicate
from miles.trainer.megatron.families import Family, gemma4_moe

MODEL_TYPES = {"gemma4": "Gemma 4", "gemma4_text": "Gemma 4"}
LM_PREFIX = "model.language_model."          # the text decoder in a multimodal checkpoint (model.* in a CausalLM one)
_OWN = {  # megatron suffix -> HF suffix, per layer (the rest: qkv and fc1, below)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.post_norm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.post_norm.weight": "post_feedforward_layernorm.weight",
    "layer_scalar": "layer_scalar",
}


@dataclass(frozen=True)
class Gemma4Shape:
    sliding_window: int                 # keys a sliding layer attends to, the query's own included
    sliding_layers: tuple[int, ...]     # 1 per sliding-window layer, 0 per full-attention one
    global_head_dim: int                # a full layer's head size
    global_kv_heads: int                # a full layer's KV heads
    k_eq_v: bool                        # full layers: no v_proj, the value is the raw key
    sliding_theta: float
    global_theta: float
    global_rotary_fraction: float       # proportional RoPE's partial_rotary_factor
    final_logit_softcapping: float      # 0: none
    multimodal: bool                    # the text decoder's names are under model.language_model.


def is_gemma4_config(c) -> bool:
    return getattr(c, "model_type", None) in MODEL_TYPES


def _text(c):
    return c.text_config if getattr(c, "model_type", None) == "gemma4" else c


def _get(c, key, default=None):
    v = c.get(key, default) if isinstance(c, dict) else getattr(c, key, default)
    return default if v is None else v


# ------------------------------------------------------------------------------------------- shape
def shape_fields(c) -> dict:
    """``ModelShape``'s fields of a Gemma 4 config.json (ValueError, one line, for what is not built)."""
    multimodal = getattr(c, "model_type", None) == "gemma4"
    tie = bool(getattr(c, "tie_word_embeddings", True))
    t = _text(c)
    if isinstance(t, dict):
        from transformers import Gemma4TextConfig

        t = Gemma4TextConfig(**{k: v for k, v in t.items() if k != "model_type"})
    for key, what in (("hidden_size_per_layer_input", "per-layer embeddings"),
                      ("num_kv_shared_layers", "KV sharing"), ("use_double_wide_mlp", "the double-wide MLP"),
                      ("use_bidirectional_attention", "bidirectional attention"), ("attention_bias", "q/k/v/o biases")):
        if _get(t, key):
            raise ValueError(f"Gemma 4 with {key} {_get(t, key)!r} ({what}) is not built by the Megatron backend yet "
                             "(it builds the dense 31B-style text decoder); use --train-backend fsdp.")
    act = _get(t, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 4 hidden_activation {act!r} is not supported (gelu_pytorch_tanh, GeGLU).")
    n = int(t.num_hidden_layers)
    types = list(t.layer_types)
    bad = sorted({x for x in types if x not in ("sliding_attention", "full_attention")})
    if bad or len(types) != n:
        raise ValueError(f"Gemma 4 layer_types {bad or types} not supported (sliding_attention / full_attention, one "
                         "per layer).")
    rope = dict(t.rope_parameters or {})
    slide, full = dict(rope.get("sliding_attention") or {}), dict(rope.get("full_attention") or {})
    if slide.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
            "default", "proportional") or float(full.get("factor", 1.0)) != 1.0:
        raise ValueError(f"Gemma 4 rope_parameters {rope} not supported (sliding: default; full: proportional or "
                         "default, no factor).")
    heads = int(t.num_attention_heads)
    per = t.per_layer_config
    full_idx = next((i for i, x in enumerate(types) if x == "full_attention"), None)
    slide_idx = next((i for i, x in enumerate(types) if x == "sliding_attention"), None)
    # transformers resolves head_dim / num_key_value_heads per layer (the full layers' own in per_layer_config)
    head_dim, kv_heads = (int(per[slide_idx].head_dim), int(per[slide_idx].num_key_value_heads)) if \
        slide_idx is not None else (int(per[full_idx].head_dim), int(per[full_idx].num_key_value_heads))
    gdim, gkv = (int(per[full_idx].head_dim), int(per[full_idx].num_key_value_heads)) if full_idx is not None else \
        (head_dim, kv_heads)
    fraction = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    cap = _get(t, "final_logit_softcapping", 0.0)
    variant = Gemma4Shape(
        sliding_window=int(t.sliding_window), sliding_layers=tuple(int(x == "sliding_attention") for x in types),
        global_head_dim=gdim, global_kv_heads=gkv, k_eq_v=bool(_get(t, "attention_k_eq_v", False)),
        sliding_theta=float(slide.get("rope_theta", 10000.0)), global_theta=float(full.get("rope_theta", 1e6)),
        global_rotary_fraction=fraction, final_logit_softcapping=float(cap), multimodal=multimodal)
    return dict(
        **gemma4_moe.moe_fields(t),
        model_type=c.model_type, num_layers=n, hidden_size=int(t.hidden_size),
        ffn_hidden_size=int(t.intermediate_size), num_attention_heads=heads,
        num_query_groups=kv_heads, kv_channels=head_dim, vocab_size=int(t.vocab_size),
        max_position_embeddings=int(t.max_position_embeddings),
        rotary_base=variant.global_theta,            # Miles's --rotary-base (the first rope_theta of config.json)
        norm_epsilon=float(t.rms_norm_eps), qk_layernorm=True, qkv_bias=False,
        tie_embeddings=tie if multimodal else bool(getattr(t, "tie_word_embeddings", True)),
        final_logit_softcapping=variant.final_logit_softcapping, variant=variant)


# ------------------------------------------------------------------------------------------- flags
def check_flags(m, shape) -> None:
    """``--window-size``, ``--window-attn-skip-freq``, ``--softmax-type`` and ``--swiglu`` against config.json on a Gemma 4 checkpoint; Miles's
    recorded Gemma 4 commands pass none of them, nor ``--swiglu`` / ``--qk-layernorm`` (Megatron-Bridge builds Gemma 4
    from config.json: ``bridge_only``), so the absence of a switch is not an error."""
    from miles.config.base import ConfigError

    g = getattr(shape, "variant", None)
    if m is None or not isinstance(g, Gemma4Shape):
        return
    from miles.trainer.megatron.moe import parse_layer_freq

    fix = "fix the flag or drop it (the model shape is read from config.json)."
    window = getattr(m, "window_size", None)
    if window is not None:
        try:
            left, right = (int(v) for v in str(window).strip("()[] ").split(","))
        except ValueError:
            raise ConfigError(f"--window-size {window!r} is not two integers 'LEFT,RIGHT' such as "
                              f"'{g.sliding_window - 1},0'.") from None
        if (left, right) != (g.sliding_window - 1, 0) and (left, right) != (g.sliding_window, 0):
            raise ConfigError(f"--window-size {window} does not match --hf-checkpoint's config.json (sliding_window "
                              f"{g.sliding_window}): {fix}")
    skip = getattr(m, "window_attn_skip_freq", None)
    if skip is not None:
        freq = parse_layer_freq(skip, "--window-attn-skip-freq")     # N: every N-th layer (1-indexed) is full
        n = len(g.sliding_layers)
        pattern = tuple(int((i + 1) % freq != 0) for i in range(n)) if isinstance(freq, int) else tuple(freq)
        if pattern != g.sliding_layers:
            raise ConfigError(f"--window-attn-skip-freq {skip} does not match --hf-checkpoint's config.json "
                              f"(layer_types (1: sliding_attention) {list(g.sliding_layers)}): {fix}")
    if getattr(m, "swiglu", False):
        raise ConfigError("--swiglu does not match --hf-checkpoint's config.json (Gemma 4's hidden_activation "
                          "gelu_pytorch_tanh: GeGLU, read from config.json): drop the flag.")
    if getattr(m, "softmax_type", None) not in (None, "vanilla"):
        raise ConfigError(f"--softmax-type {m.softmax_type} does not match --hf-checkpoint's config.json (Gemma 4, no "
                          "attention sinks): drop the flag.")


def check_static(o, shape) -> None:
    """What the Gemma 4 build does not run (``o``: ``options.Options``)."""
    from miles.config.base import ConfigError

    g = shape.variant
    if o.cp > 1:
        raise ConfigError(f"--context-parallel-size {o.cp} with Gemma 4 (sliding windows, per-layer RoPE) is not "
                          "supported by the Megatron backend yet; use tensor and data parallelism.")
    if o.pp > 1:
        raise ConfigError(f"--pipeline-model-parallel-size {o.pp} with Gemma 4 is not supported by the Megatron "
                          "backend yet; use tensor and data parallelism.")
    if g.global_kv_heads % o.tp and o.tp % g.global_kv_heads:
        raise ConfigError(f"--tensor-model-parallel-size {o.tp} neither divides nor is a multiple of config.json's "
                          f"num_global_key_value_heads {g.global_kv_heads} (Gemma 4's full-attention layers); choose "
                          "a TP size that divides it or a multiple of it.")


# ------------------------------------------------------------------------------------------- model
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def config_kwargs(shape) -> dict:
    """TransformerConfig arguments of Gemma 4."""
    g = shape.variant
    kw = dict(activation_func=gelu_tanh, bias_activation_fusion=False, add_bias_linear=False, softmax_scale=1.0)
    if any(g.sliding_layers):
        kw.update(window_size=(g.sliding_window - 1, 0), window_attn_skip_freq=list(g.sliding_layers))
    if 0 < sum(g.sliding_layers) < len(g.sliding_layers):   # sliding and full layers' tensors differ in shape: the
        kw.update(hetereogenous_dist_checkpoint=True)        # torch_dist checkpoint keys each layer on its own
    kw.update(gemma4_moe.config_kwargs(shape))               # the MoE block (26B-A4B): gemma4_moe.py
    return kw


def _sliding_mask(sq: int, sk: int, window: tuple[int, int]) -> torch.Tensor:
    """megatron-core's ``get_sliding_window_causal_mask`` (True: masked) on the default device instead of CUDA."""
    m = torch.ones(sq, sk, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=sk - sq - window[0]), diagonal=sk - sq + window[1])


def prepare(device: torch.device) -> None:
    """On CPU, megatron-core's unfused attention builds its sliding-window mask on the CPU (``_sliding_mask``)."""
    if device.type == "cuda":
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    tutils.get_sliding_window_causal_mask = _sliding_mask
    fused_softmax.get_sliding_window_causal_mask = _sliding_mask


def proportional_inv_freq(dim: int, theta: float, fraction: float, device=None) -> torch.Tensor:
    """transformers' proportional RoPE frequencies [dim / 2]: the first ``fraction * dim / 2`` of the frequencies
    of a ``dim``-wide head, the rest zero."""
    angles = int(fraction * dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / dim))
    return torch.cat([inv, torch.zeros(dim // 2 - angles, dtype=torch.float32, device=device)])


def kv_replicated(g: Gemma4Shape, tp: int) -> bool:
    """The full layers have fewer KV heads than TP ranks (gemma-4-26B-A4B: 2, Miles's TP 4): each rank computes its
    query heads' KV head from a replicated weight (``Gemma4Attention``, ``kv_replicate.py``)."""
    return kv_replicate.kv_replicated(g.global_kv_heads, tp)


def _layer_is_sliding(config, layer_number: int) -> bool:
    from megatron.core.transformer.utils import is_layer_window_attention

    return is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)


_CLASSES: dict[str, type] = {}


def _classes() -> dict[str, type]:
    """Gemma 4's megatron-core subclasses (built once, on first use: megatron-core is imported lazily)."""
    if _CLASSES:
        return _CLASSES
    import dataclasses

    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class PostNormRowParallelLinear(RowParallelLinear):
        """megatron-core's RowParallelLinear, then Gemma's post-sublayer RMSNorm on its output (the full hidden
        size after TP's reduction; under sequence parallelism this rank's tokens, the weight's gradient summed over
        TP as the other sequence-parallel norms')."""

        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_norm = torch.nn.RMSNorm(output_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
            self.post_norm.weight.sequence_parallel = bool(config.sequence_parallel)

        def forward(self, input_):
            out, bias = super().forward(input_)
            if bias is not None:
                raise RuntimeError("PostNormRowParallelLinear: Gemma 4 has no linear biases (a bug).")
            return self.post_norm(out), None

    class Gemma4Attention(SelfAttention):
        """megatron-core's SelfAttention for one Gemma 4 layer: on a full-attention layer the config's head size and
        KV heads are the full layers' (``gemma.global_head_dim``, ``gemma.global_kv_heads``), K=V when the checkpoint
        says so, and its own proportional RoPE; the value is RMS-normalised without weight (every layer)."""

        gemma: Gemma4Shape | None = None          # set on the subclass the spec names (layer_spec)

        def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
            g = self.gemma
            self.sliding = _layer_is_sliding(config, layer_number)
            self.k_eq_v = g.k_eq_v and not self.sliding
            tp = config.tensor_model_parallel_size
            self.kv_copies = 0                     # > 0: the full layer's KV heads replicated over TP (kv_replicated)
            if not self.sliding:
                groups = g.global_kv_heads
                if kv_replicated(g, tp):           # each TP rank one group: a copy of its query heads' KV head
                    self.kv_copies, groups = tp // groups, tp
                config = dataclasses.replace(config, kv_channels=g.global_head_dim, num_query_groups=groups)
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            kv = 1 if self.k_eq_v else 2
            if self.kv_copies:                     # q split over TP by heads; every KV head's [k; v] rows on each rank
                kv_replicate.build_projections(self, submodules, g.global_kv_heads, kv)
            elif self.k_eq_v:                      # [q heads; k] per group: no value rows
                self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
                self.linear_qkv = submodules.linear_qkv(
                    self.config.hidden_size, self.linear_qkv_out_dim, config=self.config,
                    init_method=self.config.init_method, gather_output=False, bias=False,
                    skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
            self._rope_cache: tuple | None = None

        def _global_rope(self, seq_len: int, device) -> torch.Tensor:
            key = (seq_len, str(device))
            if self._rope_cache is None or self._rope_cache[0] != key:
                inv = proportional_inv_freq(self.config.kv_channels, self.gemma.global_theta,
                                            self.gemma.global_rotary_fraction, device=device)
                freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
                self._rope_cache = (key, torch.cat([freqs, freqs], dim=-1)[:, None, None, :])
            return self._rope_cache[1]

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            if not self.sliding and rotary_pos_emb is not None:
                emb = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
                rotary_pos_emb = self._global_rope(emb.shape[0], emb.device)
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False,
                                        split_qkv: bool = True):
            if output_gate or not split_qkv:
                raise NotImplementedError("Gemma 4 attention: no output gate or fused qkv-rope (a bug).")
            hn = self.hidden_size_per_attention_head
            kv = 1 if self.k_eq_v else 2
            if self.kv_copies:                     # (kv_replicate.py: linear_kv's gradient summed over TP)
                query, key, value = kv_replicate.replicated_qkv(self, hidden_states, kv, self.kv_copies)
            else:
                mixed, _ = self.linear_qkv(hidden_states)
                per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
                mixed = mixed.view(*mixed.shape[:-1], self.num_query_groups_per_partition, (per_group + kv) * hn)
                parts = torch.split(mixed, [per_group * hn, hn] + ([hn] if kv == 2 else []), dim=3)
                query, key = parts[0], parts[1]
                value = parts[2] if kv == 2 else key
            query = query.reshape(query.size(0), query.size(1), -1, hn)
            query = self.q_layernorm(query)
            key = self.k_layernorm(key)
            value = torch.nn.functional.rms_norm(value.float(), (hn,), eps=self.config.layernorm_epsilon).to(value.dtype)
            return query, key, value

    class Gemma4Layer(TransformerLayer):
        """megatron-core's TransformerLayer whose output (residual included) is multiplied by ``layer_scalar``. With
        the MoE block its ``mlp`` is ``gemma4_moe``'s MoE layer, built here with the layer's process groups
        (megatron-core passes them only to its own MoELayer class)."""

        def __init__(self, config, submodules, *args, **kwargs):
            moe = submodules.mlp if gemma4_moe.is_moe_spec(submodules.mlp) else None
            if moe is not None:
                submodules = dataclasses.replace(submodules, mlp=IdentityOp)
            super().__init__(config, submodules, *args, **kwargs)
            if moe is not None:
                self.mlp = build_module(moe, config=self.config, pg_collection=self.pg_collection)
                self.mlp.set_layer_number(self.layer_number)
                self.is_moe_layer, self.recompute_mlp = True, False   # as megatron-core sets them for its MoELayer
            self.register_buffer("layer_scalar", torch.ones(1, dtype=self.config.params_dtype))

        def forward(self, *args, **kwargs):
            output, context = super().forward(*args, **kwargs)
            return output * self.layer_scalar.to(output.dtype), context

    _CLASSES.update(PostNormRowParallelLinear=PostNormRowParallelLinear, Gemma4Attention=Gemma4Attention,
                    Gemma4Layer=Gemma4Layer)
    return _CLASSES


class WindowSDPAttention(torch.nn.Module):
    """Causal core attention on torch SDPA with a sliding-window band on the sliding layers (``config.window_size``,
    ``window_attn_skip_freq``) and ``config.softmax_scale``; same constructor and forward as megatron-core's core
    attention; rows are causal with right padding (no mask), as ``model.SDPACoreAttention``'s."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / config.kv_channels ** 0.5
        window = config.window_size if _layer_is_sliding(config, max(1, layer_number)) else None
        self.window_left = None if window is None or window[0] < 0 else int(window[0])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        import torch.nn.functional as F
        from megatron.core import tensor_parallel

        from miles.trainer.megatron.model import no_math_sdpa

        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("WindowSDPAttention runs causal rows only (no mask, bias or packing).")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, heads, s, hn]
        p = self.dropout if self.training else 0.0
        sq, sk = q.shape[2], k.shape[2]
        kw: dict = {"is_causal": True}
        if self.window_left is not None and sk > self.window_left + 1:
            i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            j = torch.arange(sk, device=q.device)[None, :]
            kw = {"attn_mask": (j <= i) & (j >= i - self.window_left)}
        ctx = tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with ctx, (no_math_sdpa(q) if "is_causal" in kw else contextlib.nullcontext()):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.softmax_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1], **kw)
        b = query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def core_attention(shape) -> type:
    """The local spec's core attention for ``--attention-backend`` auto/flash/fused."""
    return WindowSDPAttention


def layer_spec(shape, core: type | None = None):
    """megatron-core's local GPT layer spec with Gemma 4's blocks (``core``: the core attention; None keeps
    megatron-core's unfused ``DotProductAttention``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    c = _classes()
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec.module = c["Gemma4Layer"]
    attn = spec.submodules.self_attention
    attn.module = type("Gemma4Attention", (c["Gemma4Attention"],), {"gemma": shape.variant})
    if core is not None:
        attn.submodules.core_attention = core
    attn.submodules.linear_proj = c["PostNormRowParallelLinear"]
    if shape.num_experts:                 # the MoE block: the raw residual into gemma4_moe's MoE layer
        from megatron.core.transformer.identity_op import IdentityOp

        spec.submodules.pre_mlp_layernorm = IdentityOp
        spec.submodules.mlp = gemma4_moe.mlp_spec(c["PostNormRowParallelLinear"])
    else:
        spec.submodules.mlp.submodules.linear_fc2 = c["PostNormRowParallelLinear"]
    return spec


def after_build(model, shape) -> None:
    """The embedding scaled by sqrt(hidden) in its weight's dtype (transformers' Gemma4TextScaledWordEmbedding), and
    the GPTModel's RoPE (the sliding layers') at ``sliding_attention.rope_theta``."""
    g = shape.variant
    emb = getattr(model, "embedding", None)
    if emb is not None:
        scale = shape.hidden_size ** 0.5

        def _scale(module, args, output):
            return output * torch.tensor(scale, dtype=module.word_embeddings.weight.dtype, device=output.device)

        emb.register_forward_hook(_scale)
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None:
        dim = shape.kv_channels
        rope.inv_freq = 1.0 / (g.sliding_theta ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                                device=rope.inv_freq.device).float() / dim))
        rope.forward.cache_clear()


def exported_buffers(model) -> list[tuple[str, torch.Tensor]]:
    """``layer_scalar`` of each layer (a buffer, exported and loaded with the parameters)."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith(".layer_scalar")]


# ------------------------------------------------------------------------------------------- names
def _qkv_rows(shape, layer: int) -> tuple[int, int, bool, int]:
    """(query rows per group, head size, K=V, groups) of layer ``layer`` (0-based)."""
    g = shape.variant
    if g.sliding_layers[layer]:
        return shape.num_attention_heads // shape.num_query_groups * shape.kv_channels, shape.kv_channels, False, \
            shape.num_query_groups
    return shape.num_attention_heads // g.global_kv_heads * g.global_head_dim, g.global_head_dim, g.k_eq_v, \
        g.global_kv_heads


def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor], shape) -> torch.Tensor | None:
    """The full megatron tensor of layer parameter ``suffix`` from the HF state dict (text decoder names: callers
    strip ``model.language_model.`` to ``model.``); ``prefix`` is 'model.layers.L.'."""
    if suffix in _OWN:
        return hf[prefix + _OWN[suffix]]
    if shape.num_experts and (t := gemma4_moe.hf_to_megatron(suffix, prefix, hf)) is not None:
        return t
    if suffix == "self_attention.linear_q.weight":          # a full layer with its KV heads replicated over TP
        return hf[prefix + "self_attn.q_proj.weight"]
    if suffix == "self_attention.linear_kv.weight":         # ... [k; v] per KV head ([k] with K=V)
        _, hn, k_eq_v, ng = _qkv_rows(shape, int(prefix.split(".")[2]))
        return kv_replicate.hf_linear_kv([hf[prefix + f"self_attn.{x}_proj.weight"] for x in ("k" if k_eq_v else "kv")],
                                         ng, hn)
    if suffix == "self_attention.linear_qkv.weight":
        q_rows, hn, k_eq_v, ng = _qkv_rows(shape, int(prefix.split(".")[2]))
        parts = [hf[prefix + "self_attn.q_proj.weight"].reshape(ng, q_rows, -1),
                 hf[prefix + "self_attn.k_proj.weight"].reshape(ng, hn, -1)]
        if not k_eq_v:
            parts.append(hf[prefix + "self_attn.v_proj.weight"].reshape(ng, hn, -1))
        return torch.cat(parts, dim=1).reshape(-1, parts[0].shape[-1])
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]], dim=0)
    return None


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor, shape) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors (text decoder names, ``model.layers.L.*``) of a full megatron layer tensor."""
    if suffix in _OWN:
        return [(prefix + _OWN[suffix], full)]
    if shape.num_experts and (pairs := gemma4_moe.megatron_to_hf(suffix, prefix, full)) is not None:
        return pairs
    if suffix == "self_attention.linear_q.weight":
        return [(prefix + "self_attn.q_proj.weight", full)]
    if suffix == "self_attention.linear_kv.weight":
        _, hn, k_eq_v, ng = _qkv_rows(shape, int(prefix.split(".")[2]))
        return [(f"{prefix}self_attn.{x}_proj.weight", t) for x, t in zip("kv", kv_replicate.split_linear_kv(full, ng, hn))]
    if suffix == "self_attention.linear_qkv.weight":
        q_rows, hn, k_eq_v, ng = _qkv_rows(shape, int(prefix.split(".")[2]))
        sizes = [q_rows, hn] + ([] if k_eq_v else [hn])
        parts = full.reshape(ng, sum(sizes), -1).split(sizes, dim=1)
        return [(f"{prefix}self_attn.{x}_proj.weight", t.reshape(-1, full.shape[-1])) for x, t in zip("qkv", parts)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    return None


def text_prefix(shape) -> str | None:
    """A multimodal checkpoint's text decoder names are under ``model.language_model.`` (None: ``model.``)."""
    return LM_PREFIX if shape.variant.multimodal else None


FAMILY = Family(name="Gemma 4", model_types=MODEL_TYPES, shape_fields=shape_fields, config_kwargs=config_kwargs,
                prepare=prepare, core_attention=core_attention, local_spec=layer_spec, after_build=after_build,
                hf_to_megatron=hf_to_megatron, megatron_to_hf=megatron_to_hf, text_prefix=text_prefix,
                exported_buffers=exported_buffers, check_flags=check_flags, check_static=check_static,
                column=(*kv_replicate.COLUMN, gemma4_moe.SHARED_FC1), row=(gemma4_moe.SHARED_FC2,),
                glu_fc1=(gemma4_moe.SHARED_FC1,), tp_partial=kv_replicate.TP_PARTIAL,
                export_stream=gemma4_moe.export_stream, swiglu=False, bridge_only=True)
