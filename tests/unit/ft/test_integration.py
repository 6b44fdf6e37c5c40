"""The run-plane wiring of --use-fault-tolerance (lighthouse address sharing, errors on every rank) and
the driver's weight cache (only a complete, successful sync is ever served to a returning engine)."""

from __future__ import annotations

import pytest
import torch

from miles.config import FTConfig
from miles.ft.catchup import WeightCache
from miles.ft.integration import FaultTolerance
from miles.ft.lighthouse import torchft_coordination
from miles.utils.optional import MissingDependencyError


def _ft(on: bool = True) -> FTConfig:
    return FTConfig(use_fault_tolerance=on, rollout_health_check_interval=1.0, rollout_health_check_timeout=2.0,
                    rollout_health_check_first_wait=10.0, max_engine_restarts=1)


def test_off_means_nothing_runs():
    assert FaultTolerance.setup(_ft(False), is_driver=True, host="127.0.0.1",
                                share_address=lambda v: pytest.fail("no collective without the flag")) is None


def test_driver_shares_the_lighthouse_address_and_a_failure_reaches_every_rank():
    try:
        torchft_coordination()
    except MissingDependencyError as e:
        pytest.skip(str(e))
    sent: list = []

    def share(v):  # the driver's side of the broadcast
        sent.append(v)
        return v

    ft = FaultTolerance.setup(_ft(), is_driver=True, host="127.0.0.1", share_address=share)
    try:
        assert sent == [{"address": ft.address}] and ft.address.startswith("http://127.0.0.1:")
    finally:
        ft.close()
    # another rank gets the driver's error instead of an address: it fails with it, it does not hang
    with pytest.raises(RuntimeError, match="could not start the torchft lighthouse: OSError: boom"):
        FaultTolerance.setup(_ft(), is_driver=False, host="127.0.0.1",
                             share_address=lambda v: {"error": "OSError: boom"})
    # the driver itself cannot start its lighthouse: the error is broadcast first, then raised
    sent.clear()
    # (203.0.113.1 is TEST-NET-3: no interface of this host has it, so the bind fails with EADDRNOTAVAIL)
    with pytest.raises(RuntimeError, match=r"Cannot assign requested address") as e:
        FaultTolerance.setup(_ft(), is_driver=True, host="203.0.113.1", share_address=share)
    assert sent == [{"error": f"RuntimeError: {e.value}"}]  # the other ranks get the very error the driver raises


class _Source:
    def __init__(self) -> None:
        self.value = 0.0

    def iter_weight_buckets(self, bucket_bytes, dtype):
        for k in range(3):
            yield [(f"w{k}", torch.full((2,), self.value + k))]


def test_weight_cache_serves_only_the_last_complete_committed_sync():
    src = _Source()
    cache = WeightCache(src)
    assert cache.snapshot() == (None, [])
    list(cache.iter_weight_buckets(0, None))
    cache.commit(1)
    version, buckets = cache.snapshot()
    assert version == 1 and [b[0][0] for b in buckets] == ["w0", "w1", "w2"]
    src.value = 10.0
    it = cache.iter_weight_buckets(0, None)
    next(it)  # a sync that died after one bucket: nothing to commit
    cache.commit(2)
    version, buckets = cache.snapshot()
    assert version == 1 and float(buckets[0][0][1][0]) == 0.0
    list(cache.iter_weight_buckets(0, None))
    cache.commit(2)
    version, buckets = cache.snapshot()
    assert version == 2 and float(buckets[2][0][1][0]) == 12.0
