"""DeepSeek-V4's decoder on megatron-core: our own modules where megatron-core 0.16.1 has none (the design note is
``families/deepseek_v4.py``'s docstring), megatron-core's where it has them.

    model = build_dsv4_model(shape, config, padded_vocab=V, device=dev)    # HiddenDsv4Model
    hidden = model(input_ids, position_ids, attention_mask=None)          # [s (/ tp under SP), b, h]

megatron-core's: the vocabulary-parallel embedding (``LanguageModelEmbedding``), the output layer
(``ColumnParallelLinear``), ``MoELayer`` with its token dispatchers, ``SequentialMLP``/``TEGroupedMLP`` experts and
``SharedExpertMLP`` (the clamped SwiGLU is its ``activation_func_clamp_value``), the sequence-parallel mappings.
Ours, in torch (CPU and GPU alike): the hyper-connection streams (``HyperConnection``, ``HyperHead``), the
attention (``Dsv4Attention``: shared-KV multi-query attention with sinks over a sliding window plus compressed
entries, grouped output projection), its compressors (``Compressor``: HCA's and CSA's) and CSA's lightning indexer
(``Indexer``), the sqrtsoftplus / hash router (``deepseek_v4.Dsv4Router``, a megatron-core ``TopKRouter``).
Every formula follows transformers 5.24's ``modeling_deepseek_v4`` (stateless: full rows, no cache).

Parallelism: TP splits the attention heads (``self_attention.wq_b`` rows, ``attn_sink``), the output groups
(``wo_a`` rows by group, ``wo_b`` columns) and the shared expert; the rest of the attention (``wq_a``, ``wkv``, the
compressors, the indexer: one KV head shared by all) is replicated and runs on the whole row. TP > 1 needs
``--sequence-parallel`` (megatron-core's MoE does): the hyper-connection streams are split along the sequence, the
attention gathers its input (backward: reduce-scatter) and reduce-scatters its output. Replicated parameters see
part of the gradient on each TP rank (their tokens, or their heads): they are marked ``sequence_parallel`` so the
trainer sums them over TP. EP: megatron-core's dispatchers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------------------------- small ops


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4UnweightedRMSNorm``."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """transformers' ``DeepseekV4RMSNorm``: normalised in fp32, multiplied by the weight in fp32, cast once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin [b, s, rd / 2] at ``positions`` [b, s] (one angle per interleaved pair), in ``dtype`` as
    transformers casts them."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device, torch.float32)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x`` [b, heads, s, d] (cos/sin
    [b, s, rd / 2]), in fp32."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((rope.float() * cos) + (rot.float() * sin)).to(x.dtype)], dim=-1)


def _mark_tp_partial(module: nn.Module) -> None:
    """Each TP rank sees part of these parameters' gradient (module docstring): summed over TP by the trainer."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = True


# ------------------------------------------------------------------------------------------- mHC


class HyperConnection(nn.Module):
    """transformers' ``DeepseekV4HyperConnection``: ``fn`` [(2 + n) n, n h], ``base``, ``scale`` [3] (DeepSeek's
    ``hc_attn_fn``/``hc_attn_base``/``hc_attn_scale``). Returns (post [.., n], comb [.., n, n], collapsed)."""

    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        _mark_tp_partial(self)

    def forward(self, streams: torch.Tensor):
        hc = self.hc
        flat = rms(streams.flatten(-2).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """transformers' ``DeepseekV4HyperHead`` (DeepSeek's ``hc_head_fn``/``hc_head_base``/``hc_head_scale``)."""

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc, hc * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        _mark_tp_partial(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = rms(x.flatten(-2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


# ------------------------------------------------------------------------------------------- compressors


def _pool(kv: torch.Tensor, gate: torch.Tensor, rate: int, head_dim: int, overlap: bool):
    """Softmax-gated pooling of each window of ``rate`` tokens (kv/gate [b, n * rate, c], gate already biased per
    slot): HCA's (``overlap`` false) or CSA's overlapping windows (the previous window's first ``head_dim``
    channels, Ca, joined to this window's last ones, Cb)."""
    b, n = kv.shape[0], kv.shape[1] // rate
    kv = kv.view(b, n, rate, -1)
    gate = gate.view(b, n, rate, -1)
    if overlap:
        new_kv = kv.new_zeros((b, n, 2 * rate, head_dim))
        new_gate = gate.new_full((b, n, 2 * rate, head_dim), float("-inf"))
        new_kv[:, :, rate:] = kv[..., head_dim:]
        new_gate[:, :, rate:] = gate[..., head_dim:]
        if n > 1:
            new_kv[:, 1:, :rate] = kv[:, :-1, :, :head_dim]
            new_gate[:, 1:, :rate] = gate[:, :-1, :, :head_dim]
        kv, gate = new_kv, new_gate
    return (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)


class Compressor(nn.Module):
    """HCA's (``overlap`` false: ``kv_proj``/``gate_proj`` to ``head_dim``) or CSA's / the indexer's (``overlap``:
    to ``2 head_dim``) compressor: one entry per window of ``rate`` tokens, normalised, rotated at the window's first
    position with the compressed rotary. DeepSeek's names: ``wkv``, ``wgate``, ``ape``, ``norm``."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = head_dim * (2 if overlap else 1)
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        self.wkv = _linear(hidden, width)
        self.wgate = _linear(hidden, width)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)
        for m in (self, self.wkv, self.wgate, self.norm):
            _mark_tp_partial(m)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] -> entries [b, s // rate, head_dim]."""
        b, s, _ = x.shape
        usable = (s // self.rate) * self.rate
        if usable == 0:
            return x.new_zeros((b, 0, self.head_dim))
        kv = self.wkv(x)[:, :usable]
        gate = self.wgate(x)[:, :usable]
        n = usable // self.rate
        gate = (gate.view(b, n, self.rate, -1) + self.ape).view(b, usable, -1)
        pooled = self.norm(_pool(kv, gate, self.rate, self.head_dim, self.overlap))
        positions = (torch.arange(n, device=x.device) * self.rate).unsqueeze(0).expand(b, -1)
        cos, sin = rope_cos_sin(inv_freq, positions, pooled.dtype)
        return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at ``index_head_dim``, ``index_n_heads`` queries
    from the q latent (``wq_b``), scores ``sum_h w_h relu(q_h . k)`` (``weights_proj``), top ``index_topk`` of the
    entries a query may see; -1 marks a pick past the query's causal limit. No gradient reaches it through top-k
    (as in transformers; DeepSeek trains it with a separate KL loss against the attention, which neither backend
    has): its parameters are frozen."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, rate: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.topk, self.rate = heads, head_dim, topk, rate
        self.compressor = Compressor(hidden, head_dim, rate, True, eps)
        self.wq_b = _linear(q_lora_rank, heads * head_dim)
        self.weights_proj = _linear(hidden, heads)
        for m in (self.wq_b, self.weights_proj):
            _mark_tp_partial(m)
        for p in self.parameters():      # no gradient reaches it (top-k): frozen, so AdamW's weight decay leaves it as
            p.requires_grad_(False)      # the FSDP backend's optimizer does (a parameter without gradient is skipped)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        b, s, _ = x.shape
        keys = self.compressor(x, inv_freq)                                          # [b, t, d]
        cos, sin = rope_cos_sin(inv_freq, positions, x.dtype)
        q = apply_rope(self.wq_b(qr).view(b, s, self.heads, self.head_dim).transpose(1, 2), cos, sin).transpose(1, 2)
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)                         # [b, s, t]
        t = keys.shape[1]
        k = min(self.topk, t)
        if t == 0:
            return scores.topk(k, dim=-1).indices
        limit = ((positions + 1) // self.rate).unsqueeze(-1)                         # [b, s, 1]
        scores = scores.masked_fill(torch.arange(t, device=x.device).view(1, 1, -1) >= limit, float("-inf"))
        picks = scores.topk(k, dim=-1).indices
        return torch.where(picks >= limit, torch.full_like(picks, -1), picks)


# ------------------------------------------------------------------------------------------- attention


class Dsv4Attention(nn.Module):
    """transformers' ``DeepseekV4Attention`` (module docstring: what is split over TP). DeepSeek's names: ``wq_a``,
    ``q_norm``, ``wq_b``, ``wkv``, ``kv_norm`` (DeepSeek's ``norm``), ``wo_a``, ``wo_b``, ``attn_sink``,
    ``compressor``, ``indexer``. Its torch_dist checkpoint layout: the TP-split tensors by their split dim
    (``sharded_state_dict``), the rest replicated."""

    TP_AXES = {"wq_b.weight": 0, "wo_a.weight": 0, "wo_b.weight": 1, "attn_sink": 0}

    def __init__(self, s, layer: int, tp: int, tp_group, sequence_parallel: bool):
        super().__init__()
        g = s.variant
        self.kind = g.layer_types[layer]
        self.heads = s.num_attention_heads // tp
        self.groups = g.o_groups // tp
        self.head_dim, self.window, self.eps = g.head_dim, g.sliding_window, s.norm_epsilon
        self.o_lora_rank = g.o_lora_rank
        self.tp_group, self.sp = tp_group, sequence_parallel and tp > 1
        self.wq_a = _linear(s.hidden_size, g.q_lora_rank)
        self.q_norm = RMSNorm(g.q_lora_rank, s.norm_epsilon)
        self.wkv = _linear(s.hidden_size, g.head_dim)
        self.kv_norm = RMSNorm(g.head_dim, s.norm_epsilon)
        for m in (self.wq_a, self.q_norm, self.wkv, self.kv_norm):
            _mark_tp_partial(m)
        self.wq_b = _linear(g.q_lora_rank, self.heads * g.head_dim)                         # heads / tp
        self.wo_a = _linear(s.num_attention_heads * g.head_dim // g.o_groups, self.groups * g.o_lora_rank)  # groups / tp
        self.wo_b = _linear(self.groups * g.o_lora_rank, s.hidden_size)                     # input: groups / tp
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))         # heads / tp
        self.compressor = self.indexer = None
        if self.kind != "sliding_attention":
            csa = self.kind == "compressed_sparse_attention"
            rate = g.csa_rate if csa else g.hca_rate
            self.compressor = Compressor(s.hidden_size, g.head_dim, rate, csa, s.norm_epsilon)
            if csa:
                self.indexer = Indexer(s.hidden_size, g.q_lora_rank, g.index_n_heads, g.index_head_dim, g.index_topk,
                                       rate, s.norm_epsilon)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, self.TP_AXES,
                                                   sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_main: torch.Tensor, inv_compress: torch.Tensor):
        """x [s (/ tp under SP), b, h] -> [s (/ tp), b, h]."""
        from megatron.core.tensor_parallel.mappings import (
            gather_from_sequence_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        if self.sp:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.tp_group)
        x = x.transpose(0, 1)                                                        # [b, s, h]
        b, s, _ = x.shape
        inv = inv_main if self.compressor is None else inv_compress
        cos, sin = rope_cos_sin(inv, positions, x.dtype)
        qr = self.q_norm(self.wq_a(x))
        q = rms(self.wq_b(qr).view(b, s, self.heads, self.head_dim).transpose(1, 2), self.eps)
        q = apply_rope(q, cos, sin)                                                  # [b, heads, s, d]
        kv = apply_rope(self.kv_norm(self.wkv(x)).view(b, s, 1, self.head_dim).transpose(1, 2), cos, sin)
        i = positions.unsqueeze(-1)                                                  # [b, s, 1]
        j = positions.unsqueeze(-2)                                                  # [b, 1, s]
        mask = torch.zeros((b, s, s), dtype=q.dtype, device=x.device).masked_fill(
            (j > i) | (j <= i - self.window), float("-inf"))
        if self.compressor is not None:
            entries = self.compressor(x, inv_compress)                               # [b, t, d]
            t = entries.shape[1]
            if t:
                if self.indexer is None:                                             # HCA: every entry it may see
                    limit = ((positions + 1) // self.compressor.rate).unsqueeze(-1)
                    extra = torch.zeros((b, s, t), dtype=q.dtype, device=x.device).masked_fill(
                        torch.arange(t, device=x.device).view(1, 1, -1) >= limit, float("-inf"))
                else:                                                                # CSA: the indexer's picks
                    picks = self.indexer(x, qr, positions, inv_compress)
                    picks = torch.where(picks >= 0, picks, torch.full_like(picks, t))
                    extra = torch.full((b, s, t + 1), float("-inf"), dtype=q.dtype, device=x.device)
                    extra = extra.scatter(-1, picks, 0.0)[..., :t]
                kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
                mask = torch.cat([mask, extra], dim=-1)
        scores = torch.matmul(q, kv.transpose(2, 3)) * self.head_dim ** -0.5 + mask.unsqueeze(1)
        sinks = self.attn_sink.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, s, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        out = torch.matmul(probs.to(kv.dtype), kv)                                   # [b, heads, s, d]
        out = apply_rope(out, cos, -sin).transpose(1, 2)                             # [b, s, heads, d]
        grouped = out.reshape(b * s, self.groups, -1).transpose(0, 1)                # [g, b s, in]
        w = self.wo_a.weight.view(self.groups, self.o_lora_rank, -1).transpose(1, 2)  # [g, in, r]
        y = torch.bmm(grouped, w).transpose(0, 1).reshape(b, s, -1)
        y = self.wo_b(y).transpose(0, 1)                                             # [s, b, h], partial over TP
        if self.sp:
            return reduce_scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return y


# ------------------------------------------------------------------------------------------- layers and model


class Dsv4Layer(nn.Module):
    """One decoder layer over the hyper-connection streams [s, b, n, h]. Its torch_dist layout: each child's own
    (megatron-core's MoELayer shards its experts over EP; the attention its TP-split tensors), the rest replicated."""

    def __init__(self, s, config, layer: int, tp: int, tp_group, moe_spec):
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        g = s.variant
        self.layer = layer
        self.layer_number = layer + 1             # megatron-core's (1-based): pipeline.global_name reads it
        self.hash = layer < g.num_hash_layers
        args = (g.hc_mult, s.hidden_size, g.hc_sinkhorn_iters, g.hc_eps, s.norm_epsilon)
        self.hc_attn = HyperConnection(*args)
        self.hc_ffn = HyperConnection(*args)
        self.input_layernorm = RMSNorm(s.hidden_size, s.norm_epsilon)
        self.pre_mlp_layernorm = RMSNorm(s.hidden_size, s.norm_epsilon)
        for m in (self.input_layernorm, self.pre_mlp_layernorm):
            _mark_tp_partial(m)
        self.self_attention = Dsv4Attention(s, layer, tp, tp_group, bool(config.sequence_parallel))
        self.mlp = build_module(moe_spec, config=config)
        self.mlp.set_layer_number(layer + 1)
        self.mlp.router.set_hash(self.hash, s.vocab_size)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        return _children_sharded(self, prefix, sharded_offsets, metadata)

    def forward(self, h: torch.Tensor, positions, inv_main, inv_compress, token_ids) -> torch.Tensor:
        dtype = h.dtype
        post, comb, x = self.hc_attn(h)
        a = self.self_attention(self.input_layernorm(x), positions, inv_main, inv_compress)
        h = post.to(dtype).unsqueeze(-1) * a.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)
        post, comb, x = self.hc_ffn(h)
        self.mlp.router.token_ids = token_ids if self.hash else None
        out = self.mlp(self.pre_mlp_layernorm(x))
        m = out[0] if isinstance(out, tuple) else out
        return post.to(dtype).unsqueeze(-1) * m.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def _children_sharded(module: nn.Module, prefix: str, sharded_offsets, metadata) -> dict:
    """megatron-core's sharded state dict of ``module``'s children (each its own layout, or replicated) and of its
    ModuleLists' items."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    out: dict = {}
    for name, child in module.named_children():
        items = list(child.named_children()) if isinstance(child, nn.ModuleList) else [(None, child)]
        for i, sub in items:
            key = f"{prefix}{name}." if i is None else f"{prefix}{name}.{i}."
            out.update(sharded_state_dict_default(sub, key, sharded_offsets, metadata))
    return out


class _Decoder(nn.Module):
    """``decoder.layers`` and ``decoder.final_layernorm`` (GPTModel's names)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        return _children_sharded(self, prefix, sharded_offsets, metadata)


def build_dsv4_model(s, config, *, padded_vocab: int, device: torch.device, te: bool = False):
    """A ``HiddenDsv4Model`` of ``s`` (a ``ModelShape`` with ``dsv4``) on ``device``; weights are loaded by
    ``deepseek_v4.load_hf_into``."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.module import MegatronModule

    from miles.trainer.megatron.families import deepseek_v4

    g = s.variant
    tp = config.tensor_model_parallel_size
    if tp > 1 and not config.sequence_parallel:
        raise ValueError("DeepSeek-V4 with tensor parallelism needs sequence parallelism (its MoE layers do)")
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    moe_spec = get_moe_module_spec(use_te=te, num_experts=s.num_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    moe_spec.submodules.router = deepseek_v4.router_class()

    class HiddenDsv4Model(MegatronModule):
        """Embedding -> ``hc_mult`` streams -> layers -> ``HyperHead`` -> final norm: hidden states [s, b, h]
        (``[s / tp, b, h]`` under sequence parallelism), as ``model.HiddenGPTModel`` returns them."""

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
            layers = [Dsv4Layer(s, config, i, tp, tp_group, moe_spec) for i in range(s.num_layers)]
            self.decoder = _Decoder()
            self.decoder.layers = nn.ModuleList(layers)
            self.decoder.final_layernorm = RMSNorm(s.hidden_size, s.norm_epsilon)
            _mark_tp_partial(self.decoder.final_layernorm)
            self.hc_head = HyperHead(g.hc_mult, s.hidden_size, g.hc_eps, s.norm_epsilon)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                s.hidden_size, padded_vocab, config=config, init_method=config.init_method, bias=False,
                gather_output=False, skip_bias_add=False)
            self.register_buffer("inv_main", deepseek_v4.inv_freq(s, "main"), persistent=False)
            self.register_buffer("inv_compress", deepseek_v4.inv_freq(s, "compress"), persistent=False)

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, **_):
            if attention_mask is not None:
                raise NotImplementedError("the DeepSeek-V4 model runs causal right-padded rows (no mask)")
            x = self.embedding(input_ids=input_ids, position_ids=None)               # [s (/ tp), b, h]
            ids = input_ids.t()                                                      # [s, b]
            if config.sequence_parallel and tp > 1:
                r, n = parallel_state.get_tensor_model_parallel_rank(), ids.shape[0] // tp
                ids = ids[r * n:(r + 1) * n]
            token_ids = ids.reshape(-1)
            h = x.unsqueeze(-2).expand(-1, -1, g.hc_mult, -1).contiguous()           # [s, b, n, h]
            for layer in self.decoder.layers:
                h = layer(h, position_ids, self.inv_main, self.inv_compress, token_ids)
            return self.decoder.final_layernorm(self.hc_head(h))

    model = HiddenDsv4Model()
    for mod in model.modules():        # our linears in the parameters' dtype; norms, sinks, mHC, biases stay fp32
        if type(mod) is nn.Linear:
            mod.to(config.params_dtype)
    return model.to(device)
