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

Modules: ``http_base`` (the session, ``EngineError``), ``control`` (``EngineControl``, ``SyncEngineControl``,
``run_sync``, the weight-sync query parameters); this module: ``EngineClient``, and the fleet's client names
re-exported for their importers (the weight-sync plane may import ``miles.fleet.client`` only).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
import uuid
from collections.abc import Sequence
from typing import Any

from miles.fleet.control import (
    BUCKET_PARAM,
    SYNC_ID_PARAM,
    WHOLE_SYNC_PARAM,
    EngineControl,
    SyncEngineControl,
    bucket_order_params,
    run_sync,
    whole_sync_params,
)
from miles.fleet.http_base import EngineError, _Http
from miles.utils.logging import get_logger

__all__ = ["BUCKET_PARAM", "ROUTING_KEY_HEADER", "SYNC_ID_PARAM", "WHOLE_SYNC_PARAM", "EngineClient", "EngineControl",
           "EngineError", "SyncEngineControl", "bucket_order_params", "run_sync", "whole_sync_params"]

logger = get_logger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's routing key (its manual policy; Miles's Sample.routing_key)
# Fields of /generate owned by EngineClient.generate's own arguments.
_OWN_FIELDS = frozenset({"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream"})


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
