"""Disk-delta transport: versions on a shared filesystem (format in disk_delta.py), loaded by the engines.

The source rank keeps a CPU snapshot of the last version it wrote. The first sync writes a full,
HF-loadable version; each later one writes per-tensor deltas against the snapshot. Engines get
``/update_weights_from_disk(model_path=<version dir>)``: an engine verifies every checksum before
applying a delta. An engine that refuses the delta (it answers, with an error: corrupted or missing
piece, or it does not hold the base version, e.g. after a restart) gets the full version instead: it is
written from the snapshot (the exact weights of this version) when not on disk yet, and loaded whole.
A newcomer (``sync_one``) gets the full current version the same way, with no gather at all.

Old versions are pruned, keeping the last ``keep_versions``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from miles.utils.logging import get_logger
from miles.weight_sync import disk_delta as dd
from miles.weight_sync.base import Deadline, EngineTarget, SyncResult, WeightSender, WeightSyncError

logger = get_logger(__name__)


class DiskDeltaSender(WeightSender):
    """``--update-weight-transfer-mode disk-delta`` (``--update-weight-disk-dir``, encoding, checksum)."""

    mode = "disk-delta"

    def __init__(self, cfg, source, *, model_dir: str | Path | None = None, keep_versions: int = 2, **kwargs: Any) -> None:
        super().__init__(cfg, source, **kwargs)
        if not cfg.update_weight_disk_dir:
            raise ValueError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir")
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.root = Path(cfg.update_weight_disk_dir)
        self.model_dir = model_dir
        self.keep_versions = keep_versions
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._snapshot_version: int | None = None
        self._synced = False  # known on every rank: whether a version exists to re-send without gathering
        self.fallbacks = 0

    def _sync(self, engines: list[EngineTarget], version: int) -> SyncResult:
        result = SyncResult(self.mode, version, num_engines=len(engines))
        t_start = time.monotonic()
        deadline = Deadline(self.cfg.update_weight_timeout, f"weight sync v{version} (disk-delta)")
        resend = self._synced and version == self.weight_version
        try:
            if resend:  # a newcomer: the current version, straight from the snapshot
                if self.is_source and engines:
                    self._push(engines, version, deadline, result, full_only=True)
                return result
            if not self.is_source:
                for _ in self.timed_buckets(result):
                    pass
                self._synced = True
                return result
            if engines:
                tc = time.monotonic()
                self.begin(engines, deadline)
                result.control_s += time.monotonic() - tc
            snapshot: dict[str, torch.Tensor] = {}
            stats: dict[str, Any] = {}
            t_write = time.monotonic()
            gather_before = result.gather_s
            path = dd.write_version(
                self.root, version, self._collect(result, snapshot),
                baseline=self._snapshot, base_version=self._snapshot_version,
                encoding=self.cfg.update_weight_delta_encoding, checksum=self.cfg.update_weight_delta_checksum,
                model_dir=self.model_dir, stats=stats, partial=self._partial())
            result.transfer_s += (time.monotonic() - t_write) - (result.gather_s - gather_before)
            result.extra.update(written_bytes=float(stats["written_bytes"]), unchanged_tensors=float(stats["num_unchanged"]))
            self._snapshot, self._snapshot_version, self._synced = snapshot, version, True
            if engines:
                self._push(engines, version, deadline, result, path=path)
                tc = time.monotonic()
                self.finish(engines, version, deadline)
                result.control_s += time.monotonic() - tc
            dd.prune_versions(self.root, keep_from=version - self.keep_versions + 1)
        finally:
            result.total_s = time.monotonic() - t_start
        return result

    def _collect(self, result: SyncResult, snapshot: dict[str, torch.Tensor]):
        for bucket in self.timed_buckets(result):
            result.num_buckets += 1
            for name, t in bucket:
                t0 = time.monotonic()
                cpu = t.detach().to("cpu", copy=True).contiguous()
                result.gather_s += time.monotonic() - t0
                snapshot[name] = cpu
                result.num_tensors += 1
                result.bytes += cpu.numel() * cpu.element_size()
                yield name, cpu

    def _partial(self) -> bool:
        """Whether the source exports part of the model (``WeightSource.weight_export_is_partial``)."""
        fn = getattr(self.source, "weight_export_is_partial", None)
        return bool(fn()) if fn is not None else False

    def full_version_dir(self, version: int) -> Path:
        """The full dir of ``version`` (the snapshot's), written now if it is not on disk yet."""
        path = self.root / dd.version_dir_name(version, "full")
        if not path.is_dir():
            if self._snapshot is None or self._snapshot_version != version:
                raise WeightSyncError(f"no snapshot of weight version {version} to write a full version from")
            dd.write_version(self.root, version, self._snapshot.items(), baseline=None,
                             checksum=self.cfg.update_weight_delta_checksum, model_dir=self.model_dir,
                             partial=self._partial())
        return path

    def _push(self, engines: list[EngineTarget], version: int, deadline: Deadline, result: SyncResult,
              path: Path | None = None, full_only: bool = False) -> None:
        t0 = time.monotonic()
        if full_only or path is None:
            path = self.full_version_dir(version)
        futs = self.submit_all(engines, lambda c: c.update_weights_from_disk(str(path), weight_version=str(version),
                                                                             flush_cache=False, timeout=deadline.left()))
        refused: list[tuple[EngineTarget, BaseException]] = []
        for e, f in zip(engines, futs):
            try:
                self.wait_all([e], [f], deadline, f"update_weights_from_disk({path.name})")
            except WeightSyncError as err:
                cause = err.__cause__
                if dd.is_delta_dir(path) and getattr(cause, "status", None) is not None:
                    refused.append((e, err))  # it answered: the delta was refused, not the engine lost
                else:
                    raise
        if refused:
            self.fallbacks += len(refused)
            full = self.full_version_dir(version)
            for e, err in refused:
                logger.warning("engine %s refused delta %s (%s); falling back to the full version %s", e.url, path.name, err, full.name)
            targets = [e for e, _ in refused]
            self.call_all(targets, lambda c: c.update_weights_from_disk(str(full), weight_version=str(version), flush_cache=False,
                                                                        timeout=deadline.left()),
                          deadline, f"update_weights_from_disk({full.name})")
            result.extra["fallbacks"] = float(len(refused))
        result.load_s += time.monotonic() - t0
