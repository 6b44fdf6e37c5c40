"""What the collector samples: NVML GPU readings and engine metrics.

``GpuSampler``: every NVML device of this node (physical order, as Miles), through ``pynvml`` imported lazily;
without it, or without a driver (a CPU run), it is silently absent (``available`` False, one DEBUG line).

``EngineScraper``: SGLang's Prometheus text from each engine's ``/metrics`` (``direct``; ``auto`` is direct, as in
Miles) or the router's ``/engine_metrics`` (``router``: samples carry ``worker_addr``). Names are normalised
(``sglang:x`` -> ``sglang_x``), filtered by the whitelist and reduced to the ``engine_type``/``dp_rank`` labels.
The embedded engine has no ``/metrics``: there ``/get_load``'s counters are turned into the same metric names
(one INFO line). Every HTTP call is bounded by ``timeout``; a failed engine leaves a gap, never a made-up value.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.dashboard import records
from miles.utils.logging import get_logger

logger = get_logger(__name__)

# radixark/miles@v0.1.0:miles/dashboard/sglang_scraper.py DEFAULT_METRIC_WHITELIST
DEFAULT_METRICS = (
    "sglang_num_running_reqs", "sglang_num_queue_reqs", "sglang_gen_throughput", "sglang_token_usage",
    "sglang_cache_hit_rate", "sglang_num_prefill_prealloc_queue_reqs", "sglang_num_prefill_inflight_queue_reqs",
    "sglang_num_decode_prealloc_queue_reqs", "sglang_num_decode_transfer_queue_reqs", "sglang_kv_transfer_speed_gb_s",
    "sglang_kv_transfer_latency_ms", "sglang_prompt_tokens_total", "sglang_generation_tokens_total",
    "sglang_num_requests_total", "sglang_num_aborted_requests_total", "sglang_time_to_first_token_seconds_sum",
    "sglang_time_to_first_token_seconds_count", "sglang_inter_token_latency_seconds_sum",
    "sglang_inter_token_latency_seconds_count", "sglang_time_per_output_token_seconds_sum",
    "sglang_time_per_output_token_seconds_count", "sglang_e2e_request_latency_seconds_sum",
    "sglang_e2e_request_latency_seconds_count",
)
KEPT_LABELS = ("engine_type", "dp_rank")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class GpuSampler:
    """``sample(ts)`` -> one ``gpu_util`` record per device; [] when NVML is not there."""

    def __init__(self, node: str, nvml: Any = None) -> None:
        self.node = node
        self._nvml = nvml
        self._handles: list[Any] = []
        self.available = self._init()

    def _init(self) -> bool:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self._nvml.nvmlDeviceGetCount())]
            return bool(self._handles)
        except Exception as e:  # no pynvml, no driver (a CPU machine): no GPU samples, said once at DEBUG
            logger.debug("dashboard: no NVML on %s (%s): no GPU samples", self.node, e)
            return False

    def sample(self, ts: float) -> list[dict[str, Any]]:
        out = []
        for gpu, h in enumerate(self._handles):
            try:
                util = int(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                mem_mb = int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) >> 20
                power_w = int(self._nvml.nvmlDeviceGetPowerUsage(h)) // 1000
            except Exception:  # a device mid-reset: skip it this tick
                continue
            out.append(records.gpu_sample(ts, node=self.node, gpu=gpu, util=util, mem_mb=mem_mb, power_w=power_w))
        return out


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of Prometheus's text format."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(3) or "")}
        out.append((m.group(1), labels, value))
    return out


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # engines are the job's own hosts: no proxy


def _http_get(url: str, timeout: float, api_key: str | None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with _OPENER.open(req, timeout=timeout) as resp:
        return resp.read().decode("utf-8", "replace")


def load_metrics(load: dict[str, Any]) -> dict[str, float]:
    """The embedded engine's ``/get_load`` counters under SGLang's metric names."""
    out = {"sglang_num_running_reqs": load.get("num_running_reqs"), "sglang_num_queue_reqs": load.get("num_waiting_reqs"),
           "sglang_generation_tokens_total": load.get("generated_tokens")}
    total, used = load.get("kv_pages_total"), load.get("kv_pages_in_use")
    if isinstance(total, (int, float)) and total > 0 and isinstance(used, (int, float)):
        out["sglang_token_usage"] = used / total
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class EngineScraper:
    """``scrape(ts)`` -> ``engine_series`` records of every engine ``engine_urls()`` lists (or of the router)."""

    def __init__(self, mode: str, engine_urls: Callable[[], Iterable[str]], router_url: Callable[[], str | None], *,
                 metrics: Iterable[str] | None = None, timeout: float = 5.0, api_key: str | None = None,
                 http_get: Callable[[str, float, str | None], str] = _http_get) -> None:
        self.mode = "router" if mode == "router" else "direct"
        self.engine_urls, self.router_url = engine_urls, router_url
        self.whitelist = frozenset(metrics or DEFAULT_METRICS)
        self.timeout, self.api_key, self._get = timeout, api_key, http_get
        self._no_metrics: set[str] = set()  # engines without /metrics (the embedded engine): /get_load instead

    def scrape(self, ts: float) -> list[dict[str, Any]]:
        if self.mode == "router":
            url = self.router_url()
            if not url:
                return []
            return self._ingest(None, self._get(f"{url.rstrip('/')}/engine_metrics", self.timeout, self.api_key), ts)
        urls = [u.rstrip("/") for u in self.engine_urls()]
        if not urls:
            return []
        with ThreadPoolExecutor(max_workers=min(8, len(urls)), thread_name_prefix="miles-dash-scrape") as pool:
            return [r for batch in pool.map(lambda u: self._one(u, ts), urls) for r in batch]

    def _one(self, url: str, ts: float) -> list[dict[str, Any]]:
        try:
            if url not in self._no_metrics:
                try:
                    return self._ingest(url, self._get(f"{url}/metrics", self.timeout, self.api_key), ts)
                except urllib.error.HTTPError as e:
                    if e.code != 404:
                        raise
                    self._no_metrics.add(url)
                    logger.info("dashboard: engine %s has no /metrics (the embedded engine): its /get_load counters "
                                "are recorded instead", url)
            load = json.loads(self._get(f"{url}/get_load", self.timeout, self.api_key))
            load = load[0] if isinstance(load, list) and load else load
            return [records.engine_sample(ts, addr=url, metric=k, labels={}, value=v)
                    for k, v in load_metrics(load if isinstance(load, dict) else {}).items() if k in self.whitelist]
        except (OSError, ValueError) as e:  # a gap in the series, never a made-up value
            logger.debug("dashboard: scrape of %s failed: %s", url, e)
            return []

    def _ingest(self, addr: str | None, text: str, ts: float) -> list[dict[str, Any]]:
        out = []
        for name, labels, value in parse_prometheus(text):
            name = name.replace(":", "_")
            if name not in self.whitelist or not math.isfinite(value):
                continue
            where = addr if addr is not None else labels.get("worker_addr")
            if where is None:
                continue
            out.append(records.engine_sample(ts, addr=where, metric=name,
                                             labels={k: v for k, v in labels.items() if k in KEPT_LABELS}, value=value))
        return out
