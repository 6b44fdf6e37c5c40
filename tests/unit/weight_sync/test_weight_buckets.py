"""Flattened buckets: SGLang's layout (byte offsets, no padding), round trips, grouping, bad input."""

from __future__ import annotations

import pytest
import torch

from miles.weight_sync.buckets import bucket_metadata, dtype_from_str, iter_buckets, pack_bucket, unpack_bucket


def test_pack_unpack_mixed_dtypes_bit_exact() -> None:
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),  # 14 bytes: the next fp32 lands misaligned
        ("c", torch.randn(2, 2)),
        ("d", torch.tensor(1.5)),
        ("e", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]
    flat, meta = pack_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for _, t in tensors)
    assert meta[1] == {"name": "b", "shape": [7], "dtype": "bfloat16", "start_idx": 60, "end_idx": 74, "numel": 14}
    out = unpack_bucket(flat, meta)
    for (n, t), (m, u) in zip(tensors, out):
        assert n == m and u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    # the receiving side derives the same layout from names/dtypes/shapes alone
    again = bucket_metadata([n for n, _ in tensors], [str(t.dtype) for _, t in tensors], [list(t.shape) for _, t in tensors])
    assert again == meta


def test_unpack_rejects_inconsistent_input() -> None:
    flat, meta = pack_bucket([("a", torch.randn(4))])
    with pytest.raises(ValueError, match="holds 15 bytes"):
        unpack_bucket(flat[:15], meta)
    with pytest.raises(ValueError, match="uint8"):
        unpack_bucket(flat.view(torch.float32), meta)
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        dtype_from_str("float13")
    with pytest.raises(ValueError, match="empty"):
        pack_bucket([])


def test_iter_buckets_respects_size() -> None:
    ts = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    buckets = list(iter_buckets(ts, 1000))
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert [len(b) for b in iter_buckets([("big", torch.zeros(1000)), *ts[:1]], 1000)] == [1, 1]
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        list(iter_buckets(ts, 0))


def test_a_weight_sync_abandoned_mid_way_leaves_autograd_on(one_rank_group) -> None:
    """A sync that fails after some buckets (an engine killed mid-sync) drops its bucket iterator half-way; the
    training step that follows on the same thread must still record gradients (the iterators used to hold a
    ``torch.no_grad()`` block open across ``yield``)."""
    import torch

    from miles.trainer.weights import iter_full_params
    from miles.weight_sync.p2p import iter_local_shards

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    iters = {"iter_full_params": iter_full_params(model, group=one_rank_group, device=torch.device("cpu"),
                                                  bucket_bytes=64),
             "iter_local_shards": iter_local_shards(model, rank=0, world=1, bucket_bytes=64, dtype=None,
                                                    device=torch.device("cpu"))}
    for name, it in iters.items():
        next(it)  # one bucket sent, then the engine failed: the sync stops here, the iterator stays alive
        assert torch.is_grad_enabled(), f"{name} left autograd off for the caller"
        loss = model(torch.ones(1, 8)).sum()
        loss.backward()  # the next training step
        assert model[0].weight.grad is not None
