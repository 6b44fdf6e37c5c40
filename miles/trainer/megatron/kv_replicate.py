"""KV heads replicated over tensor parallelism: attention with fewer KV heads than TP ranks (e.g. 2 KV heads at TP 4).

    kv_replicated(kv_heads=2, tp=4)                   # True: each TP rank computes its query heads' KV head
    attn = replicated_attention(kv_heads=2)           # a megatron-core SelfAttention class doing so (q, k, v, no K=V)
    build_projections(attn, submodules, kv_heads, kv) # inside a family's own SelfAttention: linear_q + linear_kv
    q, k, v = replicated_qkv(attn, hidden_states, kv) # ... and its q of this rank's heads, k / v of their KV head
    full = hf_linear_kv([k_proj, v_proj], kv_heads, head_dim)      # HF <-> megatron ``linear_kv`` (per KV head [k; v])

megatron-core splits ``linear_qkv`` over TP by whole query groups, which needs TP to divide the KV heads. With
fewer KV heads than TP ranks (TP a multiple of them) the layer is built with one query group per TP rank
(``num_query_groups`` = TP in its config) and its projection in two parts:

- ``linear_q``: megatron-core's ``ColumnParallelLinear`` of the query heads, split over TP by heads (HF ``q_proj``);
- ``linear_kv``: a torch ``Linear`` holding every KV head's ``[k; v]`` rows (``[k]`` only for a family whose values
  are its keys), replicated on every TP rank (HF ``k_proj`` / ``v_proj`` per head). Rank r's query heads share KV
  head ``r // (TP / kv_heads)``, so it computes that head's k / v from the slice of the replicated weight, on the
  whole sequence (gathered under sequence parallelism; otherwise the input's gradient summed over TP by
  megatron-core's ``copy_to_tensor_model_parallel_region``, as ``ColumnParallelLinear`` does for q).

``linear_kv``'s gradient on a rank holds its own KV head's rows only: it is summed over TP (``TP_PARTIAL``, read by
``parallel.finish_grads`` through the family's ``tp_partial``), after which every rank holds the full gradient and
the copies stay equal. A family that uses this lists ``COLUMN`` in its ``column`` endings and ``TP_PARTIAL`` in
its ``tp_partial`` parts, and sets ``Family.replicated_kv`` (``options.check_static`` then accepts a TP size that
is a multiple of the KV heads). The export gathers ``linear_q`` over TP and takes ``linear_kv`` from any rank.
"""

from __future__ import annotations

import dataclasses

import torch

COLUMN = ("self_attention.linear_q.weight",)      # split over TP on dim 0 (by query heads)
TP_PARTIAL = (".self_attention.linear_kv.",)       # replicated, gradient summed over TP


def kv_replicated(kv_heads: int, tp: int) -> bool:
    """Fewer KV heads than TP ranks: the layer replicates them (``tp`` must be a multiple of ``kv_heads``)."""
    return 0 < kv_heads < tp


def one_group_per_rank(config, tp: int):
    """``config`` with one query group per TP rank (what megatron-core's attention builds its per-rank sizes from)."""
    return dataclasses.replace(config, num_query_groups=tp)


def build_projections(attn, submodules, kv_heads: int, kv: int) -> None:
    """Replace ``attn.linear_qkv`` (a megatron-core SelfAttention built with ``one_group_per_rank``) by ``linear_q``
    (TP-split query heads) and ``linear_kv`` (every KV head's ``kv`` rows of ``head_dim``, 2: [k; v], 1: [k])."""
    hn = attn.hidden_size_per_attention_head
    del attn.linear_qkv
    attn.linear_q = submodules.linear_qkv(
        attn.config.hidden_size, attn.query_projection_size, config=attn.config, init_method=attn.config.init_method,
        gather_output=False, bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv",
        tp_group=attn.pg_collection.tp)
    attn.linear_kv = torch.nn.Linear(attn.config.hidden_size, kv_heads * kv * hn, bias=False,
                                     dtype=attn.config.params_dtype)


def replicated_qkv(attn, hidden_states: torch.Tensor, kv: int, copies: int):
    """(q [s, b, heads of this rank * hn], k [s, b, 1, hn], v [s, b, 1, hn]) of ``attn`` (``build_projections``'):
    q of this rank's heads, k / v of their KV head (``copies`` = TP / KV heads ranks share it) from the replicated
    ``linear_kv`` on the whole sequence; with ``kv`` 1 the value is the key."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    tp = attn.pg_collection.tp
    hn = attn.hidden_size_per_attention_head
    query, _ = attn.linear_q(hidden_states)
    x = gather_from_sequence_parallel_region(hidden_states, group=tp) if attn.config.sequence_parallel else \
        copy_to_tensor_model_parallel_region(hidden_states, group=tp)
    group = tp.rank() // copies
    mixed = torch.nn.functional.linear(x, attn.linear_kv.weight[group * kv * hn:(group + 1) * kv * hn])
    mixed = mixed.unsqueeze(2)                                          # [s, b, 1 group, kv * hn]
    key = mixed[..., :hn]
    return query, key, (mixed[..., hn:] if kv == 2 else key)


def replicated_attention(kv_heads: int) -> type:
    """megatron-core's ``SelfAttention`` for ``kv_heads`` KV heads at any TP: at a TP size above them, one query group
    per rank with ``linear_q`` / ``linear_kv`` (module docstring); otherwise megatron-core's own layer."""
    from megatron.core.transformer.attention import SelfAttention

    class ReplicatedKVSelfAttention(SelfAttention):
        """SelfAttention whose KV heads are replicated over TP when there are fewer of them than TP ranks."""

        def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
            tp = config.tensor_model_parallel_size
            self.kv_copies = tp // kv_heads if kv_replicated(kv_heads, tp) else 0
            if self.kv_copies:
                config = one_group_per_rank(config, tp)
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            if self.kv_copies:
                build_projections(self, submodules, kv_heads, 2)

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False,
                                        split_qkv: bool = True):
            if not self.kv_copies:
                return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                           split_qkv=split_qkv)
            if output_gate or not split_qkv:
                raise NotImplementedError("KV heads replicated over TP: no output gate or fused qkv-rope.")
            query, key, value = replicated_qkv(self, hidden_states, 2, self.kv_copies)
            query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            if self.k_layernorm is not None:
                key = self.k_layernorm(key)
            return query, key, value

    return ReplicatedKVSelfAttention


# ------------------------------------------------------------------------------------------- names
def hf_linear_kv(parts: list[torch.Tensor], kv_heads: int, head_dim: int) -> torch.Tensor:
    """The full ``linear_kv`` weight from HF's ``[k_proj, v_proj]`` (or ``[k_proj]``): per KV head its rows of each."""
    grouped = [t.reshape(kv_heads, head_dim, -1) for t in parts]
    return torch.cat(grouped, dim=1).reshape(-1, grouped[0].shape[-1])


def split_linear_kv(full: torch.Tensor, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """HF's ``[k_proj, v_proj]`` (or ``[k_proj]``) from a full ``linear_kv`` weight (inverse of ``hf_linear_kv``)."""
    parts = full.reshape(kv_heads, -1, full.shape[-1]).split(head_dim, dim=1)
    return [t.reshape(-1, full.shape[-1]) for t in parts]
