"""Gemma 4's MoE block (gemma-4-26B-A4B: ``enable_moe_block``) on megatron-core's ``MoELayer``, and its HF names.

    fields = moe_fields(text_config)       # ModelShape's MoE fields (empty without enable_moe_block)
    spec = mlp_spec(post_norm_linear)      # the layer's ``mlp``: Gemma4MoELayer with its router, experts, dense MLP
    kw = config_kwargs(shape)              # the TransformerConfig arguments the block adds

transformers 5.24's ``Gemma4TextDecoderLayer`` with ``enable_moe_block`` (``x``: the residual after attention):

    dense   = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))          # GeGLU, intermediate_size
    w, idx  = router(x)                                                                # the raw residual
    experts = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), idx, w))
    out     = x + post_feedforward_layernorm(dense + experts)       # (then layer_scalar, as every Gemma 4 layer)

``router(x)``: ``z = rmsnorm(x) * scale * hidden_size ** -0.5`` (an RMSNorm without weight, in fp32, then the learned
``scale`` [H]), logits ``proj(z)``, softmax in fp32, top-k (``top_k_experts``), the k weights renormalised to sum to
one, then each multiplied by ``per_expert_scale[expert]`` [E]. ``experts``: GeGLU per expert
(``gate_up_proj`` [E, 2I, H] with the gate rows first, ``down_proj`` [E, H, I]), each output times its weight, summed.

What builds each part here (megatron-core's blocks, our own module only for what it lacks):

- the layer's ``pre_mlp_layernorm``: ``IdentityOp``, since the router and both branches read the raw residual, each
  through its own norm; the layer's ``mlp``: ``Gemma4MoELayer``, megatron-core's ``MoELayer`` (its dispatcher,
  ``SequentialMLP`` experts, ``SharedExpertMLP``) with the four norms megatron-core has no place for:
  ``pre_dense_norm`` (pre_feedforward_layernorm) on the shared expert's input, ``pre_experts_norm``
  (pre_feedforward_layernorm_2) on the tokens before they are dispatched, ``post_experts_norm``
  (post_feedforward_layernorm_2) on the combined expert output, ``post_norm`` (post_feedforward_layernorm) on the sum.
- the dense MLP: megatron-core's shared expert (``moe_shared_expert_intermediate_size`` = ``intermediate_size``, no
  gate): the same GeGLU as a dense Gemma 4 layer's MLP, its output normed (post_feedforward_layernorm_1) by the
  family's ``PostNormRowParallelLinear`` after the TP reduction.
- the router: ``Gemma4Router``, megatron-core's ``TopKRouter`` (softmax over the top-k logits = transformers' softmax,
  top-k, renormalised; ``moe_router_pre_softmax`` off) whose gating first applies the weightless RMSNorm, ``scale``
  and ``hidden_size ** -0.5``, and whose routing multiplies the top-k weights by ``per_expert_scale``. Routing replay
  (R2/R3) goes through megatron-core's ``router_replay`` as for every TopKRouter.
- experts: megatron-core's ``SequentialMLP`` on the local spec's linears (GeGLU, ``moe_ffn_hidden_size`` =
  ``moe_intermediate_size``); the routing weight scales the activation before ``linear_fc2`` (linear, so the same sum).

Tensor parallelism: attention and the dense MLP split over TP, the experts whole (``--expert-tensor-parallel-size
1``), tokens routed per TP rank under sequence parallelism (``moe.py``); the norms, ``scale`` and ``per_expert_scale``
are replicated and marked ``sequence_parallel`` (their gradient summed over TP, each rank having seen its part of the
sequence). Expert parallelism: megatron-core's all-to-all dispatcher, as for every MoE family here.

Weights (HF suffix under ``model.layers.L.``; ``model.language_model.layers.L.`` in the multimodal checkpoint):
``router.proj.weight`` = ``mlp.router.weight``, ``router.scale`` / ``router.per_expert_scale`` =
``mlp.router.scale`` / ``mlp.router.per_expert_scale``, ``experts.gate_up_proj[e]`` = expert e's ``linear_fc1``
([gate; up] rows, as megatron-core's GLU reads them), ``experts.down_proj[e]`` = its ``linear_fc2``,
``mlp.{gate,up}_proj`` = ``mlp.shared_experts.linear_fc1`` ([gate; up]), ``mlp.down_proj`` =
``mlp.shared_experts.linear_fc2``, the five norms as above. The export gives each expert's slice under
``<fused name>#<e>`` and joins a layer's slices into the fused tensor (``gpt_oss.fuse_experts``): slicing and
stacking only, so the round trip is bitwise.
"""

from __future__ import annotations

import re

import torch

_OWN = {  # megatron suffix -> HF suffix, per MoE layer
    "mlp.router.weight": "router.proj.weight",
    "mlp.router.scale": "router.scale",
    "mlp.router.per_expert_scale": "router.per_expert_scale",
    "mlp.pre_dense_norm.weight": "pre_feedforward_layernorm.weight",
    "mlp.pre_experts_norm.weight": "pre_feedforward_layernorm_2.weight",
    "mlp.post_experts_norm.weight": "post_feedforward_layernorm_2.weight",
    "mlp.post_norm.weight": "post_feedforward_layernorm.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.post_norm.weight": "post_feedforward_layernorm_1.weight",
}
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_FUSED = {"linear_fc1": "experts.gate_up_proj", "linear_fc2": "experts.down_proj"}


def _get(c, key, default=None):
    v = c.get(key, default) if isinstance(c, dict) else getattr(c, key, default)
    return default if v is None else v


# ------------------------------------------------------------------------------------------- shape
def moe_fields(t) -> dict:
    """``ModelShape``'s MoE fields of a Gemma 4 text config (every layer has the block when ``enable_moe_block``);
    empty for a dense one."""
    if not _get(t, "enable_moe_block"):
        return {}
    experts, top_k, inter = (int(_get(t, k, 0)) for k in ("num_experts", "top_k_experts", "moe_intermediate_size"))
    if not (experts and top_k and inter):
        raise ValueError(f"Gemma 4 with enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size "
                         f"(config.json has {experts}, {top_k}, {inter}).")
    return dict(num_experts=experts, moe_ffn_hidden_size=inter, moe_router_topk=top_k, moe_norm_topk_prob=True,
                moe_layer_pattern=(1,) * int(t.num_hidden_layers))


def config_kwargs(shape) -> dict:
    """The TransformerConfig arguments of the block: the dense MLP as megatron-core's (ungated) shared expert,
    ``SequentialMLP`` experts (the local spec's; ``--moe-grouped-gemm`` computes the same sums there)."""
    if not shape.num_experts:
        return {}
    return dict(moe_shared_expert_intermediate_size=shape.ffn_hidden_size, moe_shared_expert_gate=False,
                moe_shared_expert_overlap=False, moe_grouped_gemm=False)


# ------------------------------------------------------------------------------------------- model
_CLASSES: dict[str, type] = {}


def _norm(config) -> torch.nn.Module:
    """Gemma's RMSNorm (weight ``w``, fp32 statistics) over the hidden size, marked ``sequence_parallel``."""
    norm = torch.nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    norm.weight.sequence_parallel = bool(config.sequence_parallel)
    return norm


def classes() -> dict[str, type]:
    """``Gemma4Router`` and ``Gemma4MoELayer`` (built once, on first use: megatron-core is imported lazily)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    class Gemma4Router(TopKRouter):
        """megatron-core's TopKRouter on Gemma 4's router input (``rmsnorm(x) * scale / sqrt(hidden)``) with
        ``per_expert_scale`` on the top-k weights."""

        def __init__(self, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
            self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
            for p in (self.scale, self.per_expert_scale):
                p.sequence_parallel = bool(config.sequence_parallel)

        def gating(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (megatron-core's name)
            h = self.config.hidden_size
            x = torch.nn.functional.rms_norm(input.float(), (h,), eps=self.config.layernorm_epsilon).type_as(input)
            return super().gating(x * self.scale * h ** -0.5)

        replays_routing = True      # routing() is megatron-core's, which asks router_replay

        def routing(self, logits: torch.Tensor, padding_mask=None):
            probs, routing_map = super().routing(logits, padding_mask=padding_mask)
            return probs * self.per_expert_scale.to(probs.dtype), routing_map

    class Gemma4MoELayer(MoELayer):
        """megatron-core's MoELayer on the raw residual: the dense MLP (shared expert) and the experts each behind
        their own pre-norm, the experts' combined output normed, the sum normed (module docstring)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
            super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
            self.pre_dense_norm, self.pre_experts_norm = _norm(config), _norm(config)
            self.post_experts_norm, self.post_norm = _norm(config), _norm(config)

        def shared_experts_compute(self, hidden_states: torch.Tensor):
            return super().shared_experts_compute(self.pre_dense_norm(hidden_states))

        def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
            return super().preprocess(self.pre_experts_norm(hidden_states), probs, routing_map)

        def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):
            output = self.token_dispatcher.combine_postprocess(output)
            return self.post_norm(self.post_experts_norm(output) + shared_expert_output)

    _CLASSES.update(Gemma4Router=Gemma4Router, Gemma4MoELayer=Gemma4MoELayer)
    return _CLASSES


def mlp_spec(post_norm_linear: type):
    """The MoE layer's spec: ``Gemma4MoELayer`` with ``Gemma4Router``, megatron-core's local ``SequentialMLP``
    experts, and the dense MLP as its ``SharedExpertMLP`` whose ``linear_fc2`` is ``post_norm_linear`` (the
    family's RowParallelLinear with Gemma's post norm: post_feedforward_layernorm_1)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    c = classes()
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                        linear_fc2=RowParallelLinear))
    shared = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                         linear_fc2=post_norm_linear))
    return ModuleSpec(module=c["Gemma4MoELayer"], submodules=MoESubmodules(
        experts=experts, shared_experts=shared, router=c["Gemma4Router"]))


def is_moe_spec(spec) -> bool:
    """``spec`` (a layer's ``mlp`` submodule) builds megatron-core's MoELayer or a subclass."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    module = getattr(spec, "module", None)
    return isinstance(module, type) and issubclass(module, MoELayer)


# ------------------------------------------------------------------------------------------- names
def hf_to_megatron(suffix: str, prefix: str, hf: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The full megatron tensor of an MoE layer's parameter ``suffix`` (global expert index); None: not the
    block's."""
    if suffix in _OWN:
        return hf[prefix + _OWN[suffix]]
    if suffix == SHARED_FC1:
        return torch.cat([hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]], dim=0)
    m = _EXPERT.match(suffix)
    if m is None:
        return None
    return hf[prefix + _FUSED[m.group(2)]][int(m.group(1))]


def megatron_to_hf(suffix: str, prefix: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of a full megatron MoE-layer tensor (an expert's: its slice, ``<fused name>#<expert>``)."""
    if suffix in _OWN:
        return [(prefix + _OWN[suffix], full)]
    if suffix == SHARED_FC1:
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    m = _EXPERT.match(suffix)
    if m is None:
        return None
    return [(f"{prefix}{_FUSED[m.group(2)]}#{int(m.group(1))}", full)]


def export_stream(buckets, shape):
    """The weight stream with each MoE layer's expert slices joined into the fused HF tensors."""
    if not shape.num_experts:
        yield from buckets
        return
    from miles.trainer.megatron.families.gpt_oss import fuse_experts

    yield from fuse_experts(buckets, shape.num_experts)
