"""Catching a returned engine up to the current weights from the driver alone, at once.

A weight sync is collective on every trainer rank (FSDP gathers the full tensors bucket by bucket), so
the run loop can only sync between rollouts. An engine that comes back during a rollout would then wait
for the rollout to end, and a rollout whose engines all died could never end. So, with
``--use-fault-tolerance``, the sync's source rank (the driver) keeps a host copy of the weights it last
synced (:class:`WeightCache`, filled while the buckets stream through a normal sync, committed only
when that sync succeeded), and :class:`CatchUp` pushes that copy to one returned engine over a weight
group of its own (broadcast over gloo: driver + that engine), with the same ``weight_version``. The
recovery controller then checks the version and health before routing to it.

Cost: one host copy of the model on the driver (the sync's dtype), refreshed at every sync.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from miles.utils.logging import get_logger

logger = get_logger(__name__)


class WeightCache:
    """Wraps the sender's weight source on the source rank; keeps the buckets of the last good sync."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._staged: list[list[tuple[str, torch.Tensor]]] | None = None
        self._buckets: list[list[tuple[str, torch.Tensor]]] = []
        self.version: int | None = None

    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        staged: list[list[tuple[str, torch.Tensor]]] = []
        self._staged = None
        for bucket in self.source.iter_weight_buckets(bucket_bytes, dtype):
            staged.append([(name, t.detach().to("cpu", copy=True)) for name, t in bucket])
            yield bucket
        self._staged = staged

    def __getattr__(self, name: str) -> Any:  # the trainer's other attributes (state_dict_for_check, ...)
        return getattr(self.source, name)

    def commit(self, version: int) -> None:
        """The sync that streamed the staged buckets succeeded: they are version ``version`` now."""
        staged, self._staged = self._staged, None
        if staged is None:
            logger.warning("weight cache: no complete set of buckets to commit for v%d; catch-up waits for the next sync",
                           version)
            return
        with self._lock:
            self._buckets, self.version = staged, int(version)

    def snapshot(self) -> tuple[int | None, list[list[tuple[str, torch.Tensor]]]]:
        with self._lock:
            return self.version, self._buckets


class _CachedSource:
    """A WeightSource over one cached version (not collective: only the driver takes part)."""

    def __init__(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        self.buckets = buckets

    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield from self.buckets


class CatchUp:
    """``catch_up(engine_id, url, version)`` for the recovery controller; returns the version pushed."""

    def __init__(self, cache: WeightCache, weights_cfg: Any, make_target: Callable[[int, str], Any],
                 master_addr: str | None = None) -> None:
        self.cache, self.make_target, self.master_addr = cache, make_target, master_addr
        # always a broadcast over gloo (CPU tensors, no GPU needed on the driver side), whatever the run's mode
        self.cfg = dataclasses.replace(weights_cfg, update_weight_transfer_mode="broadcast")
        self._lock = threading.Lock()

    def __call__(self, engine_id: int, url: str, version: int) -> int:
        from miles.weight_sync.base import build_weight_sender

        cached_version, buckets = self.cache.snapshot()
        if cached_version is None or not buckets:
            raise RuntimeError("no weights cached yet (no successful weight sync so far)")
        if cached_version != version:
            logger.info("engine %d catch-up: the cache holds v%d (current v%d); pushing it", engine_id, cached_version,
                        version)
        target = self.make_target(engine_id, url)
        with self._lock:  # one catch-up at a time (each forms its own group)
            sender = build_weight_sender(self.cfg, _CachedSource(buckets), is_source=True, engines=[target],
                                         initial_version=cached_version, status_group=None,
                                         master_addr=self.master_addr)
            try:
                sender.connect([target])
                result = sender.sync([target], bump_version=False)
            finally:
                sender.close()
        logger.info("engine %d caught up to v%d from the driver's weight cache in %.2fs (%.1f MB)", engine_id,
                    cached_version, result.total_s, result.bytes / 1e6)
        return cached_version
