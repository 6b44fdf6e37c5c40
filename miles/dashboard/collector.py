"""The collector: buffers telemetry records in memory and appends them to ``{dump-details}/dashboard/``.

    c = Collector(cfg.output.dashboard, rank=0, primary=True, meta=records.meta(name, t0, args))
    c.start()                          # daemon threads: flush every --dashboard-flush-interval, GPU samples, scrapes
    c.push(records.PHASES, event)      # never blocks on disk or network
    c.close()                          # stop the threads (bounded joins), final flush

The driver's collector (``primary``) writes Miles's streams (``records``) and ``lane_catalog.json`` and merges
the other ranks' records, which they append to ``spool/<stream>.rank<r>.jsonl`` (one writer a file; on several
nodes this needs --dump-details on a shared filesystem, as checkpoints do). Buffers are bounded (the oldest
records go first). Failure policy: any error in a flush, a sampler or a scrape logs one warning and turns this
collector off for the rest of the run; training never waits on it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.config.logging import DashboardConfig
from miles.dashboard import records
from miles.dashboard.sources import EngineScraper, GpuSampler
from miles.utils.logging import get_logger

logger = get_logger(__name__)

MAX_BUFFERED = 100_000  # records per stream held while the disk cannot be written
SPOOL_NAME = re.compile(r"^([a-z_]+)\.rank(\d+)\.jsonl$")
JOIN_TIMEOUT_S = 10.0


class Collector:
    def __init__(self, cfg: DashboardConfig, *, rank: int, primary: bool, meta: dict[str, Any] | None = None,
                 gpu: GpuSampler | None = None, scraper: EngineScraper | None = None) -> None:
        self.cfg, self.rank, self.primary = cfg, rank, primary
        self.root = Path(cfg.dashboard_dir)
        self.gpu = gpu if gpu is not None and gpu.available else None
        self.scraper = scraper
        self.enabled = True
        self._meta = meta
        self._buffers: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._spool_offsets: dict[str, int] = {}
        self._catalog: dict[str, dict[str, list[Any]]] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        if primary:
            self.write_meta(meta or records.meta("miles-run", time.time(), {}))
        else:
            (self.root / records.SPOOL_DIR).mkdir(exist_ok=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._spawn("flush", self.cfg.flush_interval, self.flush)
        if self.gpu is not None:
            gpu = self.gpu
            self._spawn("gpu", self.cfg.gpu_sample_interval, lambda: self.push_many(records.GPU_UTIL,
                                                                                    gpu.sample(time.time())))
        if self.scraper is not None:
            scraper = self.scraper
            self._spawn("scrape", self.cfg.scrape_interval, lambda: self.push_many(records.ENGINE_SERIES,
                                                                                   scraper.scrape(time.time())))

    def _spawn(self, name: str, interval: float, tick: Callable[[], None]) -> None:
        def loop() -> None:
            while not self._stop.wait(interval) and self.enabled:
                self._guard(name, tick)

        t = threading.Thread(target=loop, name=f"miles-dashboard-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # observability must never take the run down: one warning, then off
            self.disable(f"{what} failed: {type(e).__name__}: {e}")

    def disable(self, reason: str) -> None:
        if self.enabled:
            self.enabled = False
            self._stop.set()
            logger.warning("dashboard telemetry turned off for the rest of the run (%s); training goes on", reason)

    def close(self, grace_s: float = 0.0) -> None:
        """Stop the threads and write what is buffered; ``grace_s``: the driver waits that long for other ranks'
        last spooled records first."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=JOIN_TIMEOUT_S)
        self._threads = []
        if self.enabled:
            if grace_s > 0 and self.primary:
                time.sleep(grace_s)
            self._guard("final flush", self.flush)

    # ------------------------------------------------------------------ ingest
    def push(self, stream: str, record: dict[str, Any]) -> None:
        self.push_many(stream, [record])

    def push_many(self, stream: str, batch: list[dict[str, Any]]) -> None:
        if not batch or not self.enabled:
            return
        with self._lock:
            buf = self._buffers.setdefault(stream, [])
            buf.extend(batch)
            if len(buf) > MAX_BUFFERED:
                del buf[:len(buf) - MAX_BUFFERED]

    def write_meta(self, meta: dict[str, Any]) -> None:
        self._meta = meta
        records.write_json_atomic(self.root / records.META_FILE, meta, indent=1)

    # ------------------------------------------------------------------ flush
    def flush(self) -> None:
        with self._flush_lock:
            if self.primary:
                self._merge_spools()
            with self._lock:
                taken, self._buffers = self._buffers, {}
            for stream, batch in taken.items():
                if self.primary:
                    records.write_stream(self.root, stream, batch)
                else:
                    records.append_lines(self.root / records.SPOOL_DIR / f"{stream}.rank{self.rank}.jsonl", batch)
            if self.primary:
                self._update_catalog(taken)

    def _merge_spools(self) -> None:
        spool = self.root / records.SPOOL_DIR
        if not spool.is_dir():
            return
        for path in sorted(spool.iterdir()):
            m = SPOOL_NAME.match(path.name)
            if m is None or m.group(1) not in records.STREAMS:
                continue
            batch, self._spool_offsets[path.name] = records.read_complete_lines(
                path, self._spool_offsets.get(path.name, 0))
            self.push_many(m.group(1), batch)

    def _update_catalog(self, taken: dict[str, list[dict[str, Any]]]) -> None:
        """``lane_catalog.json`` as Miles folds it: per ``node:gpu`` lane the train ranks, engine addrs and roles."""
        dirty = False

        def add(node: str, gpu: int, key: str | None = None, value: Any = None) -> None:
            nonlocal dirty
            lane = self._catalog.setdefault(f"{node}:{gpu}", {"ranks": [], "engine_addrs": [], "roles": []})
            if not lane["ranks"] and not lane["roles"] and not lane["engine_addrs"]:
                dirty = True
            if key is not None and value not in lane[key]:
                lane[key].append(value)
                lane[key].sort()
                dirty = True

        for e in taken.get(records.PHASES, []):
            if e.get("role") == records.ROLE_TRAIN:
                for gpu in e.get("gpus", []):
                    add(e["node"], gpu, "roles", records.ROLE_TRAIN)
                    if e.get("rank", -1) >= 0:
                        add(e["node"], gpu, "ranks", e["rank"])
        for snap in taken.get(records.TOPOLOGY, []):
            for engine in snap.get("engines", []):
                for node, gpu in engine.get("gpus", []):
                    add(node, gpu, "roles", "rollout")
                    add(node, gpu, "engine_addrs", engine["addr"])
        for s in taken.get(records.GPU_UTIL, []):
            add(s["node"], s["gpu"])
        if dirty:
            records.write_json_atomic(self.root / records.CATALOG_FILE, {"version": 1, "lanes": self._catalog})
