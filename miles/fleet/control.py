"""Control calls to one engine (never through the router): health, pause/continue, cache, memory, weight updates and
LoRA adapters (``EngineControl``), the embedded engine's weight-sync query parameters, and the same calls from plain
threads on one background event loop (``SyncEngineControl``, ``run_sync``). Used by the weight-sync and
fault-tolerance planes (through ``miles.fleet.client``, which re-exports these names)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from miles.fleet.http_base import EngineError, _check_success, _Http

T = TypeVar("T")


WHOLE_SYNC_PARAM = "miles_whole_sync"  # query parameter of the embedded engine's /update_weights_from_{distributed,tensor}


def whole_sync_params(pause_mode: str | None) -> dict[str, str] | None:
    """The query of a weight update that is a whole sync on the embedded engine: pause in ``pause_mode``, load,
    flush the cache (not for ``in_place``) and continue, in one request. SGLang's request structs have no such
    field, so it travels in the query, never in the body; send it only to an engine whose ``/get_server_info``
    says ``"engine": "miles-embedded"``."""
    return None if pause_mode is None else {WHOLE_SYNC_PARAM: str(pause_mode)}


SYNC_ID_PARAM, BUCKET_PARAM = "miles_sync", "miles_bucket"  # query of the embedded engine's ordered buckets


def bucket_order_params(order: tuple[str, int] | None) -> dict[str, str]:
    """The query that puts one ``/update_weights_from_distributed`` at its place in a sync: ``(sync id, bucket
    index)``. Buckets ride separate connections, so two in flight may arrive out of order; the embedded engine
    takes a sync's buckets in index order whatever their arrival. SGLang has no such field (send it only to the
    embedded engine, and at most one bucket in flight to SGLang)."""
    return {} if order is None else {SYNC_ID_PARAM: str(order[0]), BUCKET_PARAM: str(int(order[1]))}


class EngineControl(_Http):
    """Control calls to ONE engine server (never through the router)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0):
        super().__init__(api_key, timeout, connection_limit=8)
        self.url = url.rstrip("/")

    def __repr__(self) -> str:
        return f"EngineControl({self.url})"

    async def _post(self, endpoint: str, payload: dict | None = None, timeout: float | None = None,
                    params: dict[str, str] | None = None) -> Any:
        return _check_success(self.url, endpoint, await self._request("POST", self.url, endpoint, payload or {}, timeout,
                                                                      params))

    async def _get(self, endpoint: str, timeout: float | None = None) -> Any:
        return await self._request("GET", self.url, endpoint, None, timeout)

    # -- health and info ---------------------------------------------------------------------------
    async def _answers(self, endpoint: str, timeout: float | None) -> bool:
        try:
            await self._get(endpoint, timeout)
            return True
        except EngineError:
            return False

    async def health(self, timeout: float | None = None) -> bool:
        """True when ``GET /health`` answers 200; False on any failure (never raises)."""
        return await self._answers("/health", timeout)

    async def health_generate(self, timeout: float | None = None) -> bool:
        """True when ``GET /health_generate`` (a one-token generation) answers 200; never raises."""
        return await self._answers("/health_generate", timeout)

    async def wait_healthy(self, timeout: float, interval: float = 0.5,
                           alive: Callable[[], bool] | None = None) -> None:
        """Poll ``/health`` until it answers 200; raise EngineError after ``timeout`` s or if ``alive()`` turns False."""
        deadline = time.monotonic() + timeout
        while True:
            if await self.health(timeout=min(5.0, max(0.5, deadline - time.monotonic()))):
                return
            if alive is not None and not alive():
                raise EngineError(self.url, "/health", None, "the engine process exited before it became healthy")
            if time.monotonic() >= deadline:
                raise EngineError(self.url, "/health", None,
                                  f"timed out after {timeout:.0f}s waiting for the engine to become healthy "
                                  "(raise --engine-startup-timeout if the model is large)")
            await asyncio.sleep(interval)

    async def get_model_info(self) -> dict:
        return await self._get("/get_model_info")

    async def get_load(self) -> dict:
        """``/get_load``: a list with one entry per data-parallel rank; the first is returned. The embedded
        engine reports ``num_running_reqs``, ``num_waiting_reqs`` and step counters; SGLang's keys vary by version."""
        loads = await self._get("/get_load")
        return loads[0] if isinstance(loads, list) else loads

    async def get_server_info(self) -> dict:
        return await self._get("/get_server_info")

    # -- scheduling --------------------------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort") -> Any:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation mode {mode!r} is not one of abort, retract, in_place")
        return await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        return await self._post("/continue_generation", {})

    async def flush_cache(self) -> Any:
        return await self._post("/flush_cache")

    async def abort(self, rid: str) -> Any:
        return await self._post("/abort_request", {"rid": rid})

    async def abort_all(self) -> Any:
        return await self._post("/abort_request", {"abort_all": True})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self._post("/resume_memory_occupation", {"tags": tags})

    # -- weights -----------------------------------------------------------------------------------
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "nccl",
                                        timeout: float | None = None) -> Any:
        """Blocks (server side) until the trainer joins the group: call it concurrently with the trainer's init."""
        return await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout)

    async def destroy_weights_update_group(self, group_name: str, timeout: float | None = None) -> Any:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name}, timeout)

    async def begin_weight_update(self, selector: str = "all") -> Any:
        return await self._post("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> Any:
        return await self._post("/end_weight_update", {})

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        load_format: str | None = None, weight_version: str | int | None = None, flush_cache: bool = True,
        timeout: float | None = None, p2p_ranges: list[list[list[int]]] | None = None,
        whole_sync: str | None = None, bucket_order: tuple[str, int] | None = None,
    ) -> Any:
        """Returns after the engine received the broadcast(s): issue it concurrently with the trainer's.
        ``p2p_ranges`` (``--update-weight-transfer-mode p2p``, embedded engine only): per trainer rank, the byte
        ranges of the flattened bucket it sends point to point. ``whole_sync`` (embedded engine only, see
        :func:`whole_sync_params`): this one request is the whole sync, paused in that mode. ``bucket_order``
        (embedded engine only, :func:`bucket_order_params`): this bucket's place in its sync."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        payload = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                   "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
                   "load_format": load_format, "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if p2p_ranges is not None:
            payload["p2p_ranges"] = p2p_ranges
        params = {**(whole_sync_params(whole_sync) or {}), **bucket_order_params(bucket_order)}
        return await self._post("/update_weights_from_distributed", payload, timeout, params or None)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None,
                                         weight_version: str | int | None = None, flush_cache: bool = True,
                                         timeout: float | None = None, whole_sync: str | None = None) -> Any:
        payload = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                   "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_tensor", payload, timeout, whole_sync_params(whole_sync))

    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None,
                                       load_format: str | None = None, flush_cache: bool = True,
                                       timeout: float | None = None) -> Any:
        payload = {"model_path": str(model_path), "load_format": load_format, "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_disk", payload, timeout)

    async def update_weight_version(self, new_version: str | int) -> Any:
        # SGLang's abort_all_requests defaults to true: say false, so paused (retracted) requests survive the sync
        return await self._post("/update_weight_version", {"new_version": str(new_version), "abort_all_requests": False})

    # -- LoRA adapters (SGLang's io_struct bodies; answered with LoRAUpdateOutput) -------------------------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = None) -> Any:
        return await self._post("/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)}, timeout)

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict,
                                             serialized_named_tensors: list[str], load_format: str | None = None,
                                             timeout: float | None = None) -> Any:
        payload = {"lora_name": lora_name, "config_dict": dict(config_dict),
                   "serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format}
        return await self._post("/load_lora_adapter_from_tensors", payload, timeout)

    async def load_lora_adapter_from_distributed(self, lora_name: str, config_dict: dict, names: list[str],
                                                 dtypes: list[str], shapes: list[list[int]], group_name: str,
                                                 timeout: float | None = None) -> Any:
        payload = {"lora_name": lora_name, "config_dict": dict(config_dict), "names": list(names),
                   "dtypes": list(dtypes), "shapes": [list(s) for s in shapes], "group_name": group_name}
        return await self._post("/load_lora_adapter_from_distributed", payload, timeout)

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> Any:
        return await self._post("/unload_lora_adapter", {"lora_name": lora_name}, timeout)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self._post("/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)})


# -- synchronous use from plain threads -------------------------------------------------------------
def run_sync(coro: Awaitable[T], timeout: float | None = None) -> T:
    """Run ``coro`` on the shared background loop (:mod:`miles.utils.async_utils`) and wait at most ``timeout`` s."""
    from miles.utils.async_utils import run_sync as _run_sync

    return _run_sync(coro, timeout)


class SyncEngineControl:
    """``EngineControl`` for threads: the same methods, blocking, bounded by the call's timeout."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0):
        self._ctl = EngineControl(url, api_key, timeout)
        self.url = self._ctl.url

    def __getattr__(self, name: str):
        fn = getattr(self._ctl, name)
        if not asyncio.iscoroutinefunction(fn):
            return fn

        def call(*args, **kwargs):
            limit = kwargs.get("timeout") or self._ctl.timeout
            return run_sync(fn(*args, **kwargs), timeout=limit + 30.0)
        return call

    def close(self) -> None:
        run_sync(self._ctl.close(), timeout=10.0)
