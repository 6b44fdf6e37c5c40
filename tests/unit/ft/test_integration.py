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


class _NoEngineInRotation:
    """The recovery controller's two calls the client makes, while every engine is out of rotation."""

    def healthy_engine_urls(self) -> list[str]:
        return []

    def check(self) -> None:
        pass


def test_abort_while_waiting_for_an_engine_returns_at_once_and_is_never_reissued():
    """A request that failed every retry waits for an engine to come back; an abort by the caller's rid (the
    rollout manager dropping a surplus group, a weight-sync pause) ends that wait at once without a re-issue."""
    import asyncio
    import socket
    import time

    from miles.fleet.client import EngineClient
    from miles.ft.integration import FaultTolerantClient
    from miles.ft.timing import ft_timings

    with socket.socket() as s:  # a port nobody listens on: every attempt is a retryable connection error
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main() -> tuple[dict, float, FaultTolerantClient]:
        inner = EngineClient([dead], max_retries=0, timeout=5.0)
        ft = FaultTolerantClient(inner, _NoEngineInRotation(), ft_timings(_ft()))
        task = asyncio.create_task(ft.generate([1, 2, 3], {"max_new_tokens": 4}, rid="g0-s0"))
        while inner.stats["failed"] < 1:  # its only attempt failed: it now waits for an engine
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        t = time.monotonic()
        assert await ft.abort("g0-s0")
        try:
            resp = await asyncio.wait_for(task, 5.0)
        finally:
            await inner.close()
        return resp, time.monotonic() - t, ft

    resp, took, ft = asyncio.run(main())
    assert resp["meta_info"]["finish_reason"]["type"] == "abort" and resp["miles"]["aborted_by_client"]
    assert took < 1.0, took
    assert ft.reissued == 0 and not ft._aborted and not ft._current
