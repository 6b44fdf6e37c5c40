"""Inkling's text decoder on megatron-core: our own torch modules where megatron-core 0.16.1 has none (the design
note is ``families/inkling.py``'s docstring), megatron-core's where it has them.

    model = build_inkling_model(shape, config, padded_vocab=V, device=dev)   # HiddenInklingModel
    hidden = model(input_ids, position_ids, attention_mask=None)            # [s (/ tp under SP), b, h]

megatron-core's: the vocabulary-parallel embedding (``LanguageModelEmbedding``), the output layer
(``ColumnParallelLinear``) and the tensor-parallel mappings. Ours, in torch (CPU and GPU alike): the RMS norms
(fp32, as transformers keeps them), the short causal convolutions (``ShortConv``: depthwise, with their residual,
fp32), the attention with its relative-position logits (``InklingAttention``: per-head q/k RMS norms, a 1/d scale,
a bias per backward distance mixed from ``r_proj``'s states, a sliding window on ``hybrid_sliding`` layers, log
scaling of the full layers' logits), the dense MLP with its ``global_scale`` and the MoE (``InklingMoE``: sigmoid
router whose shared experts take part in the weights' normalisation as a "sink"). Every formula follows transformers
5.24's ``modeling_inkling`` (stateless: full rows, right padding, no cache).

Parallelism. The decoder runs on the whole sequence on every TP rank: under ``--sequence-parallel`` the embedding's
sequence shards are gathered at the entry and the final hidden states split again at the exit (the short
convolutions mix neighbouring tokens, so the decoder does not split the sequence; activations are not saved by SP
here). TP splits the attention heads (``linear_q/k/v/r`` rows and the K/V convolutions' channels by head,
``linear_proj`` columns) and the dense MLP (``linear_fc1`` by [gate; up] halves, ``linear_fc2`` columns), each
summed over TP by megatron-core's reduce. The MoE layer splits the tokens over TP instead (each rank routes and runs
its part through the whole experts, then the outputs are gathered): the experts' gradients are summed over the
expert-data-parallel group as megatron-core's experts' are (``moe.edp_reduced``), the router's and the shared
experts' are marked ``sequence_parallel`` (summed over TP by ``parallel.finish_grads``). The q/k norms and the
relative-logit profiles see their heads only on each rank: ``tp_partial``. Expert parallelism: each EP rank holds
``num_experts / ep`` of the routed experts (its rows of the stacked ``experts.gate_up_proj`` / ``down_proj``); the
router and the shared experts run on each rank's own tokens, and the routed (token, slot) pairs reach the experts as
``--moe-token-dispatcher-type`` says for megatron-core's MoE (``config.moe_token_dispatcher_type``; alltoall under
EP > 1 when the flag is absent), in torch (``inkling_ep.py``): ``alltoall`` sends each pair only to the rank holding
its expert and the weighted outputs back (``dist.all_to_all_single``), ``allgather`` gathers the EP group's tokens
(padded to the longest rank's count), runs each rank's experts on all of them and reduce-scatters the outputs back;
``flex`` (DeepEP) is refused (``inkling.check_static``).

Cost: the attention is computed as transformers' eager path computes it, the [b, heads / tp, s, s] scores and
relative bias materialised per layer (memory quadratic in the row length; no fused kernel or flex-attention
``score_mod`` is built here, where Miles uses its own Triton / flex kernels), and the MoE loops over the experts its
tokens reach. Correct on CPU and GPU alike; long rows on a GPU need activation recompute or shorter micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.trainer.megatron.families.inkling_ep import DISPATCH, EPGroup


class RMSNorm(nn.Module):
    """transformers' ``InklingRMSNorm``: normalised in fp32, cast back, times the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


class ShortConv(nn.Module):
    """transformers' ``InklingShortConvolution`` on full rows: a causal depthwise convolution of ``kernel`` taps
    over the sequence plus its input, in fp32. ``weight`` [channels, 1, kernel] (the checkpoint's ``conv1d.weight``)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, c] -> [b, s, c]."""
        h = x.float()
        k = self.weight.shape[-1]
        out = F.conv1d(h.transpose(1, 2), self.weight.float(), padding=k - 1, groups=h.shape[-1])[..., :h.shape[1]]
        return (out.transpose(1, 2) + h).to(x.dtype)


def _mark_sequence_parallel(module: nn.Module) -> None:
    """Each TP rank sees its part of the tokens: the gradient is summed over TP (``parallel.finish_grads``)."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = True


class _TP:
    """The tensor-parallel mappings of one TP group (identity at TP 1)."""

    def __init__(self, size: int, group):
        self.size, self.group = size, group

    def copy(self, x: torch.Tensor) -> torch.Tensor:          # forward identity, backward all-reduce
        if self.size == 1:
            return x
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        return copy_to_tensor_model_parallel_region(x, group=self.group)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:        # forward all-reduce, backward identity
        if self.size == 1:
            return x
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
        return reduce_from_tensor_model_parallel_region(x, group=self.group)

    def split(self, x: torch.Tensor) -> torch.Tensor:         # dim 0: forward this rank's part, backward all-gather
        if self.size == 1:
            return x
        from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
        return scatter_to_sequence_parallel_region(x, group=self.group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:        # dim 0: forward all-gather, backward this rank's part
        if self.size == 1:
            return x
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.group)


class RelativeLogits(nn.Module):
    """transformers' ``InklingRelativeLogits``: ``proj`` [d_rel, extent], a bank of bias-vs-distance profiles each
    head's relative states mix into one bias per backward distance (0 outside ``0 <= distance < extent``)."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(d_rel, extent, dtype=torch.float32))

    def forward(self, states: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """states [b, s, heads, d_rel], distance [s, s] (query - key) -> bias [b, heads, s, s]."""
        extent = self.proj.shape[1]
        rel = (states @ self.proj.to(states.dtype)).transpose(1, 2)                    # [b, heads, s, extent]
        index = distance.clamp(0, extent - 1).expand(*rel.shape[:2], -1, -1)
        return rel.gather(-1, index).masked_fill((distance < 0) | (distance >= extent), 0.0)


class InklingAttention(nn.Module):
    """One layer's attention (this TP rank's heads). Names: ``linear_q/k/v/r`` (transformers' ``q/k/v/r_proj``),
    ``k_conv``/``v_conv`` (``k_sconv``/``v_sconv``), ``q_layernorm``/``k_layernorm``, ``rel_logits.proj``,
    ``linear_proj`` (``o_proj``)."""

    def __init__(self, s, layer: int, tp: _TP):
        super().__init__()
        g = s.variant
        sliding = g.sliding[layer]
        heads = g.swa_heads if sliding else s.num_attention_heads
        kv = g.swa_kv_heads if sliding else s.num_query_groups
        hd = g.swa_head_dim if sliding else s.kv_channels
        self.tp, self.hd = tp, hd
        self.heads, self.kv = heads // tp.size, kv // tp.size
        self.window = g.sliding_window if sliding else None
        self.log_floor = None if sliding else g.log_scaling_n_floor
        self.log_alpha = g.log_scaling_alpha
        h = s.hidden_size
        self.linear_q = nn.Linear(h, self.heads * hd, bias=False)
        self.linear_k = nn.Linear(h, self.kv * hd, bias=False)
        self.linear_v = nn.Linear(h, self.kv * hd, bias=False)
        self.linear_r = nn.Linear(h, self.heads * g.d_rel, bias=False)
        self.linear_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.k_conv = ShortConv(self.kv * hd, g.conv_kernel)
        self.v_conv = ShortConv(self.kv * hd, g.conv_kernel)
        self.q_layernorm = RMSNorm(hd, s.norm_epsilon)
        self.k_layernorm = RMSNorm(hd, s.norm_epsilon)
        self.rel_logits = RelativeLogits(g.d_rel, g.sliding_window if sliding else g.rel_extent)

    recompute_core = False          # megatron-core's selective recompute: the [s, s] part recomputed in the backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] (whole on every TP rank) -> [b, s, h]."""
        x = self.tp.copy(x)
        b, s, _ = x.shape
        q = self.q_layernorm(self.linear_q(x).view(b, s, self.heads, self.hd)).transpose(1, 2)
        k = self.k_layernorm(self.k_conv(self.linear_k(x)).view(b, s, self.kv, self.hd)).transpose(1, 2)
        v = self.v_conv(self.linear_v(x)).view(b, s, self.kv, self.hd).transpose(1, 2)
        r = self.linear_r(x).view(b, s, self.heads, -1)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(self._core, q, k, v, r, use_reentrant=False)
        else:
            out = self._core(q, k, v, r)
        return self.tp.reduce(self.linear_proj(out))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, d], k / v [b, kv, s, d], the relative states r [b, s, heads, d_rel] -> [b, s, heads d]:
        the relative bias, the scores and their softmax (the [b, heads, s, s] tensors)."""
        b, _, s, _ = q.shape
        pos = torch.arange(s, device=q.device)
        distance = pos[:, None] - pos[None, :]
        bias = self.rel_logits(r, distance)
        if self.log_floor is not None:                           # transformers: in fp32
            tau = (1.0 + self.log_alpha * torch.log(((pos + 1).float() / self.log_floor).clamp(min=1.0))).view(
                1, 1, -1, 1)
            q = (q.float() * tau).to(q.dtype)
            bias = (bias.float() * tau).to(bias.dtype)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        blocked = distance < 0
        if self.window is not None:
            blocked = blocked | (distance >= self.window)
        scores = torch.matmul(q, k.transpose(2, 3)) / self.hd + bias
        scores = scores.masked_fill(blocked, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)


class DenseMLP(nn.Module):
    """transformers' ``InklingMLP``: ``linear_fc1`` [gate; up] (this rank's halves), ``linear_fc2``, ``global_scale``."""

    def __init__(self, s, tp: _TP):
        super().__init__()
        inter = s.ffn_hidden_size // tp.size
        self.tp = tp
        self.linear_fc1 = nn.Linear(s.hidden_size, 2 * inter, bias=False)
        self.linear_fc2 = nn.Linear(inter, s.hidden_size, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(self.tp.copy(x)).chunk(2, dim=-1)
        return self.tp.reduce(self.linear_fc2(F.silu(gate) * up)) * self.global_scale.to(x.dtype)


class Router(nn.Module):
    """transformers' ``InklingTopkRouter``: ``weight`` [experts + shared, h], ``global_scale`` [1], the frozen
    ``expert_bias`` buffer [experts] (the checkpoint's ``e_score_correction_bias``). Routing replay (R3 / R2,
    ``miles.trainer.routing_replay``): it asks ``router_replay`` for its experts as megatron-core's ``TopKRouter`` does
    (``replays_routing``), over its tokens in megatron-core's order ([s, b], this TP rank's part under SP); the
    weights come from the current logits at those experts."""

    replays_routing = True
    router_replay = None

    def __init__(self, s, config):
        super().__init__()
        g = s.variant
        self.config = config
        self.topk, self.shared, self.route_scale = s.moe_router_topk, g.n_shared_experts, g.route_scale
        self.weight = nn.Parameter(torch.zeros(s.num_experts + g.n_shared_experts, s.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(s.num_experts, dtype=torch.float32))
        _mark_sequence_parallel(self)

    def forward(self, x: torch.Tensor):
        """x [n, h] -> (routed weights [n, k], expert ids [n, k], shared weights [n, shared]), in x's dtype."""
        logits = F.linear(x.float(), self.weight.float())
        routed, shared = logits[:, :-self.shared], logits[:, -self.shared:]
        scores = routed.sigmoid() + self.expert_bias.float()

        def own(sc, k, num_groups=None, group_topk=None):
            idx = torch.topk(sc, k, dim=-1, sorted=False).indices
            return sc.gather(1, idx), idx
        if self.router_replay is not None:
            ids = self.router_replay.get_replay_topk(scores, self.topk, None, None, own)[1]
        else:
            ids = own(scores, self.topk)[1]
        chosen = F.logsigmoid(torch.cat([routed.gather(-1, ids), shared], dim=-1))
        weights = torch.exp(chosen - torch.logsumexp(chosen, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(x.dtype)
        return weights[:, :self.topk], ids, weights[:, self.topk:]


class InklingMoE(nn.Module):
    """transformers' ``InklingMoE``: the router, the routed experts (``experts.gate_up_proj`` [E, 2I, h] = [gate; up]
    per expert, ``experts.down_proj`` [E, h, I]) and the shared experts (``sink_experts.gate_up_proj`` [S, 2I, h] =
    [gate; up] per expert, ``down_proj`` [S, h, I]) weighted by the router's sink weights. Tokens split over TP (module
    docstring); under EP the tokens reach the experts by ``dispatcher`` (``inkling_ep.DISPATCH``: alltoall or
    allgather, ``--moe-token-dispatcher-type`` as megatron-core's config holds it)."""

    def __init__(self, s, config, tp: _TP, ep: EPGroup, dispatcher: str = "alltoall"):
        super().__init__()
        g = s.variant
        e, i, h, sh = s.num_experts, s.moe_ffn_hidden_size, s.hidden_size, g.n_shared_experts
        if dispatcher not in DISPATCH:
            raise ValueError(f"Inkling's MoE dispatches by {' or '.join(DISPATCH)}, not {dispatcher!r} "
                             "(--moe-token-dispatcher-type flex is refused at config time: families/inkling.py)")
        self.tp, self.ep, self.dispatcher = tp, ep, dispatcher
        self.router = Router(s, config)
        self.experts = nn.Module()                  # this EP rank's experts (all of them at EP 1)
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(e // ep.size, 2 * i, h))
        self.experts.down_proj = nn.Parameter(torch.zeros(e // ep.size, h, i))
        self.sink_experts = nn.Module()
        self.sink_experts.gate_up_proj = nn.Parameter(torch.zeros(sh, 2 * i, h))
        self.sink_experts.down_proj = nn.Parameter(torch.zeros(sh, h, i))
        _mark_sequence_parallel(self.sink_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.transpose(0, 1).reshape(-1, h)                       # [s b, h]: SP's token order
        n = flat.shape[0]
        pad = -n % self.tp.size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, h)])
        flat = self.tp.split(flat)                                    # this rank's tokens
        weights, ids, gammas = self.router(flat)
        if self.ep.size == 1:
            out = self._routed(flat, weights, ids)
        else:
            out = DISPATCH[self.dispatcher](self._routed, flat, weights, ids, self.ep, self.experts.gate_up_proj.shape[0])
        sk = self.sink_experts
        hs = flat.unsqueeze(0).expand(sk.gate_up_proj.shape[0], -1, -1)
        gate, up = torch.bmm(hs, sk.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        act = F.silu(gate) * up
        act = act * gammas.t().unsqueeze(-1)
        out = out + torch.bmm(act, sk.down_proj.transpose(1, 2)).float().sum(0).to(out.dtype)
        return self.tp.gather(out)[:n].view(s, b, h).transpose(0, 1)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """The routed experts' weighted sum for tokens ``x`` [n, h] routed to ``ids`` [n, k] (this rank's experts
        ``first ..``; the others' slots add nothing here)."""
        out = torch.zeros_like(x)
        ex = self.experts
        local = ex.gate_up_proj.shape[0]
        for e in torch.unique(ids).tolist():
            if not first <= e < first + local:
                continue
            rows, slot = torch.where(ids == e)
            gate, up = F.linear(x[rows], ex.gate_up_proj[e - first]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, ex.down_proj[e - first]) * weights[rows, slot, None]
            out = out.index_add(0, rows, y.to(out.dtype))
        return out


class InklingLayer(nn.Module):
    """transformers' ``InklingDecoderLayer``: norm -> attention -> ``attn_conv`` -> residual; norm -> MLP / MoE ->
    ``mlp_conv`` -> residual."""

    def __init__(self, s, config, layer: int, tp: _TP, ep: EPGroup):
        super().__init__()
        g = s.variant
        self.layer_number = layer + 1             # megatron-core's (1-based)
        self.input_layernorm = RMSNorm(s.hidden_size, s.norm_epsilon)
        self.self_attention = InklingAttention(s, layer, tp)
        self.attn_conv = ShortConv(s.hidden_size, g.conv_kernel)
        self.pre_mlp_layernorm = RMSNorm(s.hidden_size, s.norm_epsilon)
        self.mlp = InklingMoE(s, config, tp, ep, config.moe_token_dispatcher_type) if s.moe_layer_pattern[layer] \
            else DenseMLP(s, tp)
        self.mlp_conv = ShortConv(s.hidden_size, g.conv_kernel)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn_conv(self.self_attention(self.input_layernorm(h)))
        return h + self.mlp_conv(self.mlp(self.pre_mlp_layernorm(h)))


# megatron-core's TP split dim of our TP-split tensors, for the torch_dist checkpoint's layout
TP_AXES = {"self_attention.linear_q.weight": 0, "self_attention.linear_k.weight": 0,
           "self_attention.linear_v.weight": 0, "self_attention.linear_r.weight": 0,
           "self_attention.k_conv.weight": 0, "self_attention.v_conv.weight": 0,
           "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1}


def _sharded(module: nn.Module, prefix: str, sharded_offsets, metadata, axes: dict[str, int],
             ep: EPGroup | None = None) -> dict:
    """megatron-core's sharded state dict of ``module``'s parameters and buffers: those in ``axes`` split over TP
    on their axis, the rest replicated; under EP the routed experts (``mlp.experts.*``) split over EP on their expert
    axis (dim 0), replicated over the expert-data-parallel group, as megatron-core's experts are."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state = module.state_dict(prefix="", keep_vars=True)
    experts = {k: state.pop(k) for k in list(state) if ep is not None and ep.size > 1 and k.startswith("mlp.experts.")}
    out = make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets,
                                              tp_group=parallel_state.get_tensor_model_parallel_group(),
                                              dp_cp_group=metadata["dp_cp_group"])
    edp = parallel_state.get_expert_data_parallel_rank() if experts else 0
    for k, t in experts.items():
        out[f"{prefix}{k}"] = ShardedTensor.from_rank_offsets(
            f"{prefix}{k}", t, *sharded_offsets, (len(sharded_offsets), ep.rank, ep.size), replica_id=(0, 0, edp),
            prepend_axis_num=len(sharded_offsets))
    return out


def build_inkling_model(s, config, *, padded_vocab: int, device: torch.device):
    """A ``HiddenInklingModel`` of ``s`` (a ``ModelShape`` with ``inkling.InklingShape``) on ``device``; weights are
    loaded by ``convert.load_hf_into`` through the family's names."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.module import MegatronModule

    size = config.tensor_model_parallel_size
    tp = _TP(size, parallel_state.get_tensor_model_parallel_group() if size > 1 else None)
    sp = bool(config.sequence_parallel) and size > 1
    eps = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    ep = EPGroup(eps, parallel_state.get_expert_model_parallel_rank() if eps > 1 else 0,
             parallel_state.get_expert_model_parallel_group() if eps > 1 else None)
    g = s.variant

    class _Decoder(nn.Module):
        """``decoder.layers`` and ``decoder.final_layernorm`` (GPTModel's names)."""

    class HiddenInklingModel(MegatronModule):
        """Embedding -> its RMS norm -> layers -> final norm, divided by ``logits_mup_width_multiplier`` (what
        transformers does before its head): hidden states [s, b, h] (``[s / tp, b, h]`` under sequence
        parallelism), as ``model.HiddenGPTModel`` returns them."""

        share_embeddings_and_output_weights = False
        mtp_training = False
        mtp_process = False

        def __init__(self):
            super().__init__(config=config)
            self.shape = s
            self.pre_process = self.post_process = True
            self.embedding = LanguageModelEmbedding(config, vocab_size=padded_vocab,
                                                    max_sequence_length=s.max_position_embeddings,
                                                    position_embedding_type="rope")
            self.embedding_norm = RMSNorm(s.hidden_size, s.norm_epsilon)
            self.decoder = _Decoder()
            self.decoder.layers = nn.ModuleList(InklingLayer(s, config, i, tp, ep) for i in range(s.num_layers))
            self.decoder.final_layernorm = RMSNorm(s.hidden_size, s.norm_epsilon)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                s.hidden_size, padded_vocab, config=config, init_method=config.init_method, bias=False,
                gather_output=False, skip_bias_add=False)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
            out: dict = {}
            for name, child in self.named_children():
                if name == "decoder":
                    for i, layer in enumerate(child.layers):
                        out.update(_sharded(layer, f"{prefix}decoder.layers.{i}.", sharded_offsets, metadata,
                                            TP_AXES, ep))
                    out.update(_sharded(child.final_layernorm, f"{prefix}decoder.final_layernorm.", sharded_offsets,
                                        metadata, {}))
                elif name in ("embedding", "output_layer"):
                    out.update(child.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
                else:
                    out.update(_sharded(child, f"{prefix}{name}.", sharded_offsets, metadata, {}))
            return out

        def _layers(self, h: torch.Tensor) -> torch.Tensor:
            """The decoder layers; with megatron-core's full recompute (``--recompute-granularity full``) each chunk
            of ``recompute_num_layers`` layers (``uniform``), or the first ``recompute_num_layers`` layers one by
            one (``block``), recomputed in the backward (torch's checkpoint: CPU and GPU alike)."""
            from torch.utils.checkpoint import checkpoint

            layers = list(self.decoder.layers)
            if not (config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()):
                for layer in layers:
                    h = layer(h)
                return h
            n = max(int(config.recompute_num_layers or 1), 1)

            def run(chunk, x):
                for layer in chunk:
                    x = layer(x)
                return x
            if config.recompute_method == "block":
                chunks = [[layer] for layer in layers[:n]] + [layers[n:]]
                for i, chunk in enumerate(chunks):
                    h = checkpoint(run, chunk, h, use_reentrant=False) if i < n else run(chunk, h)
                return h
            for j in range(0, len(layers), n):
                h = checkpoint(run, layers[j:j + n], h, use_reentrant=False)
            return h

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, **_):
            if attention_mask is not None:
                raise NotImplementedError("the Inkling model runs causal right-padded rows (no mask)")
            x = self.embedding(input_ids=input_ids, position_ids=None)               # [s (/ tp), b, h]
            if sp:
                x = tp.gather(x)                                                     # the whole sequence
            h = self.embedding_norm(x.transpose(0, 1))                               # [b, s, h]
            h = self._layers(h)
            h = (self.decoder.final_layernorm(h) / g.mup_width_multiplier).transpose(0, 1).contiguous()
            return tp.split(h) if sp else h

    model = HiddenInklingModel()
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for layer in model.decoder.layers:       # megatron-core's marks on our TP-split parameters
        for name, p in layer.named_parameters():
            if name in TP_AXES:
                set_tensor_model_parallel_attributes(p, is_parallel=size > 1, dim=TP_AXES[name], stride=1)
    if config.recompute_granularity == "selective":           # megatron-core's: the attention's core, recomputed
        for attn in (m for m in model.modules() if isinstance(m, InklingAttention)):
            attn.recompute_core = True
    for mod in model.modules():        # linears and experts in the parameters' dtype; norms, convolutions,
        if type(mod) is nn.Linear:     # relative-logit profiles and scales stay fp32 (as transformers keeps them)
            mod.to(config.params_dtype)
    for moe in (m for m in model.modules() if isinstance(m, InklingMoE)):
        moe.experts.to(config.params_dtype)
        moe.sink_experts.to(config.params_dtype)
        moe.router.weight.data = moe.router.weight.data.to(config.params_dtype)
    return model.to(device)
