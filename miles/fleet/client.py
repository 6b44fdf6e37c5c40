"""The HTTP client of the engine fleet: generation requests (the rollout's) and per-engine control calls.

Everything that talks to an engine (SGLang or the embedded engine, same protocol) goes through here:

- ``EngineClient``: ``/generate`` with bounded concurrency (an ``asyncio.Semaphore`` of
  ``--sglang-server-concurrency`` x engines), a timeout per attempt and bounded retries on connection
  errors, timeouts, 5xx and 429. Through the router a retry lands on another engine (the router picks);
  given several engine URLs directly, the client rotates among them and skips a failing one for a while.
  A request's ``routing_key`` travels as sglang-router's ``X-SMG-Routing-Key`` header (its ``manual`` policy sends
  every request of one key to the same engine); given engine URLs directly, the client itself sends a key's requests
  to one engine (a hash of the key picks it; the next healthy one while it is failing).
  Each response carries ``resp["miles"]``: rid, the URL that served it, attempts, latency, errors seen.
  ``abort(rid)`` / ``abort_all()`` also reach a request that is between attempts (in its retry backoff or
  waiting for a concurrency slot): it wakes at once, sends no further attempt and answers like an
  engine-side abort (``finish_reason.type == "abort"``), so the caller sees exactly one aborted answer.
- ``EngineControl``: one engine's health, pause/continue, cache, memory and weight-update endpoints, used
  by the weight-sync and fault-tolerance planes.
- ``SyncEngineControl`` / ``run_sync``: the same calls from plain threads, on one background event loop.

Every call is bounded by a timeout; failures raise ``EngineError(url, endpoint, status, message)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp

from miles.utils.errors import MilesError
from miles.utils.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's routing key (its manual policy; Miles's Sample.routing_key)
# Fields of /generate owned by EngineClient.generate's own arguments.
_OWN_FIELDS = frozenset({"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream"})


class EngineError(MilesError):
    """An engine (or router) call failed. ``status`` is None when no HTTP answer came (connection, timeout)."""

    def __init__(self, url: str, endpoint: str, status: int | None, message: str, *, timed_out: bool = False):
        self.url, self.endpoint, self.status, self.message = url, endpoint, status, message
        self.timed_out = timed_out
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{endpoint} on {url} failed ({what}): {message}")

    @property
    def retryable(self) -> bool:
        """Worth retrying (maybe elsewhere): no answer, a 5xx, or 429 (busy)."""
        return self.status is None or self.status >= 500 or self.status == 429


def _error_message(body: Any) -> str:
    """A readable message out of SGLang's, FastAPI's or the router's error bodies."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or json.dumps(err))
        if isinstance(err, str):
            return err
        for key in ("message", "detail", "error_message"):    # error_message: SGLang's LoRAUpdateOutput
            if body.get(key):
                return str(body[key])
        return json.dumps(body)[:1000]
    return str(body)[:1000] if body not in (None, "") else "(empty body)"


def _auth_hint(status: int, message: str) -> str:
    if status == 401:
        return f"{message} -- the engine/router wants an API key: pass the run's key (--sglang-api-key) to the client"
    return message


class _Http:
    """One aiohttp session per event loop, an auth header, and uniform error handling."""

    def __init__(self, api_key: str | None, timeout: float, connection_limit: int = 100):
        if timeout <= 0:
            raise ValueError(f"HTTP timeout must be > 0 seconds, got {timeout}")
        self.api_key = api_key
        self.timeout = float(timeout)
        self._limit = connection_limit
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, force_close=False),
                headers=self._headers())
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _request(self, method: str, url: str, endpoint: str, payload: Any = None,
                       timeout: float | None = None, params: dict[str, str] | None = None,
                       headers: dict[str, str] | None = None) -> Any:
        """Send one request (``headers``: added to the session's); return the parsed body of a 2xx answer, raise
        EngineError otherwise."""
        session = await self._get_session()
        limit = self.timeout if timeout is None else float(timeout)
        try:
            async with session.request(method, url.rstrip("/") + endpoint, json=payload, params=params, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                raw = await resp.read()
                body: Any = raw.decode("utf-8", "replace")
                if raw and (resp.content_type == "application/json" or raw[:1] in (b"{", b"[")):
                    try:
                        body = json.loads(raw)
                    except ValueError:
                        pass
                if not (200 <= resp.status < 300):
                    raise EngineError(url, endpoint, resp.status, _auth_hint(resp.status, _error_message(body)))
                return body
        except TimeoutError as e:
            raise EngineError(url, endpoint, None, f"timed out after {limit:.1f}s", timed_out=True) from e
        except aiohttp.ClientError as e:
            raise EngineError(url, endpoint, None, f"{type(e).__name__}: {e}") from e


def _check_success(url: str, endpoint: str, body: Any) -> Any:
    """SGLang's control endpoints answer ``{"success": bool, "message": str}``; a false one is an error."""
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineError(url, endpoint, 200, _error_message(body))
    return body


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


class EngineClient(_Http):
    """Generation requests with bounded concurrency, per-attempt timeouts and bounded retries.

    ``base_url`` is the router's URL, or one or several engine URLs (the client then rotates among
    them, round robin, skipping for ``cooldown`` seconds an engine whose request failed).
    """

    def __init__(self, base_url: str | Sequence[str], api_key: str | None = None, timeout: float = 600.0,
                 max_retries: int = 3, concurrency: int = 512, backoff: float = 0.5, max_backoff: float = 5.0,
                 cooldown: float = 10.0, engine_urls: Sequence[str] | None = None, lora_path: str | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency (--sglang-server-concurrency x engines) must be >= 1, got {concurrency}")
        if max_retries < 0:
            raise ValueError(f"--rollout-request-retries must be >= 0, got {max_retries}")
        super().__init__(api_key, timeout, connection_limit=concurrency)
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("EngineClient needs at least one router or engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_retries = max_retries
        self.concurrency = concurrency
        # the LoRA adapter every /generate names (SGLang's lora_path) when the engines serve the trained adapters
        self.lora_path = lora_path
        self.backoff, self.max_backoff, self.cooldown = backoff, max_backoff, cooldown
        # Engines reachable directly: the URLs themselves when several are given, else (behind a router)
        # the engines the caller lists; used to broadcast aborts.
        self.engine_urls: list[str] = [u.rstrip("/") for u in engine_urls] if engine_urls else (
            list(self.urls) if len(self.urls) > 1 else [])
        self.stats = {"requests": 0, "retries": 0, "failed": 0, "aborted": 0}  # aborted: stopped between attempts
        self._rr = itertools.count()
        self._bad_until: dict[str, float] = {}
        self._inflight: dict[str, tuple[str, str]] = {}  # rid -> (attempt rid, url) of the attempt on an engine
        self._pending: dict[str, asyncio.Event] = {}  # rid -> set once aborted, for every generate() in progress
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, rollout, base_url: str | Sequence[str], num_engines: int,
                    api_key: str | None) -> EngineClient:
        """A client sized by ``--sglang-server-concurrency`` x ``num_engines`` with the rollout timeouts."""
        return cls(base_url, api_key=api_key, timeout=rollout.rollout_request_timeout,
                   max_retries=rollout.rollout_request_retries,
                   concurrency=max(1, rollout.sglang_server_concurrency * max(1, num_engines)))

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.concurrency), loop
        return self._sem

    def _pick_url(self, avoid: str | None, routing_key: str | None = None) -> str:
        """The URL of the next attempt: round robin, or for a routing key the engine its hash picks (the next in
        order while that one is failing or was just tried)."""
        if len(self.urls) == 1:
            return self.urls[0]
        now = time.monotonic()
        if routing_key is None:
            start = next(self._rr)
        else:
            start = int.from_bytes(hashlib.blake2b(routing_key.encode(), digest_size=8).digest(), "big") % len(self.urls)
        order = [self.urls[(start + i) % len(self.urls)] for i in range(len(self.urls))]
        for url in order:
            if url != avoid and self._bad_until.get(url, 0.0) <= now:
                return url
        for url in order:  # every engine failed recently: try anything but the one that just failed
            if url != avoid:
                return url
        return order[0]

    async def generate(self, input_ids: Sequence[int], sampling_params: dict, return_logprob: bool = True,
                       rid: str | None = None, timeout: float | None = None,
                       extra: dict | None = None, routing_key: str | None = None) -> dict:
        """One prompt's ``/generate``; returns SGLang's response dict plus ``resp["miles"]`` metadata.

        ``timeout`` bounds each attempt (default: the client's); a failed attempt is retried up to
        ``max_retries`` times, each with its own rid (``<rid>-r<k>``) so that an engine never sees a
        duplicate rid. An aborted request (``finish_reason.type == "abort"``) is returned, not retried.
        ``routing_key``: sent as the ``X-SMG-Routing-Key`` header of every attempt (see the module docstring).
        """
        if int(sampling_params.get("n", 1)) != 1:
            raise ValueError("generate: sampling_params['n'] must be 1; use generate_group for n samples of one prompt")
        return (await self._generate(input_ids, sampling_params, 1, return_logprob, rid, timeout, extra,
                                     routing_key))[0]

    async def generate_group(self, input_ids: Sequence[int], sampling_params: dict, n: int,
                             return_logprob: bool = True, rid: str | None = None, timeout: float | None = None,
                             extra: dict | None = None, routing_key: str | None = None) -> list[dict]:
        """``n`` samples of one prompt in ONE ``/generate`` (``sampling_params.n``, which sglang-router passes
        through); returns the ``n`` answers in sample order, each with ``resp["miles"]`` (shared: one request).

        The engine names the samples ``<rid>_<j>`` (an abort of ``rid`` reaches them all) and, for a
        ``sampling_seed``, the embedded engine seeds sample ``j`` with ``sampling_seed + j``. Retries and
        aborts work as for :meth:`generate`, for the whole group."""
        if n < 1:
            raise ValueError(f"generate_group: n must be >= 1, got {n}")
        if "n" in sampling_params:
            raise ValueError("generate_group: give the sample count as n=, not in sampling_params")
        params = dict(sampling_params, n=int(n)) if n > 1 else dict(sampling_params)
        return await self._generate(input_ids, params, n, return_logprob, rid, timeout, extra, routing_key)

    async def _generate(self, input_ids: Sequence[int], sampling_params: dict, n: int, return_logprob: bool,
                        rid: str | None, timeout: float | None, extra: dict | None,
                        routing_key: str | None = None) -> list[dict]:
        if not input_ids:
            raise ValueError("generate: input_ids is empty; every request needs at least one prompt token")
        if routing_key is not None and (not isinstance(routing_key, str) or not routing_key
                                        or not routing_key.isprintable() or not routing_key.isascii()):
            raise ValueError(f"generate: routing_key {routing_key!r} must be a non-empty printable ASCII string "
                             f"(it travels as the {ROUTING_KEY_HEADER} header)")
        # only when set: subclasses and stand-ins with the older _request signature keep working
        headers = {"headers": {ROUTING_KEY_HEADER: routing_key}} if routing_key is not None else {}
        bad = _OWN_FIELDS.intersection(extra or {})
        if bad:
            raise ValueError(f"generate: extra fields {sorted(bad)} are set by generate's own arguments")
        rid = rid or uuid.uuid4().hex
        payload: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling_params),
                                   "return_logprob": bool(return_logprob), **(extra or {})}
        if self.lora_path is not None:
            payload.setdefault("lora_path", self.lora_path)
        if rid in self._pending:
            raise ValueError(f"generate: request id {rid!r} is already in progress on this client; rids must be unique")
        aborted = self._pending[rid] = asyncio.Event()
        errors: list[str] = []
        url: str | None = None
        t0 = time.monotonic()
        self.stats["requests"] += 1

        def stopped(attempts: int) -> list[dict]:
            return [self._aborted_answer(rid, len(input_ids), attempts, url, errors, t0) for _ in range(n)]

        try:
            async with self._semaphore():
                for attempt in range(self.max_retries + 1):
                    if aborted.is_set():  # aborted while waiting for a slot or in the backoff: no new attempt
                        return stopped(attempt)
                    url = self._pick_url(avoid=url if errors else None, routing_key=routing_key)
                    attempt_rid = rid if attempt == 0 else f"{rid}-r{attempt}"
                    self._inflight[rid] = (attempt_rid, url)
                    try:
                        resp = await self._request("POST", url, "/generate", {**payload, "rid": attempt_rid}, timeout,
                                                   **headers)
                    except EngineError as e:
                        errors.append(str(e))
                        if e.retryable:
                            self._bad_until[url] = time.monotonic() + self.cooldown
                            if e.timed_out:
                                await self._abort_quietly(url, attempt_rid)
                        if e.retryable and aborted.is_set():  # the abort cut this attempt short: not a failure
                            return stopped(attempt + 1)
                        if not e.retryable or attempt == self.max_retries:
                            self.stats["failed"] += 1
                            raise EngineError(url, "/generate", e.status,
                                              f"request {rid} failed after {attempt + 1} attempt(s): "
                                              + " | ".join(errors), timed_out=e.timed_out) from e
                        self.stats["retries"] += 1
                        logger.warning("generate %s: attempt %d failed, retrying: %s", rid, attempt + 1, e)
                        delay = min(self.max_backoff, self.backoff * 2 ** attempt)
                        try:  # the backoff ends early when the request is aborted
                            await asyncio.wait_for(aborted.wait(), delay)
                        except TimeoutError:
                            pass
                        continue
                    finally:
                        self._inflight.pop(rid, None)
                    answers = resp if n > 1 else [resp]
                    if not (isinstance(answers, list) and len(answers) == n
                            and all(isinstance(a, dict) and "meta_info" in a for a in answers)):
                        self.stats["failed"] += 1
                        raise EngineError(url, "/generate", 200, f"malformed response for request {rid} "
                                          f"({n} sample(s) expected): {str(resp)[:300]}")
                    meta = {"rid": rid, "attempt_rid": attempt_rid, "url": url, "attempts": attempt + 1,
                            "latency_s": time.monotonic() - t0, "errors": errors}
                    for a in answers:
                        a["miles"] = dict(meta)
                    return answers
                raise AssertionError("unreachable")
        finally:
            self._pending.pop(rid, None)

    def _aborted_answer(self, rid: str, prompt_len: int, attempts: int, url: str | None, errors: list[str],
                        t0: float) -> dict:
        """What an engine answers for an aborted request, for one the client stopped between attempts."""
        self.stats["aborted"] += 1
        meta = {"id": rid, "finish_reason": {"type": "abort", "message": "aborted by the client before the request "
                                             "could be sent again"}, "prompt_tokens": prompt_len,
                "completion_tokens": 0, "cached_tokens": 0, "output_token_logprobs": []}
        return {"text": "", "output_ids": [], "meta_info": meta,
                "miles": {"rid": rid, "attempt_rid": None, "url": url, "attempts": attempts,
                          "latency_s": time.monotonic() - t0, "errors": errors, "aborted_by_client": True}}

    async def _abort_quietly(self, url: str, rid: str) -> None:
        """Best effort: stop a timed-out attempt on its engine (through a router: on every known engine)."""
        targets = [url] if (url in self.engine_urls or not self.engine_urls) else self.engine_urls
        for target in targets:
            try:
                await self._request("POST", target, "/abort_request", {"rid": rid}, timeout=5.0)
            except EngineError as e:
                logger.debug("abort of timed-out %s on %s: %s", rid, target, e)

    async def abort(self, rid: str) -> bool:
        """Abort a request by the rid given to ``generate``; True if it was stopped here or an engine accepted it.

        A request between attempts (retry backoff, waiting for a slot) returns at once as aborted, without
        sending anything. One on an engine is aborted there; sglang-router does not route ``/abort_request``
        (404), so through a router the abort goes to every URL in ``self.engine_urls`` (keep the list current).
        """
        pending = self._pending.get(rid)
        if pending is not None:
            pending.set()  # no further attempt; wakes a backoff
        if rid not in self._inflight:
            if pending is not None:
                return True
            attempt_rid, url = rid, None  # not ours (another client's request): ask the engines
        else:
            attempt_rid, url = self._inflight[rid]
        if self.engine_urls and (url is None or url not in self.engine_urls):
            targets = list(self.engine_urls)
        else:
            targets = [url] if url else list(self.urls)
        ok = False
        for target in targets:
            try:
                await self._request("POST", target, "/abort_request", {"rid": attempt_rid}, timeout=10.0)
                ok = True
            except EngineError as e:
                logger.debug("abort %s on %s: %s", rid, target, e)
        return ok or pending is not None

    async def abort_all(self) -> int:
        """Abort every request of this client: those between attempts return at once as aborted, and every
        engine reachable directly (``self.engine_urls``, or the URLs given) gets ``abort_all``. Returns the
        number of this client's requests that were in progress."""
        rids = list(self._pending)
        for rid in rids:
            self._pending[rid].set()
        for target in self.engine_urls or self.urls:
            try:
                await self._request("POST", target, "/abort_request", {"abort_all": True}, timeout=10.0)
            except EngineError as e:
                logger.warning("abort_all on %s: %s", target, e)
        return len(rids)


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
