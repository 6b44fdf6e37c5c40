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
GPU with fla installed the layer calls fla's kernel (``use_fla``); both give the same numbers to within fp32 rounding
(the GPU test checks it).
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
    h, hk = v.shape[2], k.shape[2]
    if h != hk:
        q, k = q.repeat_interleave(h // hk, dim=2), k.repeat_interleave(h // hk, dim=2)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
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
    h, hk = v.shape[2], k.shape[2]
    if h != hk:
        q, k = q.repeat_interleave(h // hk, dim=2), k.repeat_interleave(h // hk, dim=2)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    b, t, _, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], device=q.device) if initial_state is None else initial_state.float()
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        read = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        delta = (v[:, i] - read) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
    return torch.stack(outs, dim=1).to(dtype), state
