"""``parallel._coalesced_all_reduce`` with AVG over a real 2-rank gloo group: a SUM and a division of the flat
buffer (faster on gloo) gives the bits gloo's own AVG gives, tensor by tensor, for fp32 and fp64 gradients of
very different magnitudes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from trainer_harness import gloo_rank, put_timed


def _average(rank: int) -> bool:
    from miles.trainer.megatron.parallel import _coalesced_all_reduce

    g = torch.Generator().manual_seed(rank)
    shapes = [(37, 5), (101,), (3, 4, 7), (1,)]
    grads = [torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 6, s, generator=g) for s in shapes]
    grads += [torch.randn(9, generator=g, dtype=torch.float64) / 3]
    expect = [t.clone() for t in grads]
    for t in expect:
        dist.all_reduce(t, op=dist.ReduceOp.AVG)    # gloo's own AVG, one tensor at a time
    _coalesced_all_reduce(grads, dist.group.WORLD, dist.ReduceOp.AVG)
    return all(torch.equal(a, b) for a, b in zip(grads, expect))


def _worker(rank: int, port: int, scenario: str, q) -> None:
    with gloo_rank(rank, port, q):
        put_timed(q, rank, lambda: _average(rank))


@pytest.mark.multiprocess
def test_gloo_average_is_a_sum_then_a_division_bit_for_bit(two_ranks) -> None:
    out = two_ranks(_worker, "avg")
    assert out[0][0] is True and out[1][0] is True, out
