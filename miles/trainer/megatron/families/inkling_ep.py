"""Expert parallelism of Inkling's own MoE (``inkling_model.InklingMoE``, in torch): how each (token, top-k slot)
reaches the EP rank holding its chosen expert and its weighted output comes back, as ``--moe-token-dispatcher-type``
says for megatron-core's MoE (the value reaches the model in megatron-core's ``TransformerConfig``,
``moe_token_dispatcher_type``: ``moe.config_kwargs`` fills in alltoall under EP > 1 when the flag is absent, as for
every MoE family here; ``flex``, DeepEP's, is refused for Inkling by ``families/inkling.check_static``):

    out = DISPATCH["alltoall"](run, x, weights, ids, ep, local)   # [n, h]: the routed experts' weighted sum per token

``run(x, weights, ids, first)`` is the MoE's own expert loop (``InklingMoE._routed``): rows ``x`` [m, h] routed to
``ids`` [m, k] with ``weights`` [m, k], through this rank's experts ``first .. first + local`` (other experts' slots
add nothing). Each EP rank holds experts ``[rank * local, (rank + 1) * local)``.

- ``all_to_all`` (megatron-core's ``alltoall``): each rank sends each (token, slot) row (the token's hidden state and
  the slot's routing weight) only to the rank holding the slot's expert (``dist.all_to_all_single``, the split sizes
  exchanged first), that rank runs its experts on what it received and sends the weighted outputs back, where each
  token's slots are summed. The rows go out sorted by expert (stable), so each expert sees its rows in the order the
  all-gather path gives it (by source rank, then token). Backward: the reverse all-to-alls.
- ``all_gather`` (megatron-core's ``allgather``): the EP group's tokens, weights and expert ids are gathered (padded
  to the longest rank's count: RL micro-batches differ in length; padding routes nowhere), each rank runs its
  experts on all of them and the partial outputs are reduce-scattered back, summed. Every rank computes on every
  rank's tokens (EP x the all-to-all's traffic); kept for the flag's meaning.

The collectives with their backward are megatron-core's own (``tensor_parallel.mappings``: ``all_to_all``;
``gather_from_sequence_parallel_region`` / ``reduce_scatter_to_sequence_parallel_region`` on the EP group).

A rank whose experts get no row still takes part in each collective's backward (``_on_graph``): the collectives are
symmetric, so a rank skipping one would hang the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class EPGroup:
    """The expert-parallel group (EP 1: none): this rank holds experts ``[rank * local, (rank + 1) * local)``."""

    def __init__(self, size: int, rank: int, group):
        self.size, self.rank, self.group = size, rank, group


def _on_graph(y: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``y`` (this rank's experts' outputs) on the autograd graph of each of ``inputs`` (what the collectives
    brought) even when no row reached this rank's experts (``run`` then returns zeros that need no gradient): every
    EP rank must run each collective's backward."""
    for t in inputs:
        if t.requires_grad:
            y = y + t[:0].sum()
    return y


def all_to_all(run: Run, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ep: EPGroup,
               local: int) -> torch.Tensor:
    """megatron-core's ``alltoall`` dispatch (module docstring): x [n, h], weights / ids [n, k] -> [n, h]."""
    from megatron.core.tensor_parallel.mappings import all_to_all as exchange

    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)               # by expert: by owning rank, then (token, slot)
    tok = torch.div(order, k, rounding_mode="floor")
    sorted_ids = flat[order]
    counts = torch.bincount(torch.div(sorted_ids, local, rounding_mode="floor"), minlength=ep.size)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ep.group)
    send, recv = counts.tolist(), recv_counts.tolist()
    rows = torch.cat([x[tok], weights.reshape(-1)[order, None]], dim=1)          # [n k, h + 1]: state, weight
    got = exchange(ep.group, rows, recv, send)
    got_ids = sorted_ids.new_empty(sum(recv))
    dist.all_to_all_single(got_ids, sorted_ids, output_split_sizes=recv, input_split_sizes=send, group=ep.group)
    y = run(got[:, :-1], got[:, -1:], got_ids[:, None], ep.rank * local)        # [m, h]: each row's weighted output
    y = y if y.requires_grad else _on_graph(y, got)
    back = exchange(ep.group, y, send, recv)                                       # [n k, h] in ``order``
    # back to (token, slot) order and summed over the slots: no atomic adds into a token's row (index_add with
    # repeated indices is not deterministic on CUDA), one rounding; at top-2 bitwise the all-gather path's a + b
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return back[inverse].view(-1, k, back.shape[1]).sum(1).to(x.dtype)


def all_gather(run: Run, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ep: EPGroup,
               local: int) -> torch.Tensor:
    """megatron-core's ``allgather`` dispatch (module docstring): x [n, h], weights / ids [n, k] -> [n, h]."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    n = x.shape[0]
    most = torch.tensor([n], dtype=torch.int64, device=x.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ep.group)
    pad = int(most) - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
        ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), -1)])
    all_ids = ids.new_empty((ep.size * ids.shape[0], ids.shape[1]))
    dist.all_gather_into_tensor(all_ids, ids.contiguous(), group=ep.group)
    gx, gw = (gather_from_sequence_parallel_region(t, True, ep.group) for t in (x, weights))
    out = run(gx, gw, all_ids, ep.rank * local)
    out = out if out.requires_grad else _on_graph(out, gx, gw)
    return reduce_scatter_to_sequence_parallel_region(out, ep.group)[:n]


DISPATCH: dict[str, Callable[..., torch.Tensor]] = {"alltoall": all_to_all, "allgather": all_gather}
