"""The HF <-> Megatron conversion's round trip under TP as the family unit tests check it (``test_<family>.py``'s
``test_round_trip_is_bitwise_under_tp``): a checkpoint's tensors to megatron-core's, split over the TP ranks as
the trainer loads them, joined and converted back, equal to the checkpoint bit for bit. A family's test adds the
layout of its own sectioned tensors (``shard`` of one rank against the expected rows)."""

from __future__ import annotations

import torch

from miles.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, partition_dim, shard, unshard
from miles.trainer.megatron.model import ModelShape, padded_vocab_size


def round_trip_under_tp(hf: dict[str, torch.Tensor], shape: ModelShape, names: list[str],
                        tp: int) -> dict[str, torch.Tensor]:
    """``hf`` to megatron-core's full tensors ``names``, each split over ``tp`` ranks (``shard``: a family's
    sectioned tensors per section) and joined again (``unshard``), back to HF names: asserts every tensor of ``hf``
    comes back under its name, dtype and bits. Returns the full megatron tensors."""
    full = hf_to_megatron(hf, shape, padded_vocab_size(shape.vocab_size, 128, tp), names)
    back = {}
    for name in names:
        dim = partition_dim(name)
        pieces = [shard(name, full[name], dim, r, tp, shape) for r in range(tp)]
        back.update(megatron_to_hf(name, unshard(name, pieces, dim, shape), shape))
    assert back.keys() == hf.keys()
    assert all(back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]) for k in hf)
    return full
