"""The gated delta rule in torch (CPU and GPU), chunked, and megatron-core's ``GatedDeltaNet`` layer running on it.

    out, state = chunk_gated_delta_rule(q, k, v, g, beta)      # fla's API: [B, T, H, D] in, [B, T, H, Dv] out

The recurrence (per head; the state ``S`` is [Dk, Dv], ``g_t <= 0`` a log decay, ``beta_t`` in (0, 1)):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - k_t^T exp(g_t) S_{t-1})^T        o_t = S_t^T q_t / sqrt(Dk)

Chunked form (the WY representation of the DeltaNet papers, chunks of C tokens): inside a chunk, with ``G_t`` the
cumulative log decay from the chunk's start and ``S_0`` the state entering it, the values written ``d`` solve the
unit lower-triangular system ``(I + A) d = beta v - beta exp(G) K S_0`` with ``A_ts = beta_t exp(G_t - G_s) k_t.k_s``
(s < t). All chunks' triangular solves and intra-chunk products run at once (batched matmuls); only the hand-over of
``S`` from one chunk to the next is a loop, over T / C chunks, never over tokens. Everything runs in fp32.

Packed sequences (``cu_seqlens``, batch 1, as fla takes them) are re-laid as a padded batch so that no state crosses a
sequence boundary. The reference is transformers' ``torch_chunk_gated_delta_rule`` (``qwen3_next``) and fla's
``chunk_gated_delta_rule`` on a GPU (tests/unit/trainer/megatron/test_gated_delta.py).

``GatedDeltaNetLayer`` is megatron-core's ``GatedDeltaNet`` (``megatron.core.ssm.gated_delta_net``: its parameters,
tensor-parallel split and distributed-checkpoint layout, ``in_proj`` = [q; k; v; z; beta; alpha] per TP rank) with
its forward on this module's rule and a torch causal conv: megatron-core's own forward needs flash-linear-attention
(fla) for its l2norm and chunk kernel, and its constructor refuses to build without fla and allocates on CUDA. On a
GPU with fla installed the layer calls fla's kernel; both give the same numbers to within rounding (the GPU test
checks it).

Context parallelism (megatron-core's has none): each CP rank holds 2 chunks of every row
(``context_parallel.py``); the layer all-gathers its input projection over the CP group (backward: reduce-scatter),
runs the conv and the recurrence over the whole sequence, and keeps its own chunks of the output. The recurrence is
computed once per CP rank (no state is passed between ranks: the work is not split, the memory of the other layers
is); the parameter gradients are partial sums over the CP ranks, reduced as the attention's are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunked(q, k, v, g, beta, chunk_size: int, initial_state):
    """The rule on [B, H, T, D] fp32 tensors, T a multiple of ``chunk_size``; returns ([B, H, T, Dv], [B, H, Dk, Dv])."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    n, c = t // chunk_size, chunk_size
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(b, h, n, c, 1)
    cum = g.reshape(b, h, n, c).cumsum(dim=-1)                                # G_t inside each chunk
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()         # s <= t
    gap = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()   # exp(G_t - G_s), s<=t
    kb = k * beta
    system = (kb @ k.transpose(-1, -2)) * gap                                 # beta_t exp(G_t-G_s) k_t.k_s
    system = system.tril(-1) + torch.eye(c, dtype=system.dtype, device=system.device)       # I + A
    rhs = torch.cat([v * beta, kb * cum.exp().unsqueeze(-1)], dim=-1)        # [beta v | beta exp(G) k]
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w, u = sol[..., :dv], sol[..., dv:]                                        # d = w - u S_0
    intra = (q @ k.transpose(-1, -2)) * gap                                   # exp(G_t-G_s) q_t.k_s, s<=t
    q_in = q * cum.exp().unsqueeze(-1)                                         # reads S_0
    k_out = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)                      # writes the chunk's end state
    decay = cum[..., -1].exp()[..., None, None]                                # [b, h, n, 1, 1]
    state = torch.zeros(b, h, dk, dv, dtype=q.dtype, device=q.device) if initial_state is None else initial_state
    outs = []
    for i in range(n):                                                         # the hand-over between chunks
        d = w[:, :, i] - u[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + intra[:, :, i] @ d)
        state = state * decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ d
    return torch.stack(outs, dim=2).reshape(b, h, t, dv), state


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float | None, l2norm_qk: bool) -> tuple[torch.Tensor, ...]:
    """What both forms do first: q and k repeated to v's H heads, all in fp32, q and k L2-normalised with
    ``l2norm_qk``, q scaled (``scale``, default Dk^-0.5)."""
    h, hk = v.shape[2], k.shape[2]
    if h != hk:
        q, k = q.repeat_interleave(h // hk, dim=2), k.repeat_interleave(h // hk, dim=2)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                           scale: float | None = None, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` in torch: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g (log decay) and beta
    [B, T, H]; H a multiple of Hk (each q/k head serves H / Hk consecutive value heads). ``scale`` defaults to
    Dk^-0.5. ``cu_seqlens`` [N + 1] (B = 1): N packed sequences, each from a zero (or ``initial_state[n]``) state.
    Returns the output [B, T, H, Dv] in q's dtype and, with ``output_final_state``, the states [B or N, H, Dk, Dv]
    (fp32)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"chunk_gated_delta_rule: cu_seqlens takes a batch of 1 packed row, got {q.shape[0]}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        longest = max(lengths, default=0)
        rows = torch.cat([torch.arange(s, e, device=q.device) for s, e in zip(bounds[:-1], bounds[1:])])
        seq = torch.cat([torch.full((n,), i, device=q.device, dtype=torch.long) for i, n in enumerate(lengths)])
        pos = rows - torch.tensor(bounds[:-1], device=q.device)[seq]

        def relay(x):                                   # [1, T, ...] -> [N, longest, ...], zero-padded
            out = x.new_zeros((len(lengths), longest) + tuple(x.shape[2:]))
            out[seq, pos] = x[0, rows]
            return out

        out, state = chunk_gated_delta_rule(*(relay(x) for x in (q, k, v, g, beta)), scale=1.0,
                                            chunk_size=chunk_size, initial_state=initial_state,
                                            output_final_state=output_final_state)
        packed = out.new_zeros((1, q.shape[1]) + tuple(out.shape[2:]))
        packed[0, rows] = out[seq, pos]
        return packed.to(dtype), state
    t = q.shape[1]
    pad = (-t) % chunk_size
    # padded steps: g = 0, beta = 0, k = 0 leave the state unchanged, so the final state is the last real token's
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))
    init = None if initial_state is None else initial_state.float()
    out, state = _chunked(q, k, v, g, beta, chunk_size, init)
    out = out[:, :, :t].transpose(1, 2).to(dtype)
    return out, (state if output_final_state else None)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               *, scale: float | None = None, initial_state: torch.Tensor | None = None,
                               use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the definition; for tests and one-token decode steps). Same arguments as
    ``chunk_gated_delta_rule`` without packing; returns (output, final state)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    b, t, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], device=q.device) if initial_state is None else initial_state.float()
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        read = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        delta = (v[:, i] - read) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
    return torch.stack(outs, dim=1).to(dtype), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv then silu: x [B, D, T], weight [D, 1, W] (nn.Conv1d's) -> [B, D, T]."""
    width = weight.shape[-1]
    out = F.conv1d(F.pad(x, (width - 1, 0)), weight, bias, groups=x.shape[1])
    return F.silu(out)


class GatedRMSNorm(torch.nn.Module):
    """transformers' ``Qwen3NextRMSNormGated`` without its gate (megatron-core's ``GatedDeltaNet`` multiplies by
    ``silu(z)`` itself): x normalised in fp32, cast back to x's dtype, times ``w`` (plain weight, starts at 1)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _fla_rule():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError:
        return None
    return fla_rule


def _gated_delta_net_class():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module

    class GatedDeltaNetLayer(GatedDeltaNet):
        """megatron-core's ``GatedDeltaNet`` on this module's torch rule (see the module docstring). Rows are
        causal with right padding, as the rest of the local spec's (no packing); ``in_proj`` is [q; k; v; z; beta;
        alpha] (this TP rank's heads of each)."""

        def __init__(self, config, submodules, layer_number: int | None = None, bias: bool = False,
                     conv_bias: bool = False, conv_init: float | None = None, use_qk_l2norm: bool = True,
                     A_init_range: tuple[float, float] = (1, 16), pg_collection=None, **_):  # noqa: N803
            MegatronModule.__init__(self, config)        # GatedDeltaNet.__init__ refuses without fla, builds on CUDA
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection

                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
            self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, bias, conv_bias, conv_init
            self.A_init_range, self.use_qk_l2norm, self.pg_collection = A_init_range, use_qk_l2norm, pg_collection
            self.tp_size = pg_collection.tp.size()
            self.sp_size = self.tp_size if config.sequence_parallel else 1
            self.config, self.hidden_size = config, config.hidden_size
            self.act_fn = config.activation_func
            self.activation = self.act_fn.__name__
            self.conv_kernel_dim = config.linear_conv_kernel_dim
            self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
            self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
            self.qk_dim = self.key_head_dim * self.num_key_heads
            self.v_dim = self.value_head_dim * self.num_value_heads
            self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
            self.in_proj = build_module(submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config,
                                        init_method=config.init_method, gather_output=False, bias=bias,
                                        skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
                                        tp_group=pg_collection.tp)
            self.conv_dim = self.qk_dim * 2 + self.v_dim
            self.conv_dim_local_tp = self.conv_dim // self.tp_size
            self.conv1d = torch.nn.Conv1d(self.conv_dim_local_tp, self.conv_dim_local_tp, bias=conv_bias,
                                          kernel_size=self.conv_kernel_dim, groups=self.conv_dim_local_tp,
                                          padding=self.conv_kernel_dim - 1, dtype=config.params_dtype)
            self.conv1d.weight.tensor_model_parallel = True
            self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
            self.dt_bias = torch.nn.Parameter(torch.ones(self.num_v_heads_local_tp, dtype=config.params_dtype))
            self.A_log = torch.nn.Parameter(torch.zeros(self.num_v_heads_local_tp, dtype=config.params_dtype))
            for p in (self.dt_bias, self.A_log):
                p.tensor_model_parallel = True
            self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                         eps=config.layernorm_epsilon)
            self.out_proj = build_module(submodules.out_proj, self.v_dim, self.hidden_size, config=config,
                                         init_method=config.output_layer_init_method, bias=bias,
                                         input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                         tp_comm_buffer_name="fc2", tp_group=pg_collection.tp)

        def forward(self, hidden_states: torch.Tensor, attention_mask=None, key_value_states=None,
                    inference_context=None, attention_bias=None, packed_seq_params=None, sequence_len_offset=None,
                    **_):
            """hidden_states [s, b, h] (this rank's sequence part under --sequence-parallel) -> (out, bias)."""
            if packed_seq_params is not None or inference_context is not None:
                raise NotImplementedError("GatedDeltaNetLayer runs right-padded rows only (no packing, no inference).")
            qkvzba, _ = self.in_proj(hidden_states)                      # [s, b, in_proj_dim / tp]
            cp_group = self.pg_collection.cp if self.config.context_parallel_size > 1 else None
            if cp_group is not None:                 # this rank's 2 chunks -> the whole sequence, in order
                from miles.trainer.megatron import context_parallel as cpl

                cp = self.config.context_parallel_size
                qkvzba = cpl._to_sequence_order(cpl._AllGatherSeq.apply(qkvzba, cp_group), cp, 0)
            qkvzba = qkvzba.transpose(0, 1)                              # [b, s, .]
            b, s = qkvzba.shape[:2]
            tp = self.tp_size
            qkv, z, beta, alpha = torch.split(qkvzba, [self.conv_dim_local_tp, self.v_dim // tp,
                                                       self.num_v_heads_local_tp, self.num_v_heads_local_tp], dim=-1)
            qkv = causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias).transpose(1, 2)
            q, k, v = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            q = q.reshape(b, s, -1, self.key_head_dim)
            k = k.reshape(b, s, -1, self.key_head_dim)
            v = v.reshape(b, s, -1, self.value_head_dim)
            g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
            beta = beta.sigmoid()
            fla_rule = _fla_rule() if q.is_cuda and not self.config.deterministic_mode else None
            if fla_rule is not None:              # each q/k head serves H / Hk value heads (as megatron-core calls fla)
                rep = v.shape[2] // q.shape[2]
                q, k = (t.repeat_interleave(rep, dim=2).contiguous() if rep > 1 else t.contiguous() for t in (q, k))
                out, _ = fla_rule(q, k, v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
                                  use_qk_l2norm_in_kernel=self.use_qk_l2norm)
            else:
                out, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=self.use_qk_l2norm)
            normed = self.out_norm(out.reshape(-1, self.value_head_dim))
            gated = (normed * F.silu(z.reshape(-1, self.value_head_dim).float())).to(out.dtype)
            gated = gated.reshape(b, s, -1).transpose(0, 1)              # [s, b, v / tp]
            if cp_group is not None:                 # back to this rank's 2 chunks
                rank = torch.distributed.get_rank(cp_group)
                local = s // cp
                gated = cpl._from_sequence_order(gated, cp, 0)[rank * local:(rank + 1) * local]
            return self.out_proj(gated.contiguous())

    return GatedDeltaNetLayer


def __getattr__(name: str):
    """``GatedDeltaNetLayer`` is built on first use (megatron-core is imported lazily)."""
    if name == "GatedDeltaNetLayer":
        cls = _gated_delta_net_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
