"""Context parallelism (``--context-parallel-size N``) on the Megatron backend: every sequence is split
over the N ranks of a CP group, attention still sees the whole sequence.

    shard = shard_rows(ids, pos, index, cp_rank, cp_size)   # this rank's columns of the padded rows
    hidden = model(shard.input_ids, shard.position_ids)     # [2c, b, h]: only this rank's tokens
    full = shard.reassemble(local_values, cp_group)         # [n] per-position values -> [N], all CP ranks
    out = attention(q, k, v, comm="all_gather", group=cp_group, scale=..., dropout_p=0.0)
    nxt = roll_left(shard.input_ids, cp_group)             # the whole rows shifted left by one, this rank's part (MTP)
    k_all = gather_sequence(k_local, cp_group)              # [2c, ...] -> [s, ...] in order (DSA's keys)

Layout (Megatron's load balancing): the micro-batch's right-padded rows ``[b, s]`` (``s`` a multiple of
``2 cp``) are cut into ``2 cp`` chunks of ``c = s / (2 cp)`` columns; CP rank ``i`` holds chunks ``i``
and ``2 cp - 1 - i`` (``[b, 2c]``), so the causal attention work is the same on every rank.
megatron-core's rotary embedding selects the same chunks of the positions (``get_pos_emb_on_this_cp_rank``).

Outputs: log-probs, entropy and critic values are computed on each rank's own positions only (vocab-parallel
under TP), then ``reassemble`` all-gathers them into the micro-batch's order, so the shared loss
(``losses.py``) sees every sample whole, identically on each CP rank. Its backward takes this rank's
positions of the (identical) gradient, without communication: the parameter gradients of the CP ranks are
then partial sums, reduced over DP x CP (``parallel.finish_grads``).

Attention (``--cp-comm-type``, the value megatron-core hands the core attention):
- ``all_gather``: K and V of the local chunks are all-gathered over the CP group (backward: reduce-scatter),
  put back in sequence order, and each local query chunk attends to the keys up to its own end, causal
  inside its diagonal block (a lower-right causal mask).
- ``p2p`` (Megatron's default; there a ring exchange of K/V overlapped with compute): the same attention,
  computed by the ``all_gather`` algorithm here (the same numbers; no ring, no overlap).
- ``a2a`` (Ulysses): an all-to-all trades the sequence split for a head split (each rank gets the whole
  sequence for ``heads / cp`` of its heads), plain causal attention, and the inverse all-to-all; needs the
  attention and KV heads of a TP rank divisible by CP.
- ``a2a+p2p`` (hierarchical, with ``--hierarchical-context-parallel-sizes``): refused by name.
Values may be narrower than queries and keys (multi-latent attention, ``families/mla.py``: keys
``qk_nope + qk_rope`` wide, values ``v_head_dim``); every path gathers or exchanges them on their own.
DeepSeek sparse attention (``families/dsa.py``) gathers its keys, values and indexer keys with ``gather_sequence``
under every ``--cp-comm-type`` (its top-k picks keys from the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

COMM_TYPES = ("p2p", "all_gather", "a2a")       # accepted --cp-comm-type values; p2p runs all_gather


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank order); backward: reduce-scatter (sum) along dim 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class _AllToAll(torch.autograd.Function):
    """x [cp, ...]: block j goes to rank j, block i of the result came from rank i; backward: the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty(x.shape)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _Reassemble(torch.autograd.Function):
    """local [n, ...] (this rank's positions) -> [N, ...] in micro-batch order on every CP rank."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor, mine: torch.Tensor,
                group: dist.ProcessGroup) -> torch.Tensor:
        total, cp = owner.numel(), dist.get_world_size(group)
        buf = local.new_zeros((total, *local.shape[1:]))            # padded to N: no size exchange needed
        buf[:local.shape[0]] = local
        out = local.new_empty((cp * total, *local.shape[1:]))
        dist.all_gather_into_tensor(out, buf, group=group)
        ctx.save_for_backward(mine)
        return out.view(cp, total, *local.shape[1:])[owner, slot]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every CP rank computes the same loss from the same full values: its gradient for this rank's
        # values is the full gradient at this rank's positions
        (mine,) = ctx.saved_tensors
        return grad.index_select(0, mine), None, None, None, None


@dataclass(frozen=True)
class RowShard:
    """One CP rank's part of a micro-batch of right-padded rows [b, s]."""

    input_ids: torch.Tensor       # [b, 2c] this rank's columns (chunks i and 2cp-1-i)
    position_ids: torch.Tensor    # [b, 2c] their positions in the row
    local_index: torch.Tensor     # [n] owned response-predicting positions, into the flattened [b * 2c]
    owner: torch.Tensor           # [N] the CP rank holding each response-predicting position
    slot: torch.Tensor            # [N] its place among that rank's positions
    mine: torch.Tensor            # [n] the micro-batch positions (into N) this rank holds, in order

    def reassemble(self, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Per-position values of this rank [n, ...] -> the whole micro-batch's [N, ...] (differentiable)."""
        return _Reassemble.apply(local, self.owner, self.slot, self.mine, group)


def chunk_columns(seq_len: int, cp_rank: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """The columns [2c] of a row of ``seq_len`` that CP rank ``cp_rank`` holds: chunks i and 2cp-1-i."""
    c = seq_len // (2 * cp_size)
    ar = torch.arange(c, device=device)
    return torch.cat([ar + cp_rank * c, ar + (2 * cp_size - 1 - cp_rank) * c])


def shard_rows(input_ids: torch.Tensor, position_ids: torch.Tensor, index: torch.Tensor, cp_rank: int,
               cp_size: int) -> RowShard:
    """Split rows [b, s] and the flattened positions ``index`` [N] (into [b * s]) that predict the response
    tokens over the CP ranks (module docstring); ``s`` must be a multiple of ``2 cp_size``."""
    b, s = input_ids.shape
    if s % (2 * cp_size):
        raise ValueError(f"context parallelism needs rows of a multiple of 2 x {cp_size} tokens, got {s}")
    c = s // (2 * cp_size)
    cols = chunk_columns(s, cp_rank, cp_size, input_ids.device)
    row, col = index // s, index % s
    chunk = col // c
    first = chunk < cp_size
    owner = torch.where(first, chunk, 2 * cp_size - 1 - chunk)
    local_flat = row * (2 * c) + torch.where(first, 0, c) + col % c
    slot = (F.one_hot(owner, cp_size).cumsum(0) - 1).gather(1, owner.unsqueeze(1)).squeeze(1)
    mine = (owner == cp_rank).nonzero().squeeze(1)
    return RowShard(input_ids=input_ids.index_select(1, cols), position_ids=position_ids.index_select(1, cols),
                    local_index=local_flat.index_select(0, mine), owner=owner, slot=slot, mine=mine)


def _to_sequence_order(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """``dim`` laid out as [rank 0: chunk 0, chunk 2cp-1 | rank 1: chunk 1, chunk 2cp-2 | ...] -> chunks in order."""
    shape = x.shape
    v = x.reshape(*shape[:dim], cp, 2, shape[dim] // (2 * cp), *shape[dim + 1:])
    first, second = v.select(dim + 1, 0), v.select(dim + 1, 1).flip(dim)
    return torch.cat([first, second], dim=dim).reshape(shape)


def _from_sequence_order(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Inverse of ``_to_sequence_order``."""
    shape = x.shape
    v = x.reshape(*shape[:dim], 2 * cp, shape[dim] // (2 * cp), *shape[dim + 1:])
    first, second = v.narrow(dim, 0, cp), v.narrow(dim, cp, cp).flip(dim)
    return torch.stack([first, second], dim=dim + 1).reshape(shape)


def _causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float,
                  gqa: bool) -> torch.Tensor:
    """q [b, h, c, d] are the last c positions of k/v [b, g, sk, d]: causal with the lower-right alignment
    (on GPU torch's ``causal_lower_right``: flash attention where it applies; on CPU the same boolean mask)."""
    from torch.nn.attention.bias import causal_lower_right

    c, sk = q.shape[2], k.shape[2]
    if c == sk:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    if q.is_cuda:
        mask = causal_lower_right(c, sk)
    else:
        mask = torch.ones(c, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - c)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's two chunks [2c, ...] (along dim 0) -> the whole sequence [2c x cp, ...] in order, on every CP
    rank (all-gather; backward: reduce-scatter, each rank's part of the summed gradient)."""
    return _to_sequence_order(_AllGatherSeq.apply(x, group), dist.get_world_size(group), 0)


def _all_gather_attention(q, k, v, group, scale: float, dropout_p: float) -> torch.Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    gqa = q.shape[1] != k.shape[1]
    c = q.shape[2] // 2
    # [b, g, 2c, d] -> gathered along the sequence (dim 0 for the collective), in sequence order
    k_all, v_all = (gather_sequence(t.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3) for t in (k, v))
    outs = []
    for half, chunk in ((0, rank), (1, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        outs.append(_causal_block(q[:, :, half * c:(half + 1) * c], k_all[:, :, :end], v_all[:, :, :end], scale,
                                  dropout_p, gqa))
    return torch.cat(outs, dim=2)


def _a2a_attention(q, k, v, group, scale: float, dropout_p: float) -> torch.Tensor:
    cp = dist.get_world_size(group)
    b, h, local, _ = q.shape

    def to_heads(x: torch.Tensor) -> torch.Tensor:          # [b, n, 2c, d] -> [b, n / cp, s, d]
        n, d = x.shape[1], x.shape[3]                       # (MLA: values narrower than queries and keys)
        blocks = x.reshape(b, cp, n // cp, local, d).transpose(0, 1)          # [cp, b, n/cp, 2c, d]: to rank j
        got = _AllToAll.apply(blocks.contiguous(), group)                      # [cp (from rank i), ...]
        seq = got.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * local, d)
        return _to_sequence_order(seq, cp, 2)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), dropout_p=dropout_p, is_causal=True,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])   # [b, h/cp, s, dv]
    dv = out.shape[3]
    blocks = _from_sequence_order(out, cp, 2).reshape(b, h // cp, cp, local, dv).permute(2, 0, 1, 3, 4)
    back = _AllToAll.apply(blocks.contiguous(), group)                         # [cp (head group j), b, h/cp, 2c, dv]
    return back.transpose(0, 1).reshape(b, h, local, dv)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: str, group: dist.ProcessGroup,
              scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's query chunks over the whole sequence: q [b, heads, 2c, d],
    k [b, kv_heads, 2c, d], v [b, kv_heads, 2c, dv] (this rank's two chunks, RoPE applied; ``dv`` may differ from
    ``d``: multi-latent attention's values) -> [b, heads, 2c, dv]."""
    if comm in ("all_gather", "p2p"):
        return _all_gather_attention(q, k, v, group, scale, dropout_p)
    if comm == "a2a":
        return _a2a_attention(q, k, v, group, scale, dropout_p)
    raise ValueError(f"--cp-comm-type {comm!r} is not supported (one of {', '.join(COMM_TYPES)}).")


def roll_left(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's columns [..., 2c] of rows shifted left by one over the whole sequence (the last column of the
    row 0), as megatron-core's ``roll_tensor(shifts=-1, cp_group=...)`` on the load-balanced layout, on any device
    (no gradient: token ids, positions, labels, masks). Each chunk's new last column is the next chunk's first,
    all-gathered over the CP group ([..., 2] per rank)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = x.shape[-1] // 2
    firsts = x[..., [0, c]].contiguous()                                       # [..., 2]: both chunks' first
    got = firsts.new_empty((cp * firsts.shape[0], *firsts.shape[1:]))
    dist.all_gather_into_tensor(got, firsts, group=group)
    got = got.view(cp, *firsts.shape)
    by_chunk = [got[m, ..., 0] if m < cp else got[2 * cp - 1 - m, ..., 1] for m in range(2 * cp)]
    zero = torch.zeros_like(by_chunk[0])
    out = []
    for half, chunk in ((0, rank), (1, 2 * cp - 1 - rank)):
        part = x[..., half * c:(half + 1) * c]
        nxt = by_chunk[chunk + 1] if chunk + 1 < 2 * cp else zero
        out.append(torch.cat([part[..., 1:], nxt.unsqueeze(-1)], dim=-1))
    return torch.cat(out, dim=-1)
